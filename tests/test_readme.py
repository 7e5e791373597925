"""The README's configuration table documents exactly the settings of the code's table
(cc/transport/settings.h), with its defaults and bounds."""
import re
from pathlib import Path

import pytest

from tf_rdma.config import load_config, settings
from tf_rdma.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
TESTING = REPO / "docs" / "testing.md"
# tf_rdma neither reads nor refuses these (cc/transport/config.cc): the test harness's.
TEST_HARNESS_PREFIXES = ("TF_RDMA_TEST_", "TF_RDMA_SOFTROCE_")


def documented_rows(page=README):
    """[(variable, its default cell with backticks removed, its meaning cell)] from the variables
    table of `page`."""
    rows = re.findall(r"^\| `(TF_RDMA_[A-Z0-9_]+)` \| ([^|]+) \| (.*) \|$", page.read_text(), re.MULTILINE)
    return [(name, default.strip().strip("`"), meaning) for name, default, meaning in rows]


def documented_defaults(page=README):
    """[(variable, its default cell, backticks removed)] from the variables table of `page`."""
    return [(name, default) for name, default, _ in documented_rows(page)]


def test_every_variable_is_documented_once_and_nothing_else():
    documented = [name for name, _ in documented_defaults()]
    assert sorted(documented) == sorted(s.name for s in settings())
    assert len(documented) == len(set(documented))


def test_the_test_harness_variables_are_documented_in_testing_md_not_in_the_product():
    # Every harness variable the code names, but in the tests of the prefix rule, which make some up.
    rule_tests = {REPO / "tests" / "test_readme.py", REPO / "tests" / "transport" / "test_config.py"}
    read = set()
    for folder in ("tests", "tools", "tf_rdma", "cc"):
        for path in (REPO / folder).rglob("*"):
            if path.suffix in (".py", ".cc", ".h", ".sh") and path.is_file() and path not in rule_tests:
                read |= set(re.findall(r"\b((?:TF_RDMA_TEST_|TF_RDMA_SOFTROCE_)[A-Z0-9_]*[A-Z0-9])\b",
                                       path.read_text(errors="replace")))
    documented = [name for name, _ in documented_defaults(TESTING)]
    assert sorted(documented) == sorted(read)
    assert len(documented) == len(set(documented))
    assert not [s.name for s in settings() if s.name.startswith(TEST_HARNESS_PREFIXES)]


def test_documented_defaults_are_the_codes_defaults():
    assert dict(documented_defaults()) == {s.name: s.default for s in settings()}


def test_the_bounds_the_readme_states_are_the_codes_bounds():
    """A row that states its setting's range ("(0 to 64)", "At least 100") states the table's."""
    table = {s.name: s for s in settings()}
    for name, _, meaning in documented_rows():
        setting = table[name]
        for low, high in re.findall(r"\((-?\d+) to (-?\d+)[;)]", meaning):
            assert (int(low), int(high)) == (setting.minimum, setting.maximum), (name, meaning)
        for low in re.findall(r"At least (\d+)\.", meaning):
            assert int(low) == setting.minimum, (name, meaning)


@pytest.mark.parametrize("setting", settings(), ids=lambda s: s.name)
def test_a_numeric_settings_bounds_are_accepted_and_one_past_them_refused_naming_them(setting):
    """Every numeric row of the table reaches a field of the configuration, within its bounds."""
    if setting.minimum is None:
        return
    for bound in (setting.minimum, setting.maximum):
        if str(bound) != setting.default:
            assert load_config({setting.name: str(bound)}) != load_config({}), (setting.name, bound)
    for outside in (setting.minimum - 1, setting.maximum + 1):
        with pytest.raises(ConfigError, match=f"{setting.name}='{outside}' is not .* between "):
            load_config({setting.name: str(outside)})


# Defaults written as a value (not "(auto)", "(unset)"): setting the variable to it must change
# nothing, or the table promises a default the code does not apply.
@pytest.mark.parametrize("name, default", [(n, d) for n, d in documented_defaults() if not d.startswith("(")])
def test_setting_a_variable_to_its_documented_default_changes_nothing(name, default):
    assert load_config({name: default}) == load_config({})


def test_an_empty_secret_is_the_default():
    assert load_config({"TF_RDMA_SECRET": ""}) == load_config({})


def test_every_relative_link_of_the_readme_and_docs_resolves():
    for page in [README, *sorted((README.parent / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" in target:
                continue
            assert (page.parent / target).exists(), f"{page.name} links to {target}, which does not exist"


def test_the_readme_is_a_first_page_not_a_lab_notebook():
    text = README.read_text()
    assert len(text.splitlines()) < 250
    # Measured durations of the test suite belong in no document.
    for page in [README, *(README.parent / "docs").glob("*.md")]:
        assert not re.search(r"make test[^.]*\b(took|takes) (about )?[\d,]+ (s|min|minutes)\b", page.read_text()), page

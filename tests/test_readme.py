"""The README's configuration table documents exactly the variables tf_rdma reads, with the defaults
the code applies."""
import re
from pathlib import Path

import pytest

from tf_rdma.config import load_config, variables

README = Path(__file__).resolve().parents[1] / "README.md"


def documented_defaults():
    """{variable: its default cell, backticks removed} from the README's configuration table."""
    rows = re.findall(r"^\| `(TF_RDMA_[A-Z0-9_]+)` \| ([^|]+) \|", README.read_text(), re.MULTILINE)
    return [(name, default.strip().strip("`")) for name, default in rows]


def test_every_variable_is_documented_once_and_nothing_else():
    documented = [name for name, _ in documented_defaults()]
    assert sorted(documented) == sorted(name for name, _, _ in variables())
    assert len(documented) == len(set(documented))


def test_documented_defaults_are_the_codes_defaults():
    assert dict(documented_defaults()) == {name: default for name, default, _ in variables()}


# Defaults written as a value (not "(auto)", "(unset)"): setting the variable to it must change
# nothing, or the table promises a default the code does not apply.
@pytest.mark.parametrize("name, default", [(n, d) for n, d in documented_defaults()
                                           if not d.startswith("(") and not n.startswith(
                                               ("TF_RDMA_TEST_", "TF_RDMA_SOFTROCE_"))])
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

"""The README's configuration table documents exactly the variables tf_rdma reads."""
import re
from pathlib import Path

from tf_rdma.config import variables

README = Path(__file__).resolve().parents[1] / "README.md"


def test_every_variable_is_documented_once_and_nothing_else():
    documented = re.findall(r"^\| `(TF_RDMA_[A-Z0-9_]+)` \|", README.read_text(), re.MULTILINE)
    assert sorted(documented) == sorted(name for name, _, _ in variables())
    assert len(documented) == len(set(documented))

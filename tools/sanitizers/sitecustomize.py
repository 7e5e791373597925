"""Copied next to a sanitized build (build/asan/, build/tsan/) by `python -m tools.sanitizers build`,
which puts that folder on PYTHONPATH when it runs a command against it: the interpreter imports this
at start-up, in every process a test starts too, and from then on `tf_rdma._transport` is the
sanitized extension beside this file, whatever `tf_rdma` package (the repository's, with its own
build) is first on the path. The extension finds its sanitized transport library by its rpath."""
import importlib.util
import sys
from pathlib import Path

_EXTENSIONS = Path(__file__).resolve().parent / "tf_rdma"


class _SanitizedTransportFinder:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name != "tf_rdma._transport":
            return None
        found = sorted(_EXTENSIONS.glob("_transport.*.so"))
        if len(found) != 1:
            raise ImportError(f"expected one sanitized tf_rdma._transport in {_EXTENSIONS}, found {found}: "
                              "build it with `python -m tools.sanitizers build`")
        return importlib.util.spec_from_file_location(name, found[0])


sys.meta_path.insert(0, _SanitizedTransportFinder)

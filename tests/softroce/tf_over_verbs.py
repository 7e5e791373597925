"""Runs in the Soft-RoCE guest, TF_RDMA_BACKEND=verbs over rxe0: two MultiWorkerMirroredStrategy
workers running tests/tf/programs/collective.py's all-reduces. Prints the results' digests and
tf_rdma's stats as one JSON line, for tests/softroce/test_tf_over_verbs.py to check. Run from the
repository's root: `python -m tests.softroce.tf_over_verbs HOST STEPS ELEMENTS`.

The TF1 session over verbs runs across the two guests (tf_across_hosts.py): one TensorFlow process
per guest there, where a session here would cost two more."""
import json
import os
import sys
import tempfile
from pathlib import Path

from tests.tf.programs.cluster import PROGRAMS, Cluster, digest

COLLECTIVE_PROGRAM = PROGRAMS / "collective.py"
VERBS = {"TF_RDMA_BACKEND": "verbs"}
TIMEOUT = float(os.environ.get("TF_OVER_VERBS_TIMEOUT", "800"))


def all_reduce(tmp, host, steps, elements):
    outputs = [str(tmp / f"all-reduce-{i}.npz") for i in range(2)]
    with Cluster(tmp, {"worker": 2}, VERBS, host=host) as cluster:
        for i in range(2):
            cluster.start("worker", i, "all_reduce_worker", program=COLLECTIVE_PROGRAM, transport="rdma",
                          output=outputs[i], steps=steps, elements=elements)
        for i in range(2):
            if cluster.wait("worker", i, timeout=TIMEOUT) != 0:
                raise SystemExit(cluster.log("worker", i)[-5000:])
    with open(outputs[0] + ".stats.json") as f:
        return {"digests": [digest(o) for o in outputs], "stats": json.load(f)}


def main(host, steps, elements):
    result = all_reduce(Path(tempfile.mkdtemp()), host, steps, elements)
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], *map(int, sys.argv[2:])))

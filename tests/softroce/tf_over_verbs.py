"""Runs in the Soft-RoCE guest: a ps and a worker process, TF_RDMA_BACKEND=verbs over rxe0, the
worker running tests/tf/programs.py's compare_worker. Prints the results' digest and tf_rdma's
stats as one JSON line, for tests/softroce/test_tf_over_verbs.py to compare with a gRPC run."""
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tf"))
from cluster import Cluster, digest  # noqa: E402


def main(host, big_mib):
    tmp = Path(tempfile.mkdtemp())
    output = str(tmp / "verbs.npz")
    with Cluster(tmp, {"ps": 1, "worker": 1}, {"TF_RDMA_BACKEND": "verbs"}, host=host) as cluster:
        cluster.start("ps", 0, "serve", transport="rdma")
        cluster.start("worker", 0, "compare_worker", transport="rdma", output=output, big_mib=big_mib)
        code = cluster.wait("worker", 0, timeout=float(os.environ.get("TF_OVER_VERBS_TIMEOUT", "1500")))
        if code != 0:
            print(cluster.log("worker", 0)[-5000:], "\n--- ps ---\n", cluster.log("ps", 0)[-3000:])
            return code
    with open(output + ".stats.json") as f:
        stats = json.load(f)
    print("RESULT " + json.dumps({"digest": digest(output), "stats": stats}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2])))

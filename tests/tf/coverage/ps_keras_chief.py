"""examples/tf2_ps_keras.py's coordinator, unchanged, plus what the coverage harness needs from
it: `python ps_keras_chief.py OUTPUT.npz <the example's chief arguments>` runs the example's
run_coordinator, then writes the model's final weights and losses to OUTPUT.npz (the example has
no --save) and this process's tf_rdma.stats() to OUTPUT.npz.stats.json."""
import json
import os
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
sys.path.insert(0, str(EXAMPLES))
import cluster_utils as cu  # noqa: E402
import tf2_ps_keras as example  # noqa: E402


def main(output, argv):
    import numpy as np
    models = []
    build_model = example.build_model

    def build_and_keep(*args, **kwargs):
        # The example builds its model inside run_coordinator and does not return it: keep it.
        models.append(build_model(*args, **kwargs))
        return models[-1]

    example.build_model = build_and_keep
    args = example.parse_args(argv)
    cluster, job, task = cu.resolve_task(args.cluster, args.job, args.task)
    assert job == "chief", job
    result = example.run_coordinator(args, cluster, task)
    (model,) = models
    np.savez(output, epoch_losses=np.asarray(result["epoch_losses"], np.float64),
             final_test_loss=np.float64(result["final_test_loss"]),
             **{f"weight{i}": w for i, w in enumerate(model.get_weights())})
    stats = {}
    if args.transport == "rdma":
        import tf_rdma
        stats = tf_rdma.stats()
    with open(output + ".stats.json", "w") as f:
        json.dump(stats, f)
    sys.stdout.flush()
    os._exit(0)  # as the example's chief: its coordinator threads keep RPCs open


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])

#!/usr/bin/env python3
"""TF_CONFIG for a pod of a StatefulSet, from its ordinal, then runs the task's command.

A StatefulSet's pods are <statefulset>-0 ... <statefulset>-(N-1), each reachable through the
headless Service named in spec.serviceName as <pod>.<service>.<namespace>.svc. This writes the
TF_CONFIG the training operator would (every task of one job, this pod's index) and execs the rest:

    entrypoint.py -- python3 /usr/src/tf_rdma/examples/tf2_mwms_keras.py --transport rdma

From the environment (the manifest sets them; POD_NAME and POD_NAMESPACE from the downward API):
    POD_NAME, POD_NAMESPACE
    TF_CONFIG_SERVICE    the headless Service (the StatefulSet's spec.serviceName)
    TF_CONFIG_REPLICAS   the StatefulSet's spec.replicas: every pod must know the whole cluster
    TF_CONFIG_PORT       TensorFlow's port; tf_rdma listens at it + TF_RDMA_PORT_OFFSET
    TF_CONFIG_JOB        the TensorFlow job name (default "worker")
"""
import json
import os
import sys

# Not TF_RDMA_*: tf_rdma refuses TF_RDMA_ variables it does not know.
SETTINGS = ("POD_NAME", "POD_NAMESPACE", "TF_CONFIG_SERVICE", "TF_CONFIG_REPLICAS", "TF_CONFIG_PORT")


class EntrypointError(ValueError):
    pass


def tf_config(pod_name, namespace, service, replicas, port, job="worker"):
    """The TF_CONFIG (as a dict) of the StatefulSet pod `pod_name`."""
    statefulset, _, ordinal = pod_name.rpartition("-")
    if not statefulset or not ordinal.isdigit():
        raise EntrypointError(f"POD_NAME={pod_name!r} is not a StatefulSet pod's name (<statefulset>-<ordinal>); "
                              "set POD_NAME from the downward API (metadata.name)")
    try:
        replicas, port = int(replicas), int(port)
    except ValueError as e:
        raise EntrypointError(f"TF_CONFIG_REPLICAS and TF_CONFIG_PORT must be integers: {e}") from e
    if int(ordinal) >= replicas:
        raise EntrypointError(
            f"pod {pod_name} has ordinal {ordinal}, and TF_CONFIG_REPLICAS={replicas}: the StatefulSet was "
            "scaled without updating TF_CONFIG_REPLICAS; set it to spec.replicas (every pod must agree)")
    hosts = [f"{statefulset}-{i}.{service}.{namespace}.svc:{port}" for i in range(replicas)]
    return {"cluster": {job: hosts}, "task": {"type": job, "index": int(ordinal)}}


def main(argv):
    command = argv[argv.index("--") + 1:] if "--" in argv else argv
    if not command:
        raise EntrypointError("no command to run: entrypoint.py -- <command> [args...]")
    missing = [name for name in SETTINGS if not os.environ.get(name)]
    if missing:
        raise EntrypointError(f"set {', '.join(missing)} in the pod's environment (see deploy/README.md)")
    config = tf_config(os.environ["POD_NAME"], os.environ["POD_NAMESPACE"], os.environ["TF_CONFIG_SERVICE"],
                       os.environ["TF_CONFIG_REPLICAS"], os.environ["TF_CONFIG_PORT"],
                       os.environ.get("TF_CONFIG_JOB", "worker"))
    os.environ["TF_CONFIG"] = json.dumps(config)
    os.execvp(command[0], command)


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except EntrypointError as e:
        sys.exit(f"entrypoint: {e}")

"""tf.data service trainers for tests/tf/test_data_service.py (the dispatcher and workers are
`python -m tf_rdma bench data`'s): `python data_service.py FUNCTION JSON_ARGS`."""
import hashlib
import json
import os
import sys
import time

from tf_rdma.bench.data import data_bytes_received, dispatcher, worker  # noqa: F401 (run by name)

# Iterations a trainer runs to show that each one's connections end with it.
ITERATIONS_FOR_LEAKS = 4


def elements(count, floats):
    """Element i: `floats` float32 values from i (travels on its own when large), a small int64
    vector (inline) and a string (as TensorProto): every way a component travels."""
    import tensorflow as tf
    return tf.data.Dataset.range(count).map(lambda i: {
        "image": tf.cast(i, tf.float32) + tf.range(floats, dtype=tf.float32),
        "label": tf.stack([i, i * 7, -i]),
        "name": tf.strings.join(["element-", tf.strings.as_string(i)]),
    })


def _distributed(dataset, dispatcher_port, mode, protocol, compression):
    import tensorflow as tf
    options = {"data_transfer_protocol": protocol} if protocol else {}
    return dataset.apply(tf.data.experimental.service.distribute(
        mode, f"grpc://localhost:{dispatcher_port}", job_name=None, compression=compression, **options))


def _fingerprint(element):
    import numpy as np
    h = hashlib.sha256()
    values = {key: np.asarray(element[key].numpy()) for key in sorted(element)}
    for key, value in values.items():
        h.update(f"{key}|{value.dtype.str}|{value.shape}|".encode())
        h.update(value.tobytes())
    return int(element["label"][0]), h.hexdigest(), sum(value.nbytes for value in values.values())


def read(dispatcher_port, output, count=40, floats=65536):
    """Reads the dataset over gRPC and over tf_rdma in each processing mode; writes what it got."""
    import tensorflow as tf
    import tf_rdma
    results = {}
    for mode, compression in (("parallel_epochs", None), ("distributed_epoch", None), ("distributed_epoch", "AUTO")):
        for protocol in ("grpc", tf_rdma.DATA_TRANSFER_PROTOCOL):
            before = data_bytes_received()
            got = [_fingerprint(e) for e in _distributed(elements(count, floats), dispatcher_port, mode,
                                                           protocol, compression)]
            results[f"{mode}/{compression or 'none'}/{protocol}"] = {
                "elements": sorted([index, digest] for index, digest, _ in got),
                "element_bytes": sum(nbytes for _, _, nbytes in got),
                "tf_rdma_bytes": data_bytes_received() - before,
            }
    # TensorFlow makes a client per worker for each iteration: its tf_rdma connection must end with
    # the iteration. Descriptors a trainer holds after more iterations, over each protocol (gRPC's
    # own may vary a little).
    for protocol in ("grpc", tf_rdma.DATA_TRANSFER_PROTOCOL):
        before = _descriptors_after(elements(4, 16), dispatcher_port, protocol, 1)
        after = _descriptors_after(elements(4, 16), dispatcher_port, protocol, ITERATIONS_FOR_LEAKS)
        results[f"descriptors_gained/{protocol}"] = after - before
    results["stats"] = tf_rdma.stats()
    with open(output, "w") as f:
        json.dump(results, f)
    print("done", flush=True)


def _descriptors_after(dataset, dispatcher_port, protocol, iterations):
    for _ in range(iterations):
        for _ in _distributed(dataset, dispatcher_port, "parallel_epochs", protocol, None):
            pass
    time.sleep(0.5)  # connections end on their I/O threads
    return len(os.listdir("/proc/self/fd"))


def read_until_killed(dispatcher_port, output, kill_file, protocol="tf_rdma", count=400, floats=65536):
    """Reads an epoch from two workers; after the first elements, asks the test to kill one. The
    epoch then waits for the lost worker (over gRPC without end, over tf_rdma until its
    TF_RDMA_CONNECT_TIMEOUT_MS passed): what arrived so far is in `output`, rewritten after every
    element."""
    got = []
    for element in _distributed(elements(count, floats), dispatcher_port, "parallel_epochs", protocol, None):
        got.append(_fingerprint(element)[:2])
        if len(got) == 10:
            open(kill_file, "w").close()
            time.sleep(1)  # the worker dies while this trainer's next reads are in flight
        with open(output + ".tmp", "w") as f:
            json.dump({"elements": got}, f)
        os.replace(output + ".tmp", output)


def read_while_worker_lost(dispatcher_port, output, kill_file, killed_file, watch_seconds, count=400, floats=4096):
    """Reads four epochs at once, over tf_rdma and over gRPC in both processing modes, from the same
    two workers. Once each read 10 elements, asks the test to kill one worker (`kill_file`) and
    waits for the test's word that it did (`killed_file`, holding the kill's time.time()). Then
    records, per read, the error it ended with and when, or that it still waits `watch_seconds`
    after the kill."""
    import threading
    import tensorflow as tf
    import tf_rdma
    runs = [(mode, protocol) for protocol in (tf_rdma.DATA_TRANSFER_PROTOCOL, "grpc")
            for mode in ("parallel_epochs", "distributed_epoch")]
    results = {f"{mode}/{protocol}": {"elements": 0} for mode, protocol in runs}
    ten_read = threading.Semaphore(0)
    killed = threading.Event()

    def read(mode, protocol):
        result = results[f"{mode}/{protocol}"]
        try:
            for _ in _distributed(elements(count, floats), dispatcher_port, mode, protocol, None):
                result["elements"] += 1
                if result["elements"] == 10:
                    ten_read.release()
                    killed.wait()  # every read still has elements to come from the worker killed
            result["end"] = time.time()
        except tf.errors.OpError as e:
            result["error_at"] = time.time()
            result["error"] = f"{type(e).__name__}: {e.message}"

    threads = [threading.Thread(target=read, args=run, daemon=True) for run in runs]
    for thread in threads:
        thread.start()
    for _ in runs:
        ten_read.acquire()
    open(kill_file, "w").close()
    while not os.path.exists(killed_file) or not open(killed_file).read():
        time.sleep(0.05)
    killed_at = float(open(killed_file).read())
    killed.set()
    for thread in threads:
        thread.join(max(0.0, killed_at + watch_seconds - time.time()))
    with open(output, "w") as f:
        json.dump({"killed_at": killed_at, "watched_until": time.time(), "runs": results}, f)
    print("done", flush=True)
    os._exit(0)  # the gRPC reads of the lost worker never end


def read_with_protocol(dispatcher_port, output, count=20, floats=1024):
    """One parallel_epochs read over tf_rdma; records the elements, or the error TensorFlow raised."""
    import tensorflow as tf
    import tf_rdma
    result = {}
    try:
        result["elements"] = sorted(_fingerprint(e)[:2] for e in _distributed(
            elements(count, floats), dispatcher_port, "parallel_epochs", tf_rdma.DATA_TRANSFER_PROTOCOL, None))
    except tf.errors.OpError as e:
        result["error"] = f"{type(e).__name__}: {e.message}"
    result["expected"] = sorted(_fingerprint(e)[:2] for e in elements(count, floats))
    result["stats"] = tf_rdma.stats()
    with open(output, "w") as f:
        json.dump(result, f)
    print("done", flush=True)


def cancel_mid_read(dispatcher_port, output, floats=1 << 20):
    """Drops iterators over an endless dataset of 4 MiB elements with reads in flight, then reads
    again: nothing may hang, and the worker must still serve."""
    import gc
    import tensorflow as tf
    import tf_rdma
    endless = elements(1 << 30, floats)
    for _ in range(3):
        iterator = iter(_distributed(endless, dispatcher_port, "parallel_epochs", tf_rdma.DATA_TRANSFER_PROTOCOL, None))
        for _ in range(5):
            next(iterator)
        del iterator
        gc.collect()
    after = [_fingerprint(e)[:2] for e in _distributed(elements(5, 256), dispatcher_port, "parallel_epochs",
                                                      tf_rdma.DATA_TRANSFER_PROTOCOL, None)]
    with open(output, "w") as f:
        json.dump({"after": sorted(after), "expected": sorted(_fingerprint(e)[:2] for e in elements(5, 256)),
                   "stats": tf_rdma.stats()}, f)
    print("done", flush=True)


if __name__ == "__main__":
    function, arguments = sys.argv[1], json.loads(sys.argv[2])
    globals()[function](**arguments)

"""A receiver in a process of its own, for the scale tests: its threads and memory are measured
without the test process's. Commands on stdin, JSON answers on stdout, one per line:

  (start)      {"endpoint", "threads", "rss"}        after listening, before any peer
  accept N     {"threads", "rss", "fds"}             once N peers connected (all idle)
  receive S    {"indices": [...]} or {"error": ...}  grants every peer S bytes under tag 1 and
               checks what lands: 8 bytes of the peer's index, then pattern(S - 8, index)
"""
import gc
import json
import os
import struct
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from helpers import HOST, pattern, transport  # noqa: E402


def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def measure():
    gc.collect()
    return {"threads": status("Threads"), "rss": status("VmRSS") * 1024,
            "fds": len(os.listdir("/proc/self/fd"))}


def main():
    backend = sys.argv[1]
    receiver = transport(backend, "receiver", connect_timeout=60)
    listener = receiver.listen(f"{HOST}:0")
    connections = []
    print(json.dumps({"endpoint": listener.endpoint, **measure()}), flush=True)
    for line in sys.stdin:
        command, argument = line.split()
        if command == "accept":
            while len(connections) < int(argument):
                connections.append(listener.accept(120))
            print(json.dumps(measure()), flush=True)
        elif command == "receive":
            size = int(argument)
            region = receiver.allocate_region(size * len(connections))
            grants = [c.grant(1, region, i * size, size) for i, c in enumerate(connections)]
            try:
                for grant in grants:
                    grant.wait(60)
            except Exception as error:  # noqa: BLE001 - reported to the test, which fails on it
                print(json.dumps({"error": f"{type(error).__name__}: {error}"}), flush=True)
                continue
            view = memoryview(region)
            indices = []
            for i in range(len(connections)):
                slot = bytes(view[i * size:(i + 1) * size])
                index = struct.unpack("<Q", slot[:8])[0]
                if slot[8:] != pattern(size - 8, index):
                    print(json.dumps({"error": f"slot {i}: bytes not from peer {index}"}), flush=True)
                    break
                indices.append(index)
            else:
                print(json.dumps({"indices": indices}), flush=True)


if __name__ == "__main__":
    main()

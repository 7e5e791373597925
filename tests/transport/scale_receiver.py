"""A receiver in a process of its own for the scale tests (`python -m tests.transport.scale_receiver
BACKEND HOST`, the cluster key in hex on the first line of stdin): bench_scale.Receiver's commands,
and one more:

  receive S    {"indices": [...]}   grants every peer S bytes under tag 1 and checks what lands:
                                    8 bytes of the peer's index, then pattern(S - 8, index)
"""
import struct
import sys

from tests.transport.helpers import pattern, transport
from tf_rdma.bench import scale as bench_scale


def main():
    key = bytes.fromhex(sys.stdin.readline().strip())
    receiver = bench_scale.Receiver(transport(sys.argv[1], "receiver", key=key, connect_timeout=60), sys.argv[2])

    def receive(size):
        size, connections = int(size), receiver.connections
        region = receiver.transport.allocate_region(size * len(connections))
        grants = [c.grant(1, region, i * size, size) for i, c in enumerate(connections)]
        for grant in grants:
            grant.wait(60)
        view = memoryview(region)
        indices = []
        for i in range(len(connections)):
            slot = bytes(view[i * size:(i + 1) * size])
            index = struct.unpack("<Q", slot[:8])[0]
            if slot[8:] != pattern(size - 8, index):
                raise AssertionError(f"slot {i}: bytes not from peer {index}")
            indices.append(index)
        return {"indices": indices}

    receiver.serve({"receive": receive})


if __name__ == "__main__":
    main()

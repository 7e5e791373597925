"""A tf_rdma peer in its own process, for tests that kill, stop or restart it.

usage: python -m tests.transport.peer_process BACKEND ENDPOINT KEY_HEX PEER_TIMEOUT ACTION...
With ENDPOINT listen:HOST:PORT, it listens there instead, prints "listening ENDPOINT" and takes the
first connection.
actions: write:TAG:SIZE:SEED (write a pattern and wait for it to land), grant:TAG:SIZE (grant and
wait), expect:TAG:SIZE:SEED (grant, wait, and exit with an error unless exactly that pattern
landed), print:TEXT, sleep:SECONDS. Prints "connected" once connected, and "failed CLASS: MESSAGE"
if an action fails with one of tf_rdma's errors (then raises it).
"""
import sys
import time

from tests.transport.helpers import pattern
from tf_rdma import _transport, errors


def main():
    backend, endpoint, key_hex, peer_timeout, *actions = sys.argv[1:]
    transport = _transport.Transport(backend, name="peer-process", cluster_key=bytes.fromhex(key_hex),
                                     peer_timeout=float(peer_timeout))
    if endpoint.startswith("listen:"):
        listener = transport.listen(endpoint[len("listen:"):])
        print(f"listening {listener.endpoint}", flush=True)
        connection = listener.accept(120)
    else:
        connection = transport.connect(endpoint)
    print("connected", flush=True)
    region = transport.allocate_region(1 << 20)
    try:
        run(transport, connection, region, actions)
    except errors.TransportError as e:
        print(f"failed {type(e).__name__}: {e}", flush=True)
        raise  # and its traceback on stderr, with a failing exit status


def run(transport, connection, region, actions):
    for action in actions:
        kind, *args = action.split(":")
        if kind == "write":
            tag, size, seed = map(int, args)
            connection.write(tag, pattern(size, seed)).wait(60)
        elif kind == "grant":
            tag, size = map(int, args)
            connection.grant(tag, region, 0, size).wait(60)
        elif kind == "expect":
            tag, size, seed = map(int, args)
            landed = transport.allocate_region(max(size, 1))
            received = connection.grant(tag, landed, 0, size).wait(60)
            if received != size or memoryview(landed)[:size] != pattern(size, seed):
                sys.exit(f"expect:{tag}: {received} bytes landed, not the {size} of pattern seed {seed}")
        elif kind == "print":
            print(args[0], flush=True)
        elif kind == "sleep":
            time.sleep(float(args[0]))


if __name__ == "__main__":
    main()

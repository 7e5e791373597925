"""A verbs peer can write only into memory granted on its own connection: the keys a connection is
told are memory windows bound to that connection's queue pair, so a key holder that learns (or
guesses) the key another connection was given cannot use it. The peer here is
hostile_verbs_peer.py, written with pyverbs from the wire format; it holds several connections and
replays one connection's keys on another, as a compromised cluster member could."""
import json
import subprocess
import time

import pytest

from tests.transport.helpers import HOST, KEY, next_line, transport
from tests.transport.verbs.verbs_helpers import HOSTILE_PEER, PYVERBS_PYTHON, needs_verbs, require_pyverbs

REGION_SIZE = 64 << 10
CANARY = 0xA5


@pytest.fixture
def intruder():
    """(victim transport, {peer name: accepted connection}, ask) with three hostile connections."""
    require_pyverbs()
    victim = transport("verbs", "victim")
    listener = victim.listen(f"{HOST}:0")
    host, port = listener.endpoint.rsplit(":", 1)
    peer = subprocess.Popen([PYVERBS_PYTHON, "-m", HOSTILE_PEER, host, port, KEY.hex(), "3"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def ask(command):
        peer.stdin.write(json.dumps(command) + "\n")
        peer.stdin.flush()
        return json.loads(next_line(peer, timeout=30))

    try:
        assert json.loads(next_line(peer, timeout=60)) == {"connected": 3}
        accepted = [listener.accept(10) for _ in range(3)]
        yield victim, {connection.peer_name: connection for connection in accepted}, ask
    finally:
        peer.kill()
        peer.wait(10)


@needs_verbs
def test_a_key_announced_on_one_connection_is_useless_on_another(intruder):
    victim, connections, ask = intruder
    regions, grants = [], []
    for i in range(3):
        region = victim.allocate_region(REGION_SIZE)
        memoryview(region)[:] = bytes([CANARY]) * REGION_SIZE
        grants.append(connections[f"intruder-{i}"].grant(1, region, 0, REGION_SIZE))
        regions.append(region)
    learned = [ask({"learn": i}) for i in range(3)]
    own, table = learned[0]["region"], learned[0]["grant_table"]
    assert own["size"] == REGION_SIZE

    # The control: on its own connection the key and address work, so what fails below fails
    # because of the connection it is used on.
    wrote = ask({"write": 0, "rkey": own["rkey"], "address": own["address"], "fill": 0x11, "length": 64})
    assert wrote["ok"], wrote
    assert bytes(memoryview(regions[0])[:64]) == b"\x11" * 64

    stolen = ask({"write": 1, "rkey": own["rkey"], "address": own["address"] + 4096, "fill": 0x22,
                  "length": 64})
    assert not stolen["ok"], "a write with another connection's region key landed"
    forged = ask({"write": 2, "rkey": table["rkey"], "address": table["address"], "fill": 0x33,
                  "length": 64})
    assert not forged["ok"], "a write with another connection's grant-table key landed"

    time.sleep(0.2)  # nothing may land late either
    untouched = bytes(memoryview(regions[0])[64:])
    assert untouched == bytes([CANARY]) * (REGION_SIZE - 64), "connection 0's region changed"
    connections["intruder-0"].check()  # the connection whose keys were replayed is unharmed

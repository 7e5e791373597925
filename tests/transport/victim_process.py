"""A tf_rdma listener under attack, in its own process: a crash (SIGSEGV, SIGBUS, abort) then shows
as this process dying, with its exit status, instead of taking the test run down with it.

usage: python -m tests.transport.victim_process BACKEND CONNECT_TIMEOUT PEER_TIMEOUT [LIMIT_SETUP]
LIMIT_SETUP is Python code run after the listener started (to lower resource limits).
Prints {"endpoint": ...}, then answers each command line on stdin with one JSON line:
  attack           accept one connection; grant GRANTS in a canary-filled region, start WRITES
  verdict          wait for that connection to fail; report how, what the grants and writes got,
                   whether a byte outside the granted ranges changed, and the descriptors left
  nothing          report whether a connection was accepted (it must not have been) and the
                   descriptors left
  hold             accept one connection and keep it, starting nothing on it
  write TAG LENGTH write LENGTH bytes under TAG on the held connection; report how it ended
  legit SEED       accept one connection, grant LEGIT_CAPACITY bytes, report whether the bytes that
                   landed are pattern(LEGIT_CAPACITY, SEED) exactly
  baseline         record the descriptors and threads open now as the level to come back to
  dial ENDPOINT    connect to ENDPOINT as a member would; report the peer's name, or the error
  exhaust_descriptors  open /dev/null until the process is at RLIMIT_NOFILE; report how many
  release_descriptors  close those again
"""
import gc
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time

from tests.transport.helpers import HOST, next_line, pattern, transport
from tests.transport.wire_client import RawPeer
from tf_rdma import errors

REGION_SIZE = 64 << 10
CANARY = 0xA5
# (tag, offset, capacity): ranges apart from each other and from the region's ends, so that a
# write past either end of any grant lands on canary bytes.
GRANTS = [(1, 1024, 1000), (2, 8192, 2000), (3, 30000, 4096)]
# (tag, length): writes waiting for the hostile peer's grants.
WRITES = [(100, 3000), (101, 10)]
LEGIT_TAG, LEGIT_OFFSET, LEGIT_CAPACITY = 7, 100, 5000


def write_payload(tag, length):
    return pattern(length, seed=tag)


def open_descriptors():
    return len(os.listdir("/proc/self/fd"))


def threads():
    return len(os.listdir("/proc/self/task"))


def outcome(wait):
    """What a grant or write ended with: ["ok", result] or [error class, message]."""
    try:
        return ["ok", wait(5)]
    except errors.TransportError as error:
        return [type(error).__name__, str(error)]


class Victim:
    def __init__(self, backend, connect_timeout, peer_timeout):
        # The limits a test sets in the environment (TF_RDMA_MAX_GRANTS_PER_PEER) apply, as in a task's runtime.
        self.transport = transport(backend, "victim", connect_timeout=connect_timeout, peer_timeout=peer_timeout)
        self.listener = self.transport.listen(f"{HOST}:0")
        # Memory no peer is ever granted: no write of any peer may change it.
        self.bystander = self.transport.allocate_region(REGION_SIZE)
        memoryview(self.bystander)[:] = bytes([CANARY]) * REGION_SIZE
        self.level = (open_descriptors(), threads())
        self.attacked = None
        self.dialled = None
        self.held = None
        self.hogged = []

    def attack(self):
        connection = self.listener.accept(10)
        region = self.transport.allocate_region(REGION_SIZE)
        memoryview(region)[:] = bytes([CANARY]) * REGION_SIZE
        grants = [connection.grant(tag, region, offset, capacity) for tag, offset, capacity in GRANTS]
        payloads = [write_payload(tag, length) for tag, length in WRITES]
        writes = [connection.write(tag, payload) for (tag, _), payload in zip(WRITES, payloads)]
        self.attacked = (connection, region, grants, writes, payloads)
        return {"peer": connection.peer_name}

    def verdict(self):
        connection, region, grants, writes, _payloads = self.attacked
        self.attacked = None
        deadline = time.monotonic() + 15
        error = None
        while error is None and time.monotonic() < deadline:
            try:
                connection.check()
                time.sleep(0.005)
            except errors.TransportError as e:
                error = e
        report = {
            "error_class": type(error).__name__ if error else None,
            "error": str(error) if error else None,
            "grants": [outcome(g.wait) for g in grants],
            "writes": [outcome(w.wait) for w in writes],
        }
        contents = bytes(memoryview(region))
        granted = bytearray(REGION_SIZE)
        for _, offset, capacity in GRANTS:
            granted[offset:offset + capacity] = b"\1" * capacity
        report["changed_outside_grants"] = [
            i for i in range(REGION_SIZE) if not granted[i] and contents[i] != CANARY][:16]
        report["region_sha256"] = hashlib.sha256(contents).hexdigest()
        report["bystander_changed"] = [i for i, byte in enumerate(bytes(memoryview(self.bystander)))
                                       if byte != CANARY][:16]
        del connection, region, grants, writes, contents
        report.update(self.leftovers())
        return report

    def leftovers(self):
        """Descriptors and threads above the recorded level once the connection's threads wound
        down; they close asynchronously, so this waits a little for them."""
        gc.collect()
        deadline = time.monotonic() + 5
        while (open_descriptors(), threads()) > self.level and time.monotonic() < deadline:
            time.sleep(0.01)
        now = (open_descriptors(), threads())
        return {"extra_descriptors": now[0] - self.level[0], "extra_threads": now[1] - self.level[1],
                "descriptors": sorted(os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
                                      if os.path.exists(f"/proc/self/fd/{fd}"))
                if now[0] > self.level[0] else []}

    def hold(self):
        self.held = self.listener.accept(10)
        return {"peer": self.held.peer_name}

    def write(self, tag, length):
        return {"write": outcome(self.held.write(int(tag), write_payload(int(tag), int(length))).wait)}

    def nothing(self):
        try:
            accepted = self.listener.accept(0.05).peer_name
        except errors.OperationTimeoutError:
            accepted = None
        return {"accepted": accepted, **self.leftovers()}

    def legit(self, seed):
        connection = self.listener.accept(10)
        region = self.transport.allocate_region(LEGIT_OFFSET + LEGIT_CAPACITY)
        landed = connection.grant(LEGIT_TAG, region, LEGIT_OFFSET, LEGIT_CAPACITY).wait(10)
        exact = bytes(memoryview(region)[LEGIT_OFFSET:LEGIT_OFFSET + landed]) == pattern(LEGIT_CAPACITY, int(seed))
        connection.close()
        return {"landed": landed, "exact": exact}

    def dial(self, endpoint):
        connection = self.transport.connect(endpoint)
        self.dialled = connection  # kept open: what it connected to stays visible to the test
        return {"connected": connection.peer_name}

    def exhaust_descriptors(self):
        try:
            while True:
                self.hogged.append(os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC))
        except OSError as error:
            return {"opened": len(self.hogged), "stopped_by": error.strerror}

    def release_descriptors(self):
        for fd in self.hogged:
            os.close(fd)
        self.hogged = []
        return {"released": True}

    def baseline(self):
        gc.collect()
        self.level = (open_descriptors(), threads())
        return {"descriptors": self.level[0], "threads": self.level[1]}


class VictimProcess:
    """This script in a child process, driven one command at a time from the test."""

    def __init__(self, backend, connect_timeout=1.0, peer_timeout=5.0, limit_setup=None):
        self.backend = backend
        # Every refused connection logs a warning: a pipe nobody reads would fill up and block
        # the victim in its logging, so its stderr goes to a file.
        self.log = tempfile.TemporaryFile("w+")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.transport.victim_process", backend, str(connect_timeout), str(peer_timeout),
             *([limit_setup] if limit_setup else [])],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True)
        self.endpoint = self.answer()["endpoint"]

    def answer(self):
        try:
            return json.loads(next_line(self.process, timeout=60))
        except AssertionError:
            self.assert_alive()  # says how it died, with what it logged
            raise

    def ask(self, command):
        self.assert_alive()
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()
        return self.answer()

    def assert_alive(self):
        if self.process.poll() is not None:
            raise AssertionError(f"the victim died with status {self.process.returncode}: "
                                 f"{self.logged()[-3000:]}")

    def logged(self):
        self.log.seek(0)
        return self.log.read()

    def holding_raw_peer(self, key, name):
        """A peer written from the wire format (wire_client.RawPeer), handshaken under `name`, whose
        connection the victim holds (its `write` command writes on it)."""
        peer = RawPeer(self.backend, self.endpoint)
        peer.handshake(key, name=name)
        assert self.ask("hold") == {"peer": name}
        return peer

    def legit_peer_moves_data(self, member, seed):
        """A legitimate peer connects through the same listener and writes; what landed must be
        exactly what it wrote."""
        self.process.stdin.write(f"legit {seed}\n")
        self.process.stdin.flush()
        connection = member.connect(self.endpoint)
        connection.write(7, pattern(LEGIT_CAPACITY, seed)).wait(10)
        answer = self.answer()
        connection.close()
        return answer == {"landed": LEGIT_CAPACITY, "exact": True}, answer

    def stop(self):
        self.process.stdin.close()
        self.process.wait(10)
        return self.logged()


def main():
    backend, connect_timeout, peer_timeout, *limit_setup = sys.argv[1:]
    victim = Victim(backend, float(connect_timeout), float(peer_timeout))
    if limit_setup:
        exec(limit_setup[0], {"victim": victim})
    print(json.dumps({"endpoint": victim.listener.endpoint}), flush=True)
    for line in sys.stdin:
        command, *args = line.split()
        try:
            answer = getattr(victim, command)(*args)
        except errors.TransportError as error:
            answer = {"failed": f"{type(error).__name__}: {error}"}
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()

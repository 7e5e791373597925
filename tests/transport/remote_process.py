"""Processes started on another host, for the transport tests' peer processes when the suite runs
across two hosts (the two linked Soft-RoCE guests): the test host connects to an agent on the
other host, which starts the command and relays its output, exit code and the signals the test
sends. `RemoteProcess` has the part of `subprocess.Popen` the tests use.

Agent: python -m tests.transport.remote_process serve HOST PORT [--until FILE]   (serves until FILE exists;
from the repository's root)
Client: set TRANSPORT_TEST_PEER_AGENT=HOST:PORT; helpers.start_peer then starts peers there.

Protocol: JSON lines. The client sends {"argv": [...], "env": {...}}; the agent answers
{"pid": N}, then {"out": line} / {"err": line} as the command prints, and {"exit": code} when it
ends; the client may send {"signal": N} at any time. A closed client connection kills the command,
so a test that fails leaves nothing running on the other host.
"""
import json
import os
import queue
import socket
import subprocess
import sys
import threading
import time


class RemoteProcess:
    """A command running on the host of the agent at `address` ("host:port")."""

    def __init__(self, address, argv, env=None, connect_timeout=60.0):
        host, port = address.rsplit(":", 1)
        deadline = time.monotonic() + connect_timeout
        while True:  # the agent may still be starting (its host boots at the same time)
            try:
                self._sock = socket.create_connection((host, int(port)), timeout=5)
                break
            except OSError as e:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"no peer agent at {address} within {connect_timeout:.0f} s ({e}); "
                                       "start it there with `python -m tests.transport.remote_process serve`") from None
                time.sleep(0.5)
        self._sock.settimeout(None)
        self._file = self._sock.makefile("rw", encoding="utf-8", newline="\n")
        self._send({"argv": list(argv), "env": dict(env or {})})
        first = json.loads(self._file.readline() or "{}")
        if "pid" not in first:
            raise RuntimeError(f"the peer agent at {address} could not start {argv[0]}: {first}")
        self.pid = first["pid"]  # on the other host
        self.args = list(argv)
        self.returncode = None
        self._stderr_lines = []
        self._out = queue.Queue()
        self._exited = threading.Event()
        self.stdout = iter(self._out.get, None)  # ends when the command's stdout does
        self.stderr = self  # .read() gives what it printed on stderr so far
        threading.Thread(target=self._relay, daemon=True).start()

    def _send(self, message):
        self._file.write(json.dumps(message) + "\n")
        self._file.flush()

    def _relay(self):
        for line in self._file:
            message = json.loads(line)
            if "out" in message:
                self._out.put(message["out"])
            elif "err" in message:
                self._stderr_lines.append(message["err"])
            elif "exit" in message:
                self.returncode = message["exit"]
                break
        self._out.put(None)
        self._exited.set()

    def read(self):
        return "".join(self._stderr_lines)

    def poll(self):
        return self.returncode

    def wait(self, timeout=None):
        if not self._exited.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        if self.returncode is None:
            raise RuntimeError("the connection to the peer agent closed before the command ended")
        return self.returncode

    def send_signal(self, sig):
        if self.returncode is None:
            try:
                self._send({"signal": int(sig)})
            except OSError:
                pass  # the agent closed the connection: the command is gone

    def kill(self):
        self.send_signal(9)


def _serve_one(conn):
    """Runs one client's command and relays it (a thread per client)."""
    with conn, conn.makefile("rw", encoding="utf-8", newline="\n") as f:
        write_lock = threading.Lock()

        def send(message):
            with write_lock:
                f.write(json.dumps(message) + "\n")
                f.flush()

        request = json.loads(f.readline() or "{}")
        try:
            process = subprocess.Popen(request["argv"], env={**os.environ, **request["env"]},
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                       stdin=subprocess.DEVNULL)
        except (KeyError, OSError) as e:
            send({"error": f"{type(e).__name__}: {e}"})
            return
        send({"pid": process.pid})

        def pipe(stream, key):
            for line in stream:
                send({key: line})

        pipes = [threading.Thread(target=pipe, args=(s, k), daemon=True)
                 for s, k in ((process.stdout, "out"), (process.stderr, "err"))]
        for thread in pipes:
            thread.start()

        def signals():
            for line in f:
                try:
                    process.send_signal(json.loads(line)["signal"])
                except ProcessLookupError:
                    pass
            if process.poll() is None:  # the test side went away
                process.kill()

        threading.Thread(target=signals, daemon=True).start()
        process.wait()
        for thread in pipes:
            thread.join(10)
        try:
            send({"exit": process.returncode})
        except OSError:
            pass


def serve(host, port, until=None):
    server = socket.create_server((host, port), reuse_port=False)
    server.settimeout(0.5)
    print(f"peer agent serving on {host}:{port}", flush=True)
    while until is None or not os.path.exists(until):
        try:
            conn, _ = server.accept()
        except socket.timeout:
            continue
        conn.settimeout(None)
        threading.Thread(target=_serve_one, args=(conn,), daemon=True).start()
    print(f"peer agent done ({until} exists)", flush=True)


if __name__ == "__main__":
    if len(sys.argv) not in (4, 6) or sys.argv[1] != "serve" or (len(sys.argv) == 6 and sys.argv[4] != "--until"):
        sys.exit("usage: python -m tests.transport.remote_process serve HOST PORT [--until FILE]")
    serve(sys.argv[2], int(sys.argv[3]), sys.argv[5] if len(sys.argv) == 6 else None)

"""verbs-specific behaviour. Runs where an RDMA device works (the Soft-RoCE guest:
`python3 tools/softroce/guest.py run --env TFRDMA_TEST_HOST=10.77.0.1 --cwd /work/main --
/work/main/.venv/bin/python -m pytest tests/transport/verbs`); elsewhere only the "why not" test runs."""
import ctypes
import gc
import mmap
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.transport.helpers import HOST, connected_pair, pattern, raises_exactly, transport
from tf_rdma import _transport, errors
from tf_rdma.bench import transport as bench
from tests.transport.verbs.verbs_helpers import VERBS_OK, VERBS_WHY_NOT, needs_verbs


def run_python(code, env=None, prefix=()):
    """Runs `code` in a fresh interpreter (own environment / limits); returns its stdout+stderr."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith("TF_RDMA_VERBS_")}
    environment.update(env or {})
    result = subprocess.run([*prefix, sys.executable, "-c", textwrap.dedent(code)], env=environment,
                            capture_output=True, text=True, timeout=120)
    return result.stdout + result.stderr


SYSFS_INFINIBAND = Path("/sys/class/infiniband")


@pytest.fixture
def device():
    """(device, port, gid_index) the verbs backend uses for HOST on this host without overrides, as
    rdma_cm picks them, not assumed (rxe0, port 1, GID 1 in the Soft-RoCE guest only)."""
    name, port, gid_index, _ = bench.verbs_device(HOST, environ={})
    return name, port, gid_index


def gids_of(name, port):
    """[(index, gid, type)] of a port's populated GID entries, from sysfs."""
    port_dir = SYSFS_INFINIBAND / name / "ports" / str(port)
    entries = sorted((p for p in (port_dir / "gids").iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
    out = []
    for entry in entries:
        gid = entry.read_text().strip()
        if gid and not set(gid) <= {"0", ":"}:
            out.append((int(entry.name), gid, (port_dir / "gid_attrs" / "types" / entry.name).read_text().strip()))
    return out


def fresh_mapping(size, seed):
    """A new anonymous mapping (never registered: unlike malloc'd memory, which earlier tests may
    have sent from and left cached) filled with pattern(size, seed)."""
    mapping = mmap.mmap(-1, size)
    mapping[:] = pattern(size, seed)
    return mapping


def address_of(buffer):
    return ctypes.addressof(ctypes.c_char.from_buffer(buffer))


def test_availability_is_explained():
    if VERBS_OK:
        assert transport("verbs").backend == "verbs"
        return
    assert VERBS_WHY_NOT, "an unusable backend must say why"
    assert any(s in VERBS_WHY_NOT for s in ("no RDMA device", "no active port", "no verbs backend"))
    with raises_exactly(errors.BackendUnavailableError, match="verbs backend is not available"):
        transport("verbs")


@needs_verbs
def test_recurring_send_buffer_is_registered_once():
    with connected_pair("verbs") as (receiver, from_sender, to_receiver):
        region = receiver.allocate_region(1 << 20)
        source = fresh_mapping(1 << 20, seed=1)
        before = _transport.verbs_stats()
        for tag in range(5):
            grant = from_sender.grant(tag, region, 0, len(source))
            to_receiver.write(tag, source).wait(30)
            assert grant.wait(30) == len(source)
        after = _transport.verbs_stats()
        assert after["cache_misses"] - before["cache_misses"] == 1
        assert after["cache_hits"] - before["cache_hits"] == 4
        # A slice inside the same pages is covered by the same registration.
        grant = from_sender.grant(99, region, 0, 1000)
        to_receiver.write(99, memoryview(source)[4096:5096]).wait(30)
        grant.wait(30)
        assert _transport.verbs_stats()["cache_misses"] == after["cache_misses"]
        assert memoryview(region)[:1000] == source[4096:5096]
        source.close()


LIBC = ctypes.CDLL(None, use_errno=True)
LIBC.mmap.restype = ctypes.c_void_p
LIBC.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
LIBC.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
PROT_READ_WRITE, MAP_PRIVATE_ANONYMOUS, MAP_FIXED_NOREPLACE = 0x3, 0x22, 0x100000


@needs_verbs
def test_unmapped_and_reused_address_sends_the_new_bytes():
    """A cached registration of freed memory must not be reused for new memory at the same address:
    the second mapping is placed exactly where the first was (MAP_FIXED_NOREPLACE), so the stale
    entry is there to be (wrongly) hit every run."""
    size = 4 << 20
    with connected_pair("verbs") as (receiver, from_sender, to_receiver):
        region = receiver.allocate_region(size)
        first = fresh_mapping(size, seed=1)
        address = address_of(first)
        grant = from_sender.grant(1, region, 0, size)
        to_receiver.write(1, first).wait(30)
        grant.wait(30)
        before = _transport.verbs_stats()
        first.close()  # munmap
        reused = LIBC.mmap(address, size, PROT_READ_WRITE, MAP_PRIVATE_ANONYMOUS | MAP_FIXED_NOREPLACE, -1, 0)
        assert reused == address, f"could not map the same address again (errno {ctypes.get_errno()})"
        second = None
        try:
            second = memoryview((ctypes.c_char * size).from_address(reused)).cast("B")
            second[:] = pattern(size, seed=2)
            grant = from_sender.grant(2, region, 0, size)
            to_receiver.write(2, second).wait(30)
            grant.wait(30)
            assert memoryview(region)[:size] == pattern(size, seed=2)
            after = _transport.verbs_stats()
            assert after["cache_uncached"] == before["cache_uncached"], "send buffers must be cached here"
            assert after["cache_invalidations"] > before["cache_invalidations"], "the munmap went unseen"
            assert after["cache_misses"] > before["cache_misses"], "stale registration reused"
        finally:
            if second is not None:
                second.release()
            LIBC.munmap(reused, size)


@needs_verbs
def test_nonexistent_device_lists_the_existing_ones(device):
    name, port, _ = device
    out = run_python("""
        from tf_rdma import _transport
        print(_transport.backend_available("verbs"))
        try:
            _transport.Transport("verbs")
        except Exception as e:
            print(type(e).__name__, e)
    """, env={"TF_RDMA_VERBS_DEVICE": "mlx5_9"})
    assert "TF_RDMA_VERBS_DEVICE=mlx5_9 does not exist; devices found: " in out, out
    assert f"{name} (port {port} ACTIVE, {HOST} on " in out, out
    assert "ConfigError" in out, out


@needs_verbs
def test_nonexistent_port_lists_the_existing_ones(device):
    name, port, _ = device
    missing = 1 + max(int(p.name) for p in (SYSFS_INFINIBAND / name / "ports").iterdir())
    out = run_python("""
        from tf_rdma import _transport
        print(_transport.backend_available("verbs"))
    """, env={"TF_RDMA_VERBS_DEVICE": name, "TF_RDMA_VERBS_PORT": str(missing)})
    assert f"TF_RDMA_VERBS_PORT={missing} does not exist on device {name}; devices found: " in out, out
    assert f"{name} (port {port} ACTIVE)" in out, out


@needs_verbs
def test_link_local_gid_is_refused_naming_the_routable_ones(device):
    name, port, gid_index = device
    [link_local, *_] = [index for index, gid, _ in gids_of(name, port) if gid.startswith("fe80:")]
    out = run_python("""
        from tf_rdma import _transport
        try:
            _transport.Transport("verbs")
        except Exception as e:
            print(type(e).__name__, e)
    """, env={"TF_RDMA_VERBS_DEVICE": name, "TF_RDMA_VERBS_PORT": str(port),
              "TF_RDMA_VERBS_GID_INDEX": str(link_local)})
    assert f"TF_RDMA_VERBS_GID_INDEX={link_local} is the link-local GID fe80::" in out, out
    assert f"{gid_index} (::ffff:{HOST}, RoCE v2)" in out, out


@needs_verbs
def test_explicit_gid_index_and_device_work(monkeypatch, device):
    name, port, gid_index = device
    monkeypatch.setenv("TF_RDMA_VERBS_DEVICE", name)
    monkeypatch.setenv("TF_RDMA_VERBS_PORT", str(port))
    monkeypatch.setenv("TF_RDMA_VERBS_GID_INDEX", str(gid_index))
    with connected_pair("verbs") as (receiver, from_sender, to_receiver):
        region = receiver.allocate_region(4096)
        grant = from_sender.grant(1, region, 0, 4096)
        to_receiver.write(1, b"x" * 4000).wait(30)
        assert grant.wait(30) == 4000


@needs_verbs
@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root to drop CAP_IPC_LOCK")
def test_memlock_too_low_names_the_number_needed():
    # Root ignores RLIMIT_MEMLOCK through CAP_IPC_LOCK: the child runs without it, as users do.
    out = run_python("""
        import resource
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (8 << 20, 8 << 20))
        from tf_rdma import _transport
        t = _transport.Transport("verbs")
        try:
            t.allocate_region(64 << 20)
        except Exception as e:
            print(type(e).__name__, e)
    """, prefix=("setpriv", "--inh-caps=-ipc_lock", "--bounding-set=-ipc_lock"))
    assert "ResourceLimitError" in out, out
    assert "the locked-memory limit (ulimit -l) is 8192 KiB" in out, out
    assert "needs at least 65" in out and "ulimit -l unlimited" in out, out


@needs_verbs
def test_peer_reject_reason_reaches_the_other_side():
    with connected_pair("verbs") as (receiver, from_sender, to_receiver):
        grant = from_sender.grant(1, receiver.allocate_region(10), 0, 10)
        to_receiver.close("sender is shutting down")
        with pytest.raises(errors.CancelledError, match="sender is shutting down"):
            grant.wait(10)


@needs_verbs
def test_grant_of_a_foreign_region_is_refused():
    with connected_pair("verbs") as (_, from_sender, _to_receiver):
        tcp_region = transport("tcp").allocate_region(100)
        with pytest.raises(errors.ConfigError, match="only regions allocated by the verbs transport"):
            from_sender.grant(1, tcp_region, 0, 100).wait(10)


@needs_verbs
def test_regions_granted_on_a_live_connection_are_freed_once_dropped():
    """A region's memory window belongs to the region: a connection that was granted a fresh
    region per transfer does not keep them registered (pinned) until it closes."""
    payload = pattern(1 << 20)  # one source buffer: the sender's registration cache keeps it once
    with connected_pair("verbs") as (receiver, from_sender, to_receiver):
        def transfer(tag):
            region = receiver.allocate_region(1 << 20)
            grant = from_sender.grant(tag, region, 0, 1 << 20)
            to_receiver.write(tag, payload).wait(10)
            assert grant.wait(10) == 1 << 20
            assert bytes(memoryview(region)) == payload

        transfer(0)  # the first one's lasting costs (grant tables, send cache) are the baseline
        gc.collect()
        baseline = _transport.verbs_stats()["pinned_bytes"]
        for tag in range(1, 21):
            transfer(tag)
        gc.collect()
        grown = _transport.verbs_stats()["pinned_bytes"] - baseline
        assert grown < 2 << 20, f"{grown} bytes stay pinned after 20 regions of 1 MiB were dropped"


@needs_verbs
def test_a_connection_closed_while_its_region_lives_on_winds_down_at_once():
    """The windows bound to a connection's queue pair go before it, also when their region
    outlives the connection: each such close once stalled about 51 s under rxe. A stall blocks the
    thread that lets go of the connection last (the one I/O thread of each transport, or this
    one's collection), so the next transfer after the close would wait for it."""
    size = 1 << 20
    receiver = transport("verbs", "receiver", io_threads=1)
    sender = transport("verbs", "sender", io_threads=1)
    listener = receiver.listen(f"{HOST}:0")

    def transfer_then_close(region):
        to_receiver = sender.connect(listener.endpoint)
        from_sender = listener.accept(10)
        grant = from_sender.grant(1, region, 0, size)
        to_receiver.write(1, pattern(size)).wait(10)
        assert grant.wait(10) == size
        to_receiver.close()
        from_sender.close()

    region = receiver.allocate_region(size)
    started = time.monotonic()
    transfer_then_close(region)
    gc.collect()
    transfer_then_close(receiver.allocate_region(size))
    wound_down = time.monotonic() - started
    assert wound_down < 10, f"a close and the transfer after it took {wound_down:.1f} s"
    assert bytes(memoryview(region)) == pattern(size)  # the region itself lives on, intact


@needs_verbs
def test_a_connection_polling_for_completions_moves_data_exactly_and_closes_at_once(monkeypatch):
    """TF_RDMA_VERBS_POLL_US keeps the I/O threads polling between messages (a window that
    outlasts the test's gaps: they never sleep on events). Every byte still lands exactly, and a
    close ends the polling at once, not at the window's end."""
    window_seconds = 1.0
    monkeypatch.setenv("TF_RDMA_VERBS_POLL_US", str(int(window_seconds * 1e6)))
    size, count = 4000, 100
    receiver, sender = transport("verbs", "receiver"), transport("verbs", "sender")
    listener = receiver.listen(f"{HOST}:0")
    to_receiver = sender.connect(listener.endpoint)
    from_sender = listener.accept(10)
    region = receiver.allocate_region(size)
    for tag in range(1, count + 1):
        grant = from_sender.grant(tag, region, 0, size)
        to_receiver.write(tag, pattern(size, tag)).wait(10)
        assert grant.wait(10) == size
        assert bytes(memoryview(region)) == pattern(size, tag), f"message {tag} landed wrong"
    # Both transports' loops poll (this process's CPU time runs), until the close.
    polling = cpu_seconds_over(window_seconds / 4)
    assert polling > window_seconds / 20, f"{polling:.3f} s of CPU in {window_seconds / 4} s: no polling"
    to_receiver.close()
    from_sender.close()
    time.sleep(window_seconds / 4)  # the REJECTs and flushes
    after_close = cpu_seconds_over(window_seconds / 2)
    assert after_close < window_seconds / 10, \
        f"{after_close:.3f} s of CPU in {window_seconds / 2} s after the close: the polling went on"


def cpu_seconds_over(seconds):
    """This process's CPU time (all threads) during the next `seconds`."""
    started = time.process_time()
    time.sleep(seconds)
    return time.process_time() - started


def grant_counts():
    stats = _transport.verbs_stats()
    return stats["grants_written"], stats["grants_read"]


@needs_verbs
def test_grants_are_written_into_the_senders_grant_table():
    """Steady state: every grant is one write into the sender's grant table, which the sender reads."""
    with connected_pair("verbs") as (receiver, from_sender, to_receiver):
        region = receiver.allocate_region(4 << 10)
        payload = pattern(4 << 10, seed=3)
        written, read = grant_counts()
        for tag in range(20):
            grant = from_sender.grant(tag, region, 0, len(payload))
            to_receiver.write(tag, payload).wait(30)
            assert grant.wait(30) == len(payload)
        # Both ends live in this process, so the counters see both sides of each grant.
        assert grant_counts() == (written + 20, read + 20)


# verbs_connection.cc's kGrantSlots: grants outstanding towards one peer before more wait.
GRANT_TABLE_SLOTS = 4096


@needs_verbs
def test_grants_beyond_the_grant_table_wait_for_a_free_slot():
    """More grants than slots: the rest wait, in order, for slots the first ones free as their data
    lands; a waiting grant revoked is cancelled without the peer ever seeing it."""
    extra = 64
    count = GRANT_TABLE_SLOTS + extra
    with connected_pair("verbs") as (receiver, from_sender, to_receiver):
        region = receiver.allocate_region(8 * count)
        first = from_sender.grant(0, region, 0, 8)
        to_receiver.write(0, b"warmup!!").wait(30)  # the peer's grant table is known from here on
        assert first.wait(30) == 8
        written, _ = grant_counts()
        grants = [from_sender.grant(tag, region, 8 * tag, 8) for tag in range(1, count)]
        deadline = time.monotonic() + 60
        while grant_counts()[0] - written < GRANT_TABLE_SLOTS and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)
        assert grant_counts()[0] - written == GRANT_TABLE_SLOTS, "the table is full: the rest must wait"
        revoked = grants.pop()
        from_sender.revoke(revoked)
        with pytest.raises(errors.CancelledError):
            revoked.wait(10)
        assert not revoked.completed_inside_call, "Revoke ran the waiting grant's callback itself"
        writes = [to_receiver.write(tag, tag.to_bytes(8, "little")) for tag in range(1, count - 1)]
        for write in writes:
            write.wait(120)
        assert all(grant.wait(120) == 8 for grant in grants)
        landed = memoryview(region)
        assert all(landed[8 * tag:8 * tag + 8] == tag.to_bytes(8, "little") for tag in range(1, count - 1))
        assert landed[8 * (count - 1):] == b"\0" * 8
        assert grant_counts()[0] - written == count - 2, "all but the revoked one were written"


@needs_verbs
def test_an_address_no_rdma_device_reaches_fails_at_once_naming_the_devices(device):
    """127.0.0.1, a new user's first cluster spec: no RDMA device reaches it, so the connect fails
    at once, not after retrying for the connect timeout, and says why and what to do."""
    name, port, _ = device
    receiver = transport("verbs", "receiver")
    listener = receiver.listen(f"{HOST}:0")
    loopback = "127.0.0.1:" + listener.endpoint.rsplit(":", 1)[1]
    started = time.monotonic()
    with raises_exactly(errors.BackendUnavailableError) as raised:
        transport("verbs", "sender", connect_timeout=30).connect(loopback)
    assert time.monotonic() - started < 5
    message = str(raised.value)
    assert f"no RDMA device reaches {loopback}: this host sends to it from 127.0.0.1 on lo" in message, message
    assert f"RDMA devices here: {name} (port {port} ACTIVE, {HOST} on " in message, message
    assert "address of its RDMA interface" in message and "TF_RDMA_BACKEND=tcp" in message, message


in_guest = pytest.mark.skipif(socket.gethostname() != "softroce-guest",
                              reason="relies on the Soft-RoCE guest's networks")


@needs_verbs
@in_guest
def test_auto_takes_verbs_where_an_rdma_device_reaches_the_peer_else_tcp():
    # 10.77.0.2 is on rxe0's netdev's subnet; the guest has no other route, so TEST-NET-2 has none.
    assert _transport.choose_backend("auto", "10.77.0.2") == ("verbs", "an RDMA device reaches the peer")
    backend, reason = _transport.choose_backend("auto", "198.51.100.7")
    assert backend == "tcp", reason
    assert reason.startswith("verbs unusable: no RDMA device reaches 198.51.100.7: this host has no IP route "
                             "to it (Network is unreachable). RDMA devices here: rxe0 (port 1 ACTIVE, "
                             "10.77.0.1 on dummy0)"), reason


SECOND_NETDEV, SECOND_DEVICE, SECOND_ADDRESS = "tfrdma1", "tfrdma_rxe1", "10.78.0.1"


@pytest.fixture
def second_rdma_device():
    """A second Soft-RoCE device on a dummy netdev of its own, in the throwaway guest only (it adds
    kernel devices). rdma_cm reaches HOST through the first device. Only child processes may open
    it: `rdma link delete` waits for every process that has it open."""
    if socket.gethostname() != "softroce-guest" or os.geteuid() != 0:
        pytest.skip("adds an rxe device: only as root in the throwaway Soft-RoCE guest")
    setup = [["ip", "link", "add", SECOND_NETDEV, "type", "dummy"],
             ["ip", "addr", "add", f"{SECOND_ADDRESS}/24", "dev", SECOND_NETDEV],
             ["ip", "link", "set", SECOND_NETDEV, "up"],
             ["rdma", "link", "add", SECOND_DEVICE, "type", "rxe", "netdev", SECOND_NETDEV]]
    try:
        for command in setup:
            subprocess.run(command, check=True, capture_output=True)
        ready = time.monotonic() + 20
        while not any(not gid.startswith("fe80") for _, gid, _ in gids_of(SECOND_DEVICE, 1)):
            assert time.monotonic() < ready, f"{SECOND_DEVICE} got no GID for {SECOND_ADDRESS}"
            time.sleep(0.1)
        yield
    finally:
        subprocess.run(["rdma", "link", "delete", SECOND_DEVICE], capture_output=True)
        subprocess.run(["ip", "link", "delete", SECOND_NETDEV], capture_output=True)


@needs_verbs
def test_a_device_that_does_not_reach_the_peer_is_named_with_every_devices_address(device, second_rdma_device):
    name, port, _ = device
    out = run_python(f"""
        import time
        from tf_rdma import _transport
        started = time.monotonic()
        try:
            _transport.Transport("verbs", cluster_key=b"k", connect_timeout=30).connect("{HOST}:1")
        except Exception as e:
            print(type(e).__name__, e)
        print("seconds", time.monotonic() - started)
    """, env={"TF_RDMA_VERBS_DEVICE": SECOND_DEVICE})
    assert (f"{HOST}:1 is reached through RDMA device {name}, but TF_RDMA_VERBS_DEVICE restricts tf_rdma to "
            f"{SECOND_DEVICE}. RDMA devices here: ") in out, out
    assert f"{name} (port {port} ACTIVE, {HOST} on " in out, out
    assert f"{SECOND_DEVICE} (port 1 ACTIVE, {SECOND_ADDRESS} on {SECOND_NETDEV})" in out, out
    assert f"Name the peer by an IP address that {SECOND_DEVICE} reaches, or unset TF_RDMA_VERBS_DEVICE" in out, out
    assert float(out.split("seconds ")[1].split()[0]) < 5, out


@needs_verbs
@pytest.mark.flaps_rdma_link
@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("ip"), reason="needs root to take the link down")
def test_link_down_fails_pending_writes_with_a_qp_error(device):
    """The RDMA path dies under a live connection: the QP fails (rxe: local QP operation error,
    real NICs: retry exceeded) or the heartbeat expires, and every pending operation fails within
    the peer timeout. It runs last (flaps_rdma_link): after a link flap with live connections,
    rdma_cm on Soft-RoCE connects nothing more in the same guest (`rping` hangs too)."""
    name, port, _ = device
    # "link rxe0/1 state ACTIVE physical_state LINK_UP netdev dummy0"
    netdev = subprocess.run(["rdma", "link", "show", f"{name}/{port}"], capture_output=True,
                            text=True, check=True).stdout.split()[-1]
    with connected_pair("verbs", receiver_options={"peer_timeout": 3}, sender_options={"peer_timeout": 3}) as (
            receiver, from_sender, to_receiver):
        region = receiver.allocate_region(1 << 20)
        subprocess.run(["ip", "link", "set", netdev, "down"], check=True)
        try:
            grant = from_sender.grant(1, region, 0, 1 << 20)
            write = to_receiver.write(1, pattern(1 << 20))
            with pytest.raises(errors.PeerUnavailableError):
                write.wait(15)
            with pytest.raises(errors.PeerUnavailableError):
                grant.wait(15)
        finally:
            subprocess.run(["ip", "link", "set", netdev, "up"], check=True)

#!/usr/bin/env python3
"""Run a command inside a throwaway qemu guest that has a real kernel RDMA stack (Soft-RoCE).

The host kernel has no RDMA support, so this boots Debian's own kernel (which ships
``rdma_rxe``) under qemu/TCG, with the host's ``/`` shared read-only through 9p and a tmpfs
overlay on top.  In the guest, ``rxe0`` is brought up on a dummy netdev (10.77.0.1/24,
GID index 1 is RoCE v2), the command runs, its combined stdout/stderr and exit code come
back to the host through a second, per-job 9p share, and the guest powers off.

Two guests (``run_linked``) each get their own kernel and ``rxe0`` on a virtio NIC, the NICs
joined by a virtual Ethernet link (guest-a 10.78.0.1, guest-b 10.78.0.2), and share a read-write
directory to coordinate through.

CLI::

    python tools/softroce/guest.py run [--timeout S] [--memory 2G] [--env N=V ...]
                                       [--cwd DIR] [--memlock KB|unlimited] -- CMD ARGS...
    python tools/softroce/guest.py run-linked --a 'SHELL CMD' --b 'SHELL CMD'
                                       [--second-rdma-device] [--timeout S] [--smp N]
    python tools/softroce/guest.py check     # prerequisites / native RDMA
    python tools/softroce/guest.py build     # (re)build the cached vmlinux + initramfs

Python API (from the repository's root)::

    from tools.softroce.guest import run, native_rdma_available, missing_prerequisites
    res = run(["ibv_devinfo"], timeout=60)
    res.returncode, res.output, res.boot_seconds
    a, b = run_linked(LinkedCommand(["cmd-a"]), LinkedCommand(["cmd-b"]), timeout=60)

Python 3.11 standard library only.
"""

from __future__ import annotations

import argparse
import dataclasses
import fcntl
import glob
import hashlib
import json
import lzma
import os
import re
import shlex
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Callable, Sequence

REPO_ROOT = Path(__file__).resolve().parents[2]
INSTALL_HINT = "run tools/softroce/install.sh as root"

GUEST_IP = "10.77.0.1"
GUEST_PREFIX = 24
GUEST_NETDEV = "dummy0"
GUEST_RDMA_DEVICE = "rxe0"
GUEST_GID_INDEX = 1  # RoCE v2 GID (::ffff:10.77.0.1); index 0 is the link-local one
GUEST_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

TIMEOUT_EXIT_CODE = 124  # like coreutils timeout(1)
HARNESS_ERROR_EXIT_CODE = 125  # guest did not boot / rxe did not come up

QEMU = "qemu-system-x86_64"
QBOOT_ROM = "/usr/share/qemu/qboot.rom"
BUSYBOX = "/bin/busybox"
JOB_MOUNT = "/run/softroce-job"  # where the per-job share is mounted in the guest

# Two linked guests (run_linked): each has rxe0 on its virtio NIC, on one Ethernet link.
LINK_NETDEV = "eth0"  # the kernel's name for the first NIC (no udev renames it)
LINK_IPS = ("10.78.0.1", "10.78.0.2")
LINK_HOSTNAMES = ("guest-a", "guest-b")
SECOND_RDMA_DEVICE = "rxe1"  # guest-a's extra device, on dummy0 at GUEST_IP, when asked for
SHARED_MOUNT = "/run/softroce-shared"  # a host directory both linked guests mount read-write

# Modules the initramfs needs before it can reach the host's /lib/modules (in that order).
INITRAMFS_MODULES = ("virtio_pci", "9pnet_virtio", "9p", "overlay")

# cryptomgr.notests skips the crypto self-tests (~0.8 s of a TCG boot).
KERNEL_ARGS = "console=ttyS0 loglevel=4 panic=-1 mitigations=off tsc=reliable cryptomgr.notests"

# Bump when the initramfs layout / init script changes, so cached images are rebuilt.
INITRAMFS_FORMAT = 1


class GuestError(RuntimeError):
    """The guest could not be started, did not boot, or rxe0 did not come up."""


class PrerequisitesMissing(GuestError):
    """Host packages needed by the harness are not installed."""


@dataclasses.dataclass
class GuestResult:
    returncode: int
    output: str
    boot_seconds: float  # qemu start -> guest up with rxe0 ACTIVE, command about to start
    run_seconds: float  # command start -> command end (or timeout)
    total_seconds: float  # qemu start -> qemu gone
    timed_out: bool
    kernel: str  # guest kernel version
    console: str  # tail of the guest's serial console (kernel log + harness messages)
    job_dir: str  # host temp dir of this run (removed when the run ends)

    @property
    def ok(self) -> bool:
        return self.returncode == 0


# ----------------------------------------------------------------------------------------
# Host checks


def _which(name: str) -> str | None:
    """shutil.which, also looking in the sbin directories (a non-root PATH may lack them)."""
    path = os.environ.get("PATH", "") + ":/usr/local/sbin:/usr/sbin:/sbin:/usr/bin:/bin"
    return shutil.which(name, path=path)


def native_rdma_available() -> bool:
    """True when the host itself has a usable RDMA device (no guest needed)."""
    ib = Path("/sys/class/infiniband")
    try:
        if not ib.is_dir() or not any(ib.iterdir()):
            return False
    except OSError:
        return False
    exe = _which("ibv_devices")
    if not exe:
        return False
    try:
        out = subprocess.run([exe], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    lines = out.splitlines()
    for i, line in enumerate(lines):
        if line.strip().startswith("------"):
            return any(l.strip() for l in lines[i + 1:])
    return False


def _elf_is_static(path: str) -> bool:
    """True when the ELF file has no PT_INTERP program header (statically linked)."""
    try:
        with open(path, "rb") as f:
            ident = f.read(64)
            if ident[:4] != b"\x7fELF" or ident[4] != 2:  # ELF64 only
                return False
            end = "<" if ident[5] == 1 else ">"
            phoff, = struct.unpack_from(end + "Q", ident, 0x20)
            phentsize, phnum = struct.unpack_from(end + "HH", ident, 0x36)
            f.seek(phoff)
            table = f.read(phentsize * phnum)
        for i in range(phnum):
            p_type, = struct.unpack_from(end + "I", table, i * phentsize)
            if p_type == 3:  # PT_INTERP
                return False
        return True
    except (OSError, struct.error):
        return False


def _kernel_version_key(kver: str) -> list:
    return [int(x) if x.isdigit() else x for x in re.split(r"(\d+)", kver)]


def find_kernel() -> tuple[str, Path] | None:
    """(kver, /boot/vmlinuz-kver) of the newest installed kernel that ships rdma_rxe."""
    found = []
    for moddir in glob.glob("/lib/modules/*"):
        kver = os.path.basename(moddir)
        image = Path("/boot") / f"vmlinuz-{kver}"
        if not image.is_file():
            continue
        if not glob.glob(f"{moddir}/kernel/drivers/infiniband/sw/rxe/rdma_rxe.ko*"):
            continue
        found.append((kver, image))
    if not found:
        return None
    found.sort(key=lambda kv: _kernel_version_key(kv[0]))
    return found[-1]


def missing_prerequisites() -> list[str]:
    """What the harness needs but is not installed, each with how to fix it."""
    missing: list[str] = []

    def need(ok: bool, what: str, package: str) -> None:
        if not ok:
            missing.append(f"{what} not found (Debian package {package}); {INSTALL_HINT}")

    need(_which(QEMU) is not None, QEMU, "qemu-system-x86")
    need(os.path.isfile(QBOOT_ROM), QBOOT_ROM, "qemu-system-data")
    need(find_kernel() is not None,
         "a /boot/vmlinuz-* kernel with rdma_rxe.ko under /lib/modules", "linux-image-amd64")
    need(_which("modprobe") is not None, "modprobe", "kmod")
    need(_elf_is_static(BUSYBOX), f"statically linked {BUSYBOX}", "busybox-static")
    need(_which("rdma") is not None and _which("ip") is not None,
         "rdma / ip", "iproute2")
    need(bool(glob.glob("/usr/lib/*/libibverbs/librxe-rdmav*.so")),
         "the rxe verbs provider (librxe)", "ibverbs-providers")
    need(_which("ibv_devinfo") is not None, "ibv_devinfo", "ibverbs-utils")
    need(_which("ib_write_bw") is not None, "ib_write_bw", "perftest")
    need(_which("rping") is not None, "rping", "rdmacm-utils")
    need(os.path.isfile("/usr/include/infiniband/verbs.h"), "infiniband/verbs.h",
         "libibverbs-dev")
    need(os.path.isfile("/usr/include/rdma/rdma_cma.h"), "rdma/rdma_cma.h", "librdmacm-dev")
    return missing


# ----------------------------------------------------------------------------------------
# Build artifacts: uncompressed vmlinux + busybox initramfs, cached per kernel version


def cache_dir() -> Path:
    env = os.environ.get("TFRDMA_SOFTROCE_CACHE")
    return Path(env) if env else REPO_ROOT / "build" / "softroce"


def extract_vmlinux(vmlinuz: Path, dest: Path) -> None:
    """Write the uncompressed ELF kernel found in the xz payload of a bzImage."""
    data = vmlinuz.read_bytes()
    magic = b"\xfd7zXZ\x00"
    pos = data.find(magic)
    while pos != -1:
        try:
            elf = lzma.LZMADecompressor(format=lzma.FORMAT_XZ).decompress(data[pos:])
        except lzma.LZMAError:
            elf = b""
        if elf[:4] == b"\x7fELF":
            tmp = dest.with_name(dest.name + f".tmp{os.getpid()}")
            tmp.write_bytes(elf)
            os.replace(tmp, dest)
            return
        pos = data.find(magic, pos + 1)
    raise GuestError(f"no xz-compressed ELF kernel found in {vmlinuz}")


class _Cpio:
    """Minimal writer for the 'newc' cpio format the kernel unpacks as initramfs."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.ino = 1

    def _entry(self, name: str, mode: int, data: bytes = b"", rdev: tuple[int, int] = (0, 0)):
        nameb = name.encode() + b"\0"
        fields = (self.ino, mode, 0, 0, 1, 0, len(data), 0, 0, rdev[0], rdev[1], len(nameb), 0)
        self.ino += 1
        hdr = b"070701" + b"".join(b"%08X" % v for v in fields)
        self.parts.append(hdr + nameb + b"\0" * (-(len(hdr) + len(nameb)) % 4))
        self.parts.append(data + b"\0" * (-len(data) % 4))

    def dir(self, name: str) -> None:
        self._entry(name, 0o040755)

    def file(self, name: str, data: bytes, mode: int = 0o644) -> None:
        self._entry(name, 0o100000 | mode, data)

    def symlink(self, name: str, target: str) -> None:
        self._entry(name, 0o120777, target.encode())

    def chardev(self, name: str, major: int, minor: int) -> None:
        self._entry(name, 0o020600, rdev=(major, minor))

    def getvalue(self) -> bytes:
        self._entry("TRAILER!!!", 0)
        return b"".join(self.parts)


INIT_SCRIPT = r"""#!/bin/busybox sh
/bin/busybox mkdir -p /proc /sys /dev /sbin /usr/bin /usr/sbin /lower /upper /newroot
/bin/busybox --install -s
export PATH=/sbin:/bin:/usr/sbin:/usr/bin
fail() {
    echo "softroce-init: FAILED: $*"
    echo o > /proc/sysrq-trigger
    sleep 30
}
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
echo "softroce-init: loading modules"
for m in /lib/softroce-modules/*.ko; do
    insmod "$m" || fail "insmod $m"
done
mount -t 9p -o trans=virtio,version=9p2000.L,ro,msize=512000,cache=loose hostroot /lower \
    || fail "mount of the host root (9p) failed"
mount -t tmpfs -o mode=0755 tmpfs /upper
mkdir -p /upper/data /upper/work
mount -t overlay overlay -o lowerdir=/lower,upperdir=/upper/data,workdir=/upper/work /newroot \
    || fail "overlay mount failed"
mount -t proc proc /newroot/proc
mount -t sysfs sysfs /newroot/sys
mount -t devtmpfs devtmpfs /newroot/dev
mkdir -p /newroot/dev/pts /newroot/dev/shm
mount -t devpts -o gid=5,mode=620,ptmxmode=666 devpts /newroot/dev/pts
mount -t tmpfs -o mode=1777 tmpfs /newroot/dev/shm
mount -t tmpfs -o mode=0755 tmpfs /newroot/run
mkdir -p /newroot@JOB_MOUNT@
mount -t 9p -o trans=virtio,version=9p2000.L,msize=512000 job /newroot@JOB_MOUNT@ \
    || fail "mount of the job share (9p) failed"
[ -f /newroot@JOB_MOUNT@/stage2.sh ] || fail "no stage2.sh in the job share"
echo "softroce-init: switching root"
exec switch_root /newroot /bin/bash @JOB_MOUNT@/stage2.sh
""".replace("@JOB_MOUNT@", JOB_MOUNT)


def _module_files(kver: str) -> list[str]:
    paths: list[str] = []
    for mod in INITRAMFS_MODULES:
        modprobe = _which("modprobe") or "modprobe"
        res = subprocess.run([modprobe, "-S", kver, "--show-depends", mod],
                             capture_output=True, text=True)
        if res.returncode != 0:
            raise GuestError(f"modprobe --show-depends {mod} failed: {res.stderr.strip()}")
        for line in res.stdout.splitlines():
            parts = line.split()
            if len(parts) >= 2 and parts[0] == "insmod" and parts[1] not in paths:
                paths.append(parts[1])
    return paths


def _read_module(path: str) -> bytes:
    if path.endswith(".ko"):
        return Path(path).read_bytes()
    if path.endswith(".ko.xz"):
        return lzma.decompress(Path(path).read_bytes())
    if path.endswith(".ko.zst"):  # no zstd in the stdlib
        zstd = _which("zstd") or "zstd"
        return subprocess.run([zstd, "-dc", path], check=True, capture_output=True).stdout
    raise GuestError(f"unsupported module compression: {path}")


def build_initramfs(kver: str, dest: Path) -> None:
    cpio = _Cpio()
    for d in ("bin", "dev", "lib", "lib/softroce-modules", "proc", "sys", "run", "tmp"):
        cpio.dir(d)
    cpio.chardev("dev/console", 5, 1)
    cpio.chardev("dev/null", 1, 3)
    cpio.file("bin/busybox", Path(BUSYBOX).read_bytes(), 0o755)
    cpio.symlink("bin/sh", "busybox")
    cpio.file("init", INIT_SCRIPT.encode(), 0o755)
    for i, path in enumerate(_module_files(kver)):
        name = os.path.basename(path).split(".ko")[0]
        cpio.file(f"lib/softroce-modules/{i:02d}-{name}.ko", _read_module(path))
    tmp = dest.with_name(dest.name + f".tmp{os.getpid()}")
    tmp.write_bytes(cpio.getvalue())
    os.replace(tmp, dest)


@dataclasses.dataclass
class Artifacts:
    kver: str
    vmlinux: Path
    initramfs: Path


def ensure_artifacts(log: Callable[[str], None] | None = None) -> Artifacts:
    """Build (once per kernel version) and return the cached vmlinux + initramfs."""
    missing = missing_prerequisites()
    if missing:
        raise PrerequisitesMissing("missing prerequisites:\n  " + "\n  ".join(missing))
    kver, vmlinuz = find_kernel()  # type: ignore[misc]
    cdir = cache_dir()
    cdir.mkdir(parents=True, exist_ok=True)
    stamp = hashlib.sha256(
        f"{kver}|{vmlinuz.stat().st_size}|{INITRAMFS_FORMAT}|{INITRAMFS_MODULES}|{INIT_SCRIPT}"
        .encode()
    ).hexdigest()[:12]
    vmlinux = cdir / f"vmlinux-{kver}"
    initramfs = cdir / f"initramfs-{kver}-{stamp}.cpio"
    meta = cdir / f"vmlinux-{kver}.json"
    with open(cdir / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # concurrent guests: build once
        vsig = {"kver": kver, "size": vmlinuz.stat().st_size, "mtime": vmlinuz.stat().st_mtime}
        try:
            fresh = vmlinux.is_file() and json.loads(meta.read_text()) == vsig
        except (OSError, ValueError):
            fresh = False
        if not fresh:
            if log:
                log(f"softroce: extracting {vmlinux.name} from {vmlinuz}")
            extract_vmlinux(vmlinuz, vmlinux)
            meta.write_text(json.dumps(vsig))
        if not initramfs.is_file():
            if log:
                log(f"softroce: building {initramfs.name}")
            build_initramfs(kver, initramfs)
        # Drop images of other kernels / older harness versions.
        for old in cdir.glob("vmlinux-*"):
            if old.name not in (vmlinux.name, meta.name):
                old.unlink(missing_ok=True)
        for old in cdir.glob("initramfs-*"):
            if old != initramfs:
                old.unlink(missing_ok=True)
    return Artifacts(kver, vmlinux, initramfs)


# ----------------------------------------------------------------------------------------
# The per-job stage-2 script (runs as PID 1 in the guest after switch_root)


@dataclasses.dataclass(frozen=True)
class _RdmaLink:
    """One rxe device in a guest and the netdev under it: a dummy (traffic stays in the guest)
    or the guest's virtio NIC on the link to the other guest."""
    device: str
    netdev: str
    ip: str
    nic: bool


@dataclasses.dataclass(frozen=True)
class _GuestNetwork:
    hostname: str
    hosts: tuple[tuple[str, str], ...]  # /etc/hosts lines (ip, name)
    rdma: tuple[_RdmaLink, ...]  # in creation order
    shared: bool  # mount the linked guests' common share at SHARED_MOUNT


def _single_guest_network() -> _GuestNetwork:
    """The network of a guest run alone: rxe0 on dummy0 (read at call time: tests change it)."""
    return _GuestNetwork(
        hostname="softroce-guest", hosts=((GUEST_IP, "softroce-guest"),),
        rdma=(_RdmaLink(GUEST_RDMA_DEVICE, GUEST_NETDEV, GUEST_IP, nic=False),), shared=False)


def _network_setup(net: _GuestNetwork) -> str:
    """Shell lines that bring up every rxe device of `net`, each ACTIVE with its RoCE v2 GID."""
    q = shlex.quote
    lines = [f"hostname {net.hostname}"]
    lines += [f"echo {q(ip + ' ' + name)} >> /etc/hosts" for ip, name in net.hosts]
    lines.append('ip link set lo up || die "ip link set lo up"')
    lines.append('modprobe -a rdma_rxe rdma_ucm ib_uverbs || die "modprobe rdma_rxe rdma_ucm ib_uverbs"')
    if any(not link.nic for link in net.rdma):
        lines.append('modprobe dummy numdummies=0 || die "modprobe dummy"')
    if any(link.nic for link in net.rdma):
        # No udev in the guest: nothing loads the NIC's driver unless we do.
        lines.append('modprobe virtio_net || die "modprobe virtio_net"')
    for link in net.rdma:
        if link.nic:
            lines.append(f"for i in $(seq 100); do [ -e /sys/class/net/{link.netdev} ] && break; sleep 0.1; done")
            lines.append(f'[ -e /sys/class/net/{link.netdev} ] || die "no {link.netdev}: the virtio NIC did not appear"')
        else:
            lines.append(f'ip link add {link.netdev} type dummy || die "ip link add {link.netdev}"')
        lines.append(f'ip addr add {link.ip}/{GUEST_PREFIX} dev {link.netdev} || die "ip addr add"')
        lines.append(f'ip link set {link.netdev} up || die "ip link set {link.netdev} up"')
        lines.append(f'rdma link add {link.device} type rxe netdev {link.netdev} '
                     f'|| die "rdma link add {link.device}"')
    for i, link in enumerate(net.rdma):
        lines.append(f"""P=/sys/class/infiniband/{link.device}/ports/1
for i in $(seq 200); do
    st=$(cat $P/state 2>/dev/null)
    gid=$(cat $P/gids/{GUEST_GID_INDEX} 2>/dev/null)
    case "$st" in *ACTIVE*)
        [ -n "$gid" ] && [ "$gid" != "0000:0000:0000:0000:0000:0000:0000:0000" ] && break;;
    esac
    sleep 0.1
done
case "$st" in *ACTIVE*) ;; *) die "{link.device} port state is '$st', not ACTIVE";; esac
[ -e /dev/infiniband/uverbs{i} ] || die "/dev/infiniband/uverbs{i} missing"
echo "softroce-stage2: {link.device} on {link.netdev} ({link.ip}) ACTIVE (gid[{GUEST_GID_INDEX}]=$gid)\"""")
    if net.shared:
        lines.append(f"mkdir -p {SHARED_MOUNT} && mount -t 9p -o trans=virtio,version=9p2000.L,msize=512000 "
                     f'shared {SHARED_MOUNT} || die "mount of the shared directory (9p) failed"')
    return "\n".join(lines)


def _stage2_script(cmd: Sequence[str], env: dict[str, str], cwd: str, memlock: str,
                   net: _GuestNetwork) -> str:
    q = shlex.quote
    J = JOB_MOUNT
    envargs = " ".join(q(f"{k}={v}") for k, v in env.items())
    devices = " ".join(link.device for link in net.rdma)
    # A linked guest also tells the other one, through the shared directory, that its command
    # ended and how (the other's command may wait for it, e.g. a peer serving until then).
    announce = (f"echo $rc > {SHARED_MOUNT}/{net.hostname}.exit.tmp && "
                f"mv {SHARED_MOUNT}/{net.hostname}.exit.tmp {SHARED_MOUNT}/{net.hostname}.exit"
                if net.shared else "")
    return f"""#!/bin/bash
J={J}
export PATH={GUEST_PATH}
state() {{ echo "$*" >> $J/state; }}
die() {{
    echo "softroce-stage2: FAILED: $*"
    state "error $*"
    sync
    echo o > /proc/sysrq-trigger
    sleep 30
}}
state booted
echo "softroce-stage2: bringing up {devices}"
{_network_setup(net)}
ulimit -l {q(memlock)} || die "ulimit -l {memlock}"
echo "softroce-stage2: running command"
state started
if cd -- {q(cwd)}; then
    env -i {envargs} {" ".join(q(c) for c in cmd)} < /dev/null > $J/output 2>&1
    rc=$?
else
    echo "softroce: cannot cd to {q(cwd)} in the guest" > $J/output
    rc=125
fi
echo $rc > $J/rc.tmp && mv $J/rc.tmp $J/rc
{announce}
sync
echo o > /proc/sysrq-trigger
sleep 30
"""


# ----------------------------------------------------------------------------------------
# Running a guest


def _parse_memory(memory: str) -> str:
    if not re.fullmatch(r"\d+[MGmg]?", memory):
        raise ValueError(f"bad memory size {memory!r} (e.g. 2G, 1536M)")
    return memory.upper()


def _tail(path: Path, nbytes: int = 6000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - nbytes))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run(cmd: Sequence[str], timeout: float, env: dict[str, str] | None = None,
        cwd: str | None = None, memlock: str = "unlimited", *, memory: str = "2G",
        smp: int = 2, boot_timeout: float = 180.0,
        stream: IO[bytes] | None = None,
        log: Callable[[str], None] | None = None) -> GuestResult:
    """Boot a Soft-RoCE guest, run ``cmd`` in it and return its result.

    ``timeout`` bounds the command (from the moment it starts in the guest); booting is
    bounded separately by ``boot_timeout``.  On timeout qemu is killed and the result has
    ``returncode == 124`` and ``timed_out``.  ``env`` is the command's whole environment
    besides a default PATH/HOME/LANG and SOFTROCE_* (the host's environment is NOT passed).
    ``cwd`` defaults to the host's current directory (the host's / is visible read-only,
    with a tmpfs overlay: writes inside the guest are discarded).  ``stream`` receives the
    output bytes as they come.  Raises GuestError if the guest does not boot or rxe0 does
    not come up, PrerequisitesMissing when host packages are missing.
    """
    spec = _GuestSpec(list(cmd), env, cwd, memlock, _single_guest_network(), {
        "SOFTROCE_IP": GUEST_IP, "SOFTROCE_DEVICE": GUEST_RDMA_DEVICE}, stream)
    return _run_booting_twice([spec], timeout, memory=memory, smp=smp, boot_timeout=boot_timeout,
                              linger=0.0, log=log)[0]


@dataclasses.dataclass
class LinkedCommand:
    """What one of two linked guests runs (see run_linked)."""
    cmd: Sequence[str]
    env: dict[str, str] | None = None
    cwd: str | None = None
    memlock: str = "unlimited"
    stream: IO[bytes] | None = None


def run_linked(a: LinkedCommand, b: LinkedCommand, timeout: float, *,
               second_rdma_device: bool = False, memory: str = "2G", smp: int = 2,
               boot_timeout: float = 180.0, linger: float = 60.0,
               log: Callable[[str], None] | None = None) -> tuple[GuestResult, GuestResult]:
    """Boot two Soft-RoCE guests joined by a virtual Ethernet link and run a command in each.

    Guest ``a`` (hostname guest-a) is LINK_IPS[0] and guest ``b`` LINK_IPS[1] on their
    ``eth0`` (virtio-net; the two NICs exchange frames as UDP datagrams between two qemu
    processes on 127.0.0.1, so nothing leaves the machine and neither needs root or a tap).
    Each has its own kernel and ``rxe0`` on its ``eth0``: RDMA between them crosses the link.
    With ``second_rdma_device``, guest a also has ``rxe1`` on a dummy netdev at GUEST_IP,
    created before rxe0 so that it is the first device listed; only rxe0 reaches guest b.

    Both guests mount one read-write host directory at SHARED_MOUNT (``SOFTROCE_SHARED`` in
    the commands' environment) to coordinate; when a command ends, its guest writes the exit
    code to ``SHARED_MOUNT/<hostname>.exit``.  Once one command has ended, the other has
    ``linger`` seconds to end too, else its guest is killed and its result is a timeout, so a
    peer waiting for a partner that failed costs no more than that.  ``timeout`` bounds each
    command from its start.  The environment has SOFTROCE_IP / SOFTROCE_PEER_IP (own and
    other guest's link address), SOFTROCE_DEVICE=rxe0 and SOFTROCE_HOSTNAME.
    """
    memory = _parse_memory(memory)
    hosts = tuple(zip(LINK_IPS, LINK_HOSTNAMES))
    specs = []
    for i, command in enumerate((a, b)):
        rdma = [_RdmaLink(GUEST_RDMA_DEVICE, LINK_NETDEV, LINK_IPS[i], nic=True)]
        if second_rdma_device and i == 0:
            rdma.insert(0, _RdmaLink(SECOND_RDMA_DEVICE, GUEST_NETDEV, GUEST_IP, nic=False))
        net = _GuestNetwork(hostname=LINK_HOSTNAMES[i], hosts=hosts, rdma=tuple(rdma), shared=True)
        specs.append(_GuestSpec(list(command.cmd), command.env, command.cwd, command.memlock, net, {
            "SOFTROCE_IP": LINK_IPS[i], "SOFTROCE_PEER_IP": LINK_IPS[1 - i],
            "SOFTROCE_DEVICE": GUEST_RDMA_DEVICE, "SOFTROCE_HOSTNAME": LINK_HOSTNAMES[i],
            "SOFTROCE_SHARED": SHARED_MOUNT}, command.stream))
    first, second = _run_booting_twice(specs, timeout, memory=memory, smp=smp,
                                       boot_timeout=boot_timeout, linger=linger, log=log)
    return first, second


@dataclasses.dataclass
class _GuestSpec:
    cmd: list[str]
    env: dict[str, str] | None
    cwd: str | None
    memlock: str
    net: _GuestNetwork
    softroce_env: dict[str, str]  # SOFTROCE_* describing this guest
    stream: IO[bytes] | None


def _run_booting_twice(specs: list[_GuestSpec], timeout: float, **kw) -> list[GuestResult]:
    """_run_guests, once more if a guest never booted.

    Under TCG on a loaded host, qemu now and then stays silent from the start (no console
    output at all); a second boot has always come up. No command ran in that case (the guests
    are started together and a command starts only once its guest is up; linked ones are
    rebooted together), so running them again changes nothing.
    """
    try:
        return _run_guests(specs, timeout, **kw)
    except GuestError as error:
        if "did not boot" not in str(error):
            raise
        if kw.get("log"):
            kw["log"](f"softroce: {error}; booting afresh")
    return _run_guests(specs, timeout, **kw)


def _free_udp_ports(count: int) -> list[int]:
    """Ports free for UDP on 127.0.0.1 now (held until all are chosen, so they differ)."""
    import socket
    socks = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class _Guest:
    """One qemu process and its job directory, watched by _run_guests."""

    def __init__(self, spec: _GuestSpec, jobdir: Path, name: str) -> None:
        self.spec, self.jobdir, self.name = spec, jobdir, name
        self.proc: subprocess.Popen | None = None
        self.out_f: IO[bytes] | None = None
        self.chunks: list[bytes] = []
        self.t_started: float | None = None
        self.t_rc: float | None = None
        self.t_end: float | None = None
        self.timed_out = False

    @property
    def console(self) -> Path:
        return self.jobdir / "console.log"

    def pump(self) -> None:
        data = self.out_f.read() if self.out_f else b""
        if data:
            self.chunks.append(data)
            if self.spec.stream is not None:
                self.spec.stream.write(data)
                self.spec.stream.flush()

    def failure(self, msg: str) -> GuestError:
        tail = _tail(self.console)
        qerr = "\n".join(l for l in _tail(self.jobdir / "qemu.log", 2000).splitlines()
                         if "terminating on signal" not in l).strip()
        who = f"{self.name}: " if self.name else ""
        text = f"{who}{msg}\n--- tail of the guest console ---\n{tail.rstrip()}"
        if qerr:
            text += f"\n--- qemu ---\n{qerr}"
        return GuestError(text)

    def state(self) -> list[str]:
        path = self.jobdir / "state"
        return path.read_text().split() if path.exists() else []

    def finished(self) -> bool:
        return self.t_end is not None


def _run_guests(specs: list[_GuestSpec], timeout: float, *, memory: str = "2G", smp: int = 2,
                boot_timeout: float = 180.0, linger: float = 0.0,
                log: Callable[[str], None] | None = None) -> list[GuestResult]:
    """Boot one guest per spec (two are joined by a link, see run_linked), run each command and
    return their results. Raises GuestError if any guest does not boot or set up."""
    for spec in specs:
        if not spec.cmd:
            raise ValueError("empty command")
        if not re.fullmatch(r"unlimited|\d+", spec.memlock):
            raise ValueError(f"bad memlock {spec.memlock!r} (KB or 'unlimited')")
    memory = _parse_memory(memory)
    envs = []
    for spec in specs:
        full_env = {
            "PATH": GUEST_PATH, "HOME": "/root", "USER": "root", "LOGNAME": "root",
            "LANG": "C.UTF-8", "TERM": "dumb", "SOFTROCE_GUEST": "1",
            **spec.softroce_env, "SOFTROCE_GID_INDEX": str(GUEST_GID_INDEX),
        }
        for k, v in (spec.env or {}).items():
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k):
                raise ValueError(f"bad environment variable name {k!r}")
            full_env[k] = str(v)
        envs.append(full_env)

    art = ensure_artifacts(log)
    linked = len(specs) > 1
    keep = os.environ.get("TFRDMA_SOFTROCE_KEEP_JOB") == "1"
    scratch = Path(tempfile.mkdtemp(prefix="softroce-run-")) if linked else None
    guests: list[_Guest] = []
    try:
        for i, spec in enumerate(specs):
            jobdir = Path(tempfile.mkdtemp(prefix="softroce-job-", dir=scratch))
            guests.append(_Guest(spec, jobdir, spec.net.hostname if linked else ""))
        shared = scratch / "shared" if scratch else None
        if shared:
            shared.mkdir()
        ports = _free_udp_ports(len(specs)) if linked else []
        t0 = time.monotonic()
        for i, (g, full_env) in enumerate(zip(guests, envs)):
            cwd = os.path.abspath(g.spec.cwd or os.getcwd())
            (g.jobdir / "stage2.sh").write_text(
                _stage2_script(g.spec.cmd, full_env, cwd, g.spec.memlock, g.spec.net))
            (g.jobdir / "output").touch()
            qemu_cmd = [
                _which(QEMU) or QEMU, "-nodefaults", "-no-user-config", "-no-reboot",
                "-display", "none", "-monitor", "none", "-nic", "none",
                "-accel", "tcg,thread=multi", "-cpu", "max", "-smp", str(smp), "-m", memory,
                "-bios", QBOOT_ROM,
                "-kernel", str(art.vmlinux), "-initrd", str(art.initramfs),
                "-append", KERNEL_ARGS + " " + os.environ.get("TFRDMA_SOFTROCE_APPEND", ""),
                "-serial", f"file:{g.console}",
                "-fsdev", "local,id=hostroot,path=/,readonly=on,security_model=none,multidevs=remap",
                "-device", "virtio-9p-pci,fsdev=hostroot,mount_tag=hostroot",
                "-fsdev", f"local,id=job,path={g.jobdir},security_model=none",
                "-device", "virtio-9p-pci,fsdev=job,mount_tag=job",
            ]
            if linked:
                # Each NIC sends its frames as datagrams to the other's port: a point-to-point
                # Ethernet link that needs no root, no tap and no start order between the two.
                qemu_cmd += [
                    "-netdev", f"socket,id=link,udp=127.0.0.1:{ports[1 - i]},"
                               f"localaddr=127.0.0.1:{ports[i]}",
                    "-device", f"virtio-net-pci,netdev=link,mac=52:54:00:4e:00:{i + 1:02x}",
                    "-fsdev", f"local,id=shared,path={shared},security_model=none",
                    "-device", "virtio-9p-pci,fsdev=shared,mount_tag=shared",
                ]
            with open(g.jobdir / "qemu.log", "wb") as qlog:
                g.proc = subprocess.Popen(qemu_cmd, stdin=subprocess.DEVNULL, stdout=qlog,
                                          stderr=subprocess.STDOUT)
            g.out_f = open(g.jobdir / "output", "rb")

        while not all(g.finished() for g in guests):
            now = time.monotonic()
            ended = [g.t_rc or g.t_end for g in guests if g.t_rc or g.t_end]
            t_first_end = min(ended) if ended else None
            for g in guests:
                if g.finished():
                    continue
                g.pump()
                state = g.state()
                if g.t_started is None and "started" in state:
                    g.t_started = now
                if "error" in state:
                    try:
                        g.proc.wait(5)  # the guest powers itself off after a setup error
                    except subprocess.TimeoutExpired:
                        pass
                    _kill(g.proc)
                    text = (g.jobdir / "state").read_text()
                    raise g.failure("softroce guest setup failed: "
                                    + text.split("error", 1)[1].strip().splitlines()[0])
                stop = g.proc.poll() is not None
                if (g.jobdir / "rc").exists():  # done; qemu should be powering off
                    g.t_rc = g.t_rc or now
                    if now - g.t_rc > 10:
                        stop = True
                if g.t_started is None and now - t0 > boot_timeout:
                    _kill(g.proc)
                    raise g.failure(f"softroce guest did not boot within {boot_timeout:.0f} s")
                if g.t_started is not None and now - g.t_started > timeout:
                    stop = g.timed_out = True
                if t_first_end is not None and g.t_rc is None and now - t_first_end > linger:
                    stop = g.timed_out = True  # the other guest's command ended long ago
                if stop:
                    _kill(g.proc)
                    g.pump()
                    g.t_end = time.monotonic()
                    if g.t_started is None:
                        raise g.failure(f"softroce guest stopped before the command started "
                                        f"(qemu exit code {g.proc.returncode})")
            time.sleep(0.05)

        results = []
        for g in guests:
            g.out_f.close()
            output = b"".join(g.chunks).decode(errors="replace")
            if g.timed_out:
                rc = TIMEOUT_EXIT_CODE
            else:
                try:
                    rc = int((g.jobdir / "rc").read_text().strip())
                except (OSError, ValueError):
                    raise g.failure("softroce guest stopped before the command finished "
                                    f"(qemu exit code {g.proc.returncode})") from None
            results.append(GuestResult(
                returncode=rc, output=output, boot_seconds=round(g.t_started - t0, 2),
                run_seconds=round(g.t_end - g.t_started, 2), total_seconds=round(g.t_end - t0, 2),
                timed_out=g.timed_out, kernel=art.kver, console=_tail(g.console),
                job_dir=str(g.jobdir)))
        return results
    finally:
        for g in guests:
            if g.proc is not None:
                _kill(g.proc)
            if g.out_f is not None:
                g.out_f.close()
        kept = [str(g.jobdir) for g in guests] if not scratch else [str(scratch)]
        if keep:
            print(f"softroce: job dir kept: {' '.join(kept)}", file=sys.stderr)
        else:
            for path in kept:
                shutil.rmtree(path, ignore_errors=True)


# ----------------------------------------------------------------------------------------
# CLI


def _cli_run(args: argparse.Namespace) -> int:
    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        print("guest.py run: no command given (usage: run [options] -- CMD ARGS...)",
              file=sys.stderr)
        return 2
    env: dict[str, str] = {}
    for item in args.env or []:
        name, sep, value = item.partition("=")
        if not sep:
            print(f"guest.py run: --env expects NAME=VALUE, got {item!r}", file=sys.stderr)
            return 2
        env[name] = value

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    try:
        res = run(cmd, timeout=args.timeout, env=env, cwd=args.cwd, memlock=args.memlock,
                  memory=args.memory, boot_timeout=args.boot_timeout,
                  stream=sys.stdout.buffer, log=log)
    except GuestError as e:
        print(f"guest.py: {e}", file=sys.stderr)
        return HARNESS_ERROR_EXIT_CODE
    if res.timed_out:
        print(f"guest.py: TIMEOUT: command did not finish within {args.timeout:g} s; "
              f"qemu killed (exit {TIMEOUT_EXIT_CODE})", file=sys.stderr)
    elif not args.quiet:
        print(f"softroce: boot {res.boot_seconds:.1f} s, command {res.run_seconds:.1f} s, "
              f"exit {res.returncode}", file=sys.stderr)
    return res.returncode


def _cli_run_linked(args: argparse.Namespace) -> int:
    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    try:
        results = run_linked(LinkedCommand(["bash", "-c", args.a], cwd=args.cwd),
                             LinkedCommand(["bash", "-c", args.b], cwd=args.cwd),
                             timeout=args.timeout, second_rdma_device=args.second_rdma_device,
                             memory=args.memory, smp=args.smp, boot_timeout=args.boot_timeout,
                             linger=args.linger, log=log)
    except GuestError as e:
        print(f"guest.py: {e}", file=sys.stderr)
        return HARNESS_ERROR_EXIT_CODE
    for name, res in zip(LINK_HOSTNAMES, results):
        print(f"===== {name}: boot {res.boot_seconds:.1f} s, command {res.run_seconds:.1f} s, "
              f"exit {res.returncode}{' (TIMEOUT)' if res.timed_out else ''}\n{res.output}", end="")
    return max(res.returncode for res in results)


def _cli_check(args: argparse.Namespace) -> int:
    missing = missing_prerequisites()
    print(f"native RDMA device on the host: {'yes' if native_rdma_available() else 'no'}")
    k = find_kernel()
    print(f"guest kernel: {k[0] + ' (' + str(k[1]) + ')' if k else 'none'}")
    print(f"cache dir: {cache_dir()}")
    if missing:
        print("missing prerequisites:\n  " + "\n  ".join(missing))
        return 1
    print("all prerequisites installed")
    return 0


def _cli_build(args: argparse.Namespace) -> int:
    try:
        art = ensure_artifacts(lambda m: print(m, file=sys.stderr))
    except GuestError as e:
        print(f"guest.py: {e}", file=sys.stderr)
        return 1
    print(f"{art.vmlinux}\n{art.initramfs}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Run commands in a Soft-RoCE (rdma_rxe) qemu guest.")
    sub = p.add_subparsers(dest="action", required=True)
    r = sub.add_parser("run", help="boot a guest, bring up rxe0, run CMD, exit with its code")
    r.add_argument("--timeout", type=float, default=600.0,
                   help="seconds the command may run (boot not included); default 600")
    r.add_argument("--boot-timeout", type=float, default=180.0,
                   help="seconds the guest may take to boot and bring up rxe0; default 180")
    r.add_argument("--memory", default="2G", help="guest RAM, e.g. 2G (default)")
    r.add_argument("--env", action="append", metavar="NAME=VALUE",
                   help="environment variable for the command (repeatable)")
    r.add_argument("--cwd", help="directory to run in (default: the current directory)")
    r.add_argument("--memlock", default="unlimited", help="ulimit -l in KB or 'unlimited'")
    r.add_argument("-q", "--quiet", action="store_true", help="no timing line at the end")
    r.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD ARGS...")
    r.set_defaults(func=_cli_run)
    ln = sub.add_parser("run-linked", help="boot two linked guests, run --a in guest-a and --b in "
                                          "guest-b (bash -c), print both outputs")
    ln.add_argument("--a", required=True, help="shell command for guest-a (%s)" % LINK_IPS[0])
    ln.add_argument("--b", required=True, help="shell command for guest-b (%s)" % LINK_IPS[1])
    ln.add_argument("--second-rdma-device", action="store_true",
                    help=f"guest-a also gets {SECOND_RDMA_DEVICE} on a dummy netdev at {GUEST_IP}")
    ln.add_argument("--timeout", type=float, default=600.0, help="seconds each command may run")
    ln.add_argument("--linger", type=float, default=60.0,
                    help="seconds a command may go on after the other one ended; default 60")
    ln.add_argument("--boot-timeout", type=float, default=180.0)
    ln.add_argument("--memory", default="2G", help="RAM of each guest")
    ln.add_argument("--smp", type=int, default=2, help="vCPUs of each guest; default 2")
    ln.add_argument("--cwd", help="directory both commands run in (default: the current one)")
    ln.set_defaults(func=_cli_run_linked)
    c = sub.add_parser("check", help="report missing prerequisites and native RDMA")
    c.set_defaults(func=_cli_check)
    b = sub.add_parser("build", help="build the cached vmlinux + initramfs")
    b.set_defaults(func=_cli_build)
    args = p.parse_args(argv)
    # Turn SIGTERM into SystemExit so that qemu and the job dir are cleaned up.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("guest.py: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

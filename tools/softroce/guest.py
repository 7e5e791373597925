#!/usr/bin/env python3
"""Run a command inside a throwaway qemu guest that has a real kernel RDMA stack (Soft-RoCE).

The host kernel has no RDMA support, so this boots Debian's own kernel (which ships
``rdma_rxe``) under qemu/TCG, with the host's ``/`` shared read-only through 9p and a tmpfs
overlay on top.  In the guest, ``rxe0`` is brought up on a dummy netdev (10.77.0.1/24,
GID index 1 is RoCE v2), the command runs, its combined stdout/stderr and exit code come
back to the host through a second, per-job 9p share, and the guest powers off.

CLI::

    python tools/softroce/guest.py run [--timeout S] [--memory 2G] [--env N=V ...]
                                       [--cwd DIR] [--memlock KB|unlimited] -- CMD ARGS...
    python tools/softroce/guest.py check     # prerequisites / native RDMA
    python tools/softroce/guest.py build     # (re)build the cached vmlinux + initramfs

Python API::

    from guest import run, native_rdma_available, missing_prerequisites
    res = run(["ibv_devinfo"], timeout=60)
    res.returncode, res.output, res.boot_seconds

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
    env = os.environ.get("TF_RDMA_SOFTROCE_CACHE")
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


def _stage2_script(cmd: Sequence[str], env: dict[str, str], cwd: str, memlock: str) -> str:
    q = shlex.quote
    J = JOB_MOUNT
    envargs = " ".join(q(f"{k}={v}") for k, v in env.items())
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
echo "softroce-stage2: bringing up {GUEST_RDMA_DEVICE}"
hostname softroce-guest
echo "{GUEST_IP} softroce-guest" >> /etc/hosts
ip link set lo up || die "ip link set lo up"
modprobe -a rdma_rxe rdma_ucm ib_uverbs || die "modprobe rdma_rxe rdma_ucm ib_uverbs"
modprobe dummy numdummies=0 || die "modprobe dummy"
ip link add {GUEST_NETDEV} type dummy || die "ip link add {GUEST_NETDEV}"
ip addr add {GUEST_IP}/{GUEST_PREFIX} dev {GUEST_NETDEV} || die "ip addr add"
ip link set {GUEST_NETDEV} up || die "ip link set {GUEST_NETDEV} up"
rdma link add {GUEST_RDMA_DEVICE} type rxe netdev {GUEST_NETDEV} \
    || die "rdma link add {GUEST_RDMA_DEVICE}"
P=/sys/class/infiniband/{GUEST_RDMA_DEVICE}/ports/1
for i in $(seq 200); do
    st=$(cat $P/state 2>/dev/null)
    gid=$(cat $P/gids/{GUEST_GID_INDEX} 2>/dev/null)
    case "$st" in *ACTIVE*)
        [ -n "$gid" ] && [ "$gid" != "0000:0000:0000:0000:0000:0000:0000:0000" ] && break;;
    esac
    sleep 0.1
done
case "$st" in *ACTIVE*) ;; *) die "{GUEST_RDMA_DEVICE} port state is '$st', not ACTIVE";; esac
[ -e /dev/infiniband/uverbs0 ] || die "/dev/infiniband/uverbs0 missing"
ulimit -l {q(memlock)} || die "ulimit -l {memlock}"
echo "softroce-stage2: {GUEST_RDMA_DEVICE} ACTIVE (gid[{GUEST_GID_INDEX}]=$gid), running command"
state started
if cd -- {q(cwd)}; then
    env -i {envargs} {" ".join(q(c) for c in cmd)} < /dev/null > $J/output 2>&1
    rc=$?
else
    echo "softroce: cannot cd to {q(cwd)} in the guest" > $J/output
    rc=125
fi
echo $rc > $J/rc.tmp && mv $J/rc.tmp $J/rc
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
    """Boot a Soft-RoCE guest, run ``cmd`` in it and return its result (see _run_once).

    A guest that never booted is booted once more: under TCG on a loaded host, qemu now and then
    stays silent from the start (no console output at all); a second boot has always come up.
    The command never ran in that case, so running it again changes nothing.
    """
    for attempt in (1, 2):
        try:
            return _run_once(cmd, timeout, env, cwd, memlock, memory=memory, smp=smp,
                             boot_timeout=boot_timeout, stream=stream, log=log)
        except GuestError as error:
            if attempt == 2 or "did not boot" not in str(error):
                raise
            if log:
                log(f"softroce: {error}; booting a fresh guest")


def _run_once(cmd: Sequence[str], timeout: float, env: dict[str, str] | None = None,
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
    cmd = list(cmd)
    if not cmd:
        raise ValueError("empty command")
    if not re.fullmatch(r"unlimited|\d+", memlock):
        raise ValueError(f"bad memlock {memlock!r} (KB or 'unlimited')")
    memory = _parse_memory(memory)
    cwd = os.path.abspath(cwd or os.getcwd())
    full_env = {
        "PATH": GUEST_PATH, "HOME": "/root", "USER": "root", "LOGNAME": "root",
        "LANG": "C.UTF-8", "TERM": "dumb",
        "SOFTROCE_GUEST": "1", "SOFTROCE_IP": GUEST_IP,
        "SOFTROCE_DEVICE": GUEST_RDMA_DEVICE, "SOFTROCE_GID_INDEX": str(GUEST_GID_INDEX),
    }
    for k, v in (env or {}).items():
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k):
            raise ValueError(f"bad environment variable name {k!r}")
        full_env[k] = str(v)

    art = ensure_artifacts(log)
    jobdir = Path(tempfile.mkdtemp(prefix="softroce-job-"))
    keep = os.environ.get("TF_RDMA_SOFTROCE_KEEP_JOB") == "1"
    proc: subprocess.Popen | None = None
    try:
        (jobdir / "stage2.sh").write_text(_stage2_script(cmd, full_env, cwd, memlock))
        (jobdir / "output").touch()
        console = jobdir / "console.log"
        qemu_cmd = [
            _which(QEMU) or QEMU, "-nodefaults", "-no-user-config", "-no-reboot",
            "-display", "none", "-monitor", "none", "-nic", "none",
            "-accel", "tcg,thread=multi", "-cpu", "max", "-smp", str(smp), "-m", memory,
            "-bios", QBOOT_ROM,
            "-kernel", str(art.vmlinux), "-initrd", str(art.initramfs),
            "-append", KERNEL_ARGS + " " + os.environ.get("TF_RDMA_SOFTROCE_APPEND", ""),
            "-serial", f"file:{console}",
            "-fsdev", "local,id=hostroot,path=/,readonly=on,security_model=none,multidevs=remap",
            "-device", "virtio-9p-pci,fsdev=hostroot,mount_tag=hostroot",
            "-fsdev", f"local,id=job,path={jobdir},security_model=none",
            "-device", "virtio-9p-pci,fsdev=job,mount_tag=job",
        ]
        t0 = time.monotonic()
        with open(jobdir / "qemu.log", "wb") as qlog:
            proc = subprocess.Popen(qemu_cmd, stdin=subprocess.DEVNULL, stdout=qlog,
                                    stderr=subprocess.STDOUT)
        out_f = open(jobdir / "output", "rb")
        chunks: list[bytes] = []
        t_started: float | None = None
        t_rc: float | None = None
        timed_out = False

        def pump() -> None:
            data = out_f.read()
            if data:
                chunks.append(data)
                if stream is not None:
                    stream.write(data)
                    stream.flush()

        def fail(msg: str) -> GuestError:
            tail = _tail(console)
            qerr = "\n".join(l for l in _tail(jobdir / "qemu.log", 2000).splitlines()
                             if "terminating on signal" not in l).strip()
            text = f"{msg}\n--- tail of the guest console ---\n{tail.rstrip()}"
            if qerr:
                text += f"\n--- qemu ---\n{qerr}"
            return GuestError(text)

        try:
            while True:
                pump()
                now = time.monotonic()
                state = (jobdir / "state").read_text() if (jobdir / "state").exists() else ""
                if t_started is None and "started" in state.split():
                    t_started = now
                if "error" in state.split():
                    try:
                        proc.wait(5)  # the guest powers itself off after a setup error
                    except subprocess.TimeoutExpired:
                        pass
                    _kill(proc)
                    raise fail("softroce guest setup failed: "
                               + state.split("error", 1)[1].strip().splitlines()[0])
                if proc.poll() is not None:
                    break
                if (jobdir / "rc").exists():  # done; qemu should be powering off
                    t_rc = t_rc or now
                    if now - t_rc > 10:
                        _kill(proc)
                        break
                if t_started is None and now - t0 > boot_timeout:
                    _kill(proc)
                    raise fail(f"softroce guest did not boot within {boot_timeout:.0f} s")
                if t_started is not None and now - t_started > timeout:
                    _kill(proc)
                    timed_out = True
                    break
                time.sleep(0.05)
            pump()
            t_end = time.monotonic()
        finally:
            out_f.close()
        if t_started is None:
            raise fail(f"softroce guest stopped before the command started "
                       f"(qemu exit code {proc.returncode})")
        output = b"".join(chunks).decode(errors="replace")
        if timed_out:
            rc = TIMEOUT_EXIT_CODE
        else:
            try:
                rc = int((jobdir / "rc").read_text().strip())
            except (OSError, ValueError):
                raise fail("softroce guest stopped before the command finished "
                           f"(qemu exit code {proc.returncode})") from None
        return GuestResult(
            returncode=rc, output=output, boot_seconds=round(t_started - t0, 2),
            run_seconds=round(t_end - t_started, 2), total_seconds=round(t_end - t0, 2),
            timed_out=timed_out, kernel=art.kver, console=_tail(console), job_dir=str(jobdir))
    finally:
        if proc is not None:
            _kill(proc)
        if keep:
            print(f"softroce: job dir kept: {jobdir}", file=sys.stderr)
        else:
            shutil.rmtree(jobdir, ignore_errors=True)


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

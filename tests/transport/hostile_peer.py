"""A hostile tf_rdma peer written from the wire format (cc/transport/wire.h) through wire_client,
never through tf_rdma's own client: it fuzzes every frame type with a seeded random generator and
predicts, from the protocol's rules alone, what the peer under attack must make of each frame.

A batch is one connection: frames the victim must accept (it keeps the connection) up to the first
it must refuse, which ends the connection with a ProtocolError naming the cause; a batch of only
acceptable frames ends with an unknown frame type, so every batch's outcome is known exactly and
proves that every frame before it was taken as harmless."""
import contextlib
import fcntl
import mmap
import os
import random
import select
import socket
import struct
import threading

from tests.transport import wire_client as w
from tests.transport.victim_process import CANARY, GRANTS, REGION_SIZE, WRITES, write_payload

U64 = 2**64 - 1
U32 = 2**32 - 1
# The victim runs with the default limits; none of a batch's few frames comes near them.
SHM_MAX_MAPPED_BYTES = 64 << 30
OUR_REGION_ID, OUR_REGION_SIZE, OUR_CANARY = 1, 64 << 10, 0x3C
NAMES = {getattr(w, n): n for n in ("HELLO", "CHALLENGE", "PROOF", "ACCEPT", "REJECT", "GRANT", "DATA",
                                    "TOO_SMALL", "REVOKE", "REVOKED", "PING", "SHM_REGION", "DISCARD",
                                    "SHM_REGION_GONE", "WITHDRAWN")}


def memfd(size, seal=True, fill=None):
    fd = os.memfd_create("hostile-region", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if fill is not None and size:
        os.pwrite(fd, bytes([fill]) * size, 0)
    if seal:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
    return fd


class Reader:
    """Reads what the victim sends on a thread: its grants (and on shm its regions, mapped), the
    data it writes into our grants, and its REJECT. Whatever breaks the rules goes to `violations`."""

    def __init__(self, peer, our_grants, our_regions):
        self.peer = peer
        self.our_grants = our_grants  # id -> [(tag, region_id, offset, capacity)], as we granted
        self.our_regions = our_regions  # shm: id -> mapping of each region we shared, canary-filled
        self.victim_grants = {}  # id -> (tag, region_id, offset, capacity)
        self.victim_regions = {}  # shm: id -> mmap
        self.rejected = None
        self.closed = False
        self.violations = []
        self.filled = []  # our grants the victim wrote into
        self.changed = threading.Condition()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        buffer, fds = b"", []
        sock = self.peer.sock
        sock.settimeout(30)
        try:
            while True:
                chunk, new_fds, _, _ = socket.recv_fds(sock, 1 << 16, 8)
                fds += new_fds
                if not chunk:
                    break
                buffer += chunk
                while len(buffer) >= 8:
                    kind, _, length = struct.unpack("<B3sI", buffer[:8])
                    payload = 0
                    if kind == w.DATA and self.peer.backend == "tcp" and len(buffer) >= 8 + length:
                        payload = struct.unpack("<QQ", buffer[8:24])[1]
                    if len(buffer) < 8 + length + payload:
                        break
                    body = buffer[8:8 + length]
                    self.handle(kind, body, buffer[8 + length:8 + length + payload], fds)
                    buffer = buffer[8 + length + payload:]
        except (OSError, ValueError):
            pass
        finally:
            for fd in fds:
                os.close(fd)
            with self.changed:
                self.closed = True
                self.changed.notify_all()

    def handle(self, kind, body, payload, fds):
        with self.changed:
            if kind == w.GRANT:
                grant_id, _, tag, region_id, offset, capacity = struct.unpack("<QQQIQQ", body)
                self.victim_grants[grant_id] = (tag, region_id, offset, capacity)
            elif kind == w.SHM_REGION:
                region_id, size = struct.unpack("<IQ", body)
                fd = fds.pop(0)
                self.victim_regions[region_id] = mmap.mmap(fd, size)
                os.close(fd)
            elif kind == w.DATA:
                self.check_data(*struct.unpack("<QQ", body), payload)
            elif kind == w.REJECT:
                self.rejected = body[6:].decode(errors="replace")
            elif kind not in (w.PING, w.TOO_SMALL, w.REVOKED):
                self.violations.append(f"victim sent an unexpected {NAMES.get(kind, kind)} frame")
            self.changed.notify_all()

    def check_data(self, grant_id, length, payload):
        """The victim wrote one of its WRITES into one of our grants: it must be that write,
        whole, inside the grant."""
        # An id may be granted again once the victim paired it; DATA then answers the oldest.
        grants = self.our_grants.get(grant_id)
        if not grants:
            self.violations.append(f"victim sent DATA for grant {grant_id}, which we never granted")
            return
        fitting = [g for g in grants if dict(WRITES).get(g[0]) == length and length <= g[3]]
        if not fitting:
            self.violations.append(f"victim wrote {length} bytes into grant {grant_id}, granted as {grants}")
            return
        grants.remove(fitting[0])
        self.filled.append(fitting[0])
        tag, region_id, offset, _ = fitting[0]
        if self.peer.backend == "shm" and self.overlapped(fitting[0]):
            return  # we granted the same bytes twice: the later write may have overwritten them
        landed = payload if self.peer.backend == "tcp" else self.our_regions[region_id][offset:offset + length]
        if landed != write_payload(tag, length):
            self.violations.append(f"victim's DATA for grant {grant_id} is not the bytes it wrote")

    def overlapped(self, grant):
        _, region_id, offset, capacity = grant
        others = [g for gs in self.our_grants.values() for g in gs] + self.filled
        return any(g is not grant and g[1] == region_id and g[2] < offset + capacity and offset < g[2] + g[3]
                   for g in others)

    def wait_for(self, predicate, timeout=10):
        with self.changed:
            return self.changed.wait_for(lambda: predicate() or self.closed, timeout)


class Model:
    """What the victim's connection knows, as the protocol defines it, so that the fate of the
    next frame can be predicted."""

    def __init__(self, backend, victim_grants):
        self.backend = backend
        self.victim_grants = dict(victim_grants)  # outstanding: id -> (tag, region, offset, capacity)
        self.victim_grant_ids = list(victim_grants)
        self.waiting = dict(WRITES)  # victim's writes waiting for a grant: tag -> length
        self.our_unused = {}  # our grants the victim keeps for later writes: id -> tag
        self.our_grants = {}  # every grant of ours the victim accepted: id -> [(tag, region, offset, capacity)]
        self.shared = {OUR_REGION_ID: OUR_REGION_SIZE} if backend == "shm" else {}
        self.mapped = OUR_REGION_SIZE if backend == "shm" else 0
        # What the victim's region must hold at the end: canaries, and what we wrote into its grants.
        self.victim_region = bytearray([CANARY]) * REGION_SIZE


class Fuzzer:
    """Seeded generator of (frame bytes, descriptors to pass, expected outcome, effect)."""

    def __init__(self, seed):
        self.random = random.Random(seed)

    def pick(self, *choices):
        return self.random.choice(choices)

    def u64(self, *likely):
        return self.pick(0, 1, U64, U64 - 1, 2**63, 2**32, self.random.getrandbits(64),
                         self.random.randrange(1 << 16), *likely)

    def u32(self, *likely):
        return self.pick(0, 1, U32, 2**31, self.random.getrandbits(32), *likely)

    def text(self):
        length = self.pick(0, 5, 200, 512, 513, 4000)
        return bytes(self.random.getrandbits(8) for _ in range(length))

    def next_frame(self, model):
        kind = self.random.choices(
            list(NAMES),
            # Frames a peer may send after the handshake are likelier: a batch then runs longer
            # before the frame that ends it, and exercises the state the earlier ones built.
            weights=[0.5, 0.5, 0.5, 0.5, 0.3, 6, 6, 3, 3, 1, 3, 3 if model.backend == "shm" else 0.5, 2,
                     1 if model.backend == "shm" else 0.3, 2])[0]
        return getattr(self, f"fuzz_{NAMES[kind].lower()}")(model)

    # Each fuzz_* returns (bytes, fds, expected, effect): expected is None for a frame the victim
    # must accept, else a regex its ProtocolError must match; effect(model) applies an accepted
    # frame to the model (and may return bytes to send right after the frame: a tcp payload).

    def handshake_frame(self, kind):
        body = w.greeting(self.pick(w.PROTOCOL_VERSION, 0, U32), self.pick("tcp", "shm", "verbs"),
                          os.urandom(32), self.text()[:self.pick(10, 600)])
        if kind in (w.PROOF, w.ACCEPT):
            body = os.urandom(self.pick(32, 31, 33, 0))
        body = self.maybe_cut(body)
        name = NAMES[kind]
        return w.frame(kind, body), [], rf"(unexpected {name} frame after the handshake|malformed {name} frame)", None

    def maybe_cut(self, body):
        """Sometimes the body is cut short or has bytes added: the header's length still matches."""
        roll = self.random.random()
        if roll < 0.05 and body:
            return body[:self.random.randrange(len(body))]
        if roll < 0.1:
            return body + os.urandom(self.random.randrange(1, 9))
        return body

    def fuzz_hello(self, model):
        return self.handshake_frame(w.HELLO)

    def fuzz_challenge(self, model):
        return self.handshake_frame(w.CHALLENGE)

    def fuzz_proof(self, model):
        return self.handshake_frame(w.PROOF)

    def fuzz_accept(self, model):
        return self.handshake_frame(w.ACCEPT)

    def fuzz_reject(self, model):
        message = self.text()[:4090]
        body = struct.pack("<I", self.u32(*range(1, 17))) + w.string(message)
        if self.random.random() < 0.2:
            body = body[:self.random.randrange(len(body))]
            return w.frame(w.REJECT, body), [], "(malformed REJECT frame|closed the connection)", None
        return w.frame(w.REJECT, body), [], "REJECT", None

    def fixed_body(self, kind, fmt, fields, name):
        """A fixed-layout frame: body as packed, or (rarely) cut short / too long, which the
        decoder must refuse before acting on any field."""
        body = struct.pack(fmt, *fields)
        cut = self.maybe_cut(body)
        if cut == body:
            return w.frame(kind, body), None
        if len(cut) < len(body):
            return w.frame(kind, cut), rf"malformed {name} frame: truncated"
        return w.frame(kind, cut), rf"malformed {name} frame: \d+ trailing bytes"

    def victim_grant_id(self, model):
        return self.pick(*model.victim_grants, *model.victim_grant_ids, self.u64())

    def fuzz_grant(self, model):
        grant_id = self.pick(self.u64(), self.u64(*model.our_unused), *model.our_unused.keys() or [7])
        tag = self.pick(100, 101, 100, 101, self.u64(), 0)
        tag_hi = self.pick(0, 0, 0, self.u64())
        region_id = self.pick(OUR_REGION_ID, OUR_REGION_ID, *model.shared, self.u32())
        size = model.shared.get(region_id, OUR_REGION_SIZE)
        offset = self.pick(0, 1000, 20000, size - 1, size, self.u64(), self.random.randrange(size + 1))
        capacity = self.pick(0, 10, 2999, 3000, 5000, size, size - offset if offset <= size else 1,
                             self.u64())
        encoded, malformed = self.fixed_body(w.GRANT, "<QQQIQQ",
                                             (grant_id, tag_hi, tag, region_id, offset, capacity), "GRANT")
        if malformed:
            return encoded, [], malformed, None
        full_tag = (tag_hi, tag)
        if model.backend == "shm":
            if region_id not in model.shared:
                return encoded, [], rf"GRANT in region {region_id}, which the peer never shared", None
            if offset > size or capacity > size - offset:
                return encoded, [], rf"GRANT of \[{offset}, \+{capacity}\) outside region {region_id} of {size} bytes", None
        if grant_id in model.our_unused:
            return encoded, [], rf"grant id {grant_id} granted twice", None

        def effect(model):
            model.our_grants.setdefault(grant_id, []).append(
                (tag if tag_hi == 0 else -1, region_id, offset, capacity))
            length = model.waiting.get(tag) if tag_hi == 0 else None
            if length is None:
                model.our_unused[grant_id] = full_tag
            elif capacity >= length:
                del model.waiting[tag]  # paired: the victim writes into it
            # else: the victim answers TOO_SMALL and its write keeps waiting
        return encoded, [], None, effect

    def fuzz_data(self, model):
        grant_id = self.victim_grant_id(model)
        outstanding = model.victim_grants.get(grant_id)
        capacity = outstanding[3] if outstanding else 100
        length = self.pick(0, 1, capacity, capacity, capacity - 1, capacity + 1, self.u64())
        encoded, malformed = self.fixed_body(w.DATA, "<QQ", (grant_id, length), "DATA")
        if malformed:
            return encoded, [], malformed, None
        if outstanding is None:
            return encoded, [], rf"DATA for grant {grant_id}, which is not outstanding", None
        if length > capacity:
            if model.backend == "tcp" and length < (1 << 16):
                encoded += os.urandom(length)  # the overlong payload too, should the victim take it
            return encoded, [], rf"DATA of {length} bytes for a grant of {capacity}", None
        payload = os.urandom(length)
        _, region_id, offset, _ = outstanding

        def effect(model):
            del model.victim_grants[grant_id]
            model.victim_region[offset:offset + length] = payload
            if model.backend == "tcp":
                return payload
            model.write_victim_region(region_id, offset, payload)
        return encoded, [], None, effect

    def fuzz_too_small(self, model):
        grant_id = self.victim_grant_id(model)
        outstanding = model.victim_grants.get(grant_id)
        capacity = outstanding[3] if outstanding else 100
        needed = self.pick(0, capacity, capacity + 1, U64, self.u64())
        encoded, malformed = self.fixed_body(w.TOO_SMALL, "<QQ", (grant_id, needed), "TOO_SMALL")
        if malformed:
            return encoded, [], malformed, None
        if outstanding is None:
            return encoded, [], rf"grant {grant_id} returned but not outstanding", None
        if needed <= capacity:
            return encoded, [], rf"TOO_SMALL for a message of {needed} bytes that fits the grant of {capacity}", None
        def effect(model):
            del model.victim_grants[grant_id]
        return encoded, [], None, effect

    def fuzz_revoke(self, model):
        grant_id = self.pick(*model.our_unused.keys() or [3], self.u64())
        encoded, malformed = self.fixed_body(w.REVOKE, "<Q", (grant_id,), "REVOKE")
        if malformed:
            return encoded, [], malformed, None
        # The victim gives back an unused grant of ours (REVOKED) and ignores any other id.
        def effect(model):
            model.our_unused.pop(grant_id, None)
        return encoded, [], None, effect

    def fuzz_revoked(self, model):
        grant_id = self.victim_grant_id(model)
        encoded, malformed = self.fixed_body(w.REVOKED, "<Q", (grant_id,), "REVOKED")
        if malformed:
            return encoded, [], malformed, None
        if grant_id not in model.victim_grants:
            return encoded, [], rf"grant {grant_id} returned but not outstanding", None
        return encoded, [], rf"REVOKED for grant {grant_id}, which was never revoked", None

    def fuzz_ping(self, model):
        if self.random.random() < 0.1:
            extra = self.random.randrange(1, 9)
            return w.frame(w.PING, os.urandom(extra)), [], rf"malformed PING frame: {extra} trailing bytes", None
        return w.frame(w.PING), [], None, lambda model: None

    def fuzz_discard(self, model):
        tag = self.pick(100, 101, self.u64())
        tag_hi = self.pick(0, 0, self.u64())
        encoded, malformed = self.fixed_body(w.DISCARD, "<QQ", (tag_hi, tag), "DISCARD")
        if malformed:
            return encoded, [], malformed, None

        def effect(model):
            if tag_hi == 0:
                model.waiting.pop(tag, None)  # the victim's write under it ends cancelled
        return encoded, [], None, effect

    def fuzz_withdrawn(self, model):
        grant_id = self.victim_grant_id(model)
        code = self.pick(1, 10, 14, 16, 0, 17, self.u32())
        reason = self.text()[:self.pick(0, 100, 256, 257)]
        body = struct.pack("<QI", grant_id, code) + w.string(reason)
        cut = self.maybe_cut(body)
        encoded = w.frame(w.WITHDRAWN, cut)
        if cut != body:
            # Where the cut falls decides which field the decoder finds wrong first.
            return encoded, [], r"malformed WITHDRAWN frame: (truncated|\d+ trailing bytes|string of \d+ bytes)", None
        if len(reason) > 256:
            return encoded, [], rf"malformed WITHDRAWN frame: string of {len(reason)} bytes exceeds the limit of 256", None
        if not 1 <= code <= 16:
            return encoded, [], rf"malformed WITHDRAWN frame: status code {code} is not an error code", None
        if grant_id not in model.victim_grants:
            return encoded, [], rf"WITHDRAWN for grant {grant_id}, which is not outstanding", None

        def effect(model):
            del model.victim_grants[grant_id]  # it fails as aborted, with our reason
        return encoded, [], None, effect

    def fuzz_shm_region(self, model):
        region_id = self.pick(OUR_REGION_ID, *model.shared, self.u32(), self.random.randrange(2, 50))
        actual = self.pick(0, 4096, 65536)
        declared = self.pick(actual, actual, actual, actual + 1, U64, 64 << 40, self.u64())
        sealed = self.random.random() < 0.85
        encoded, malformed = self.fixed_body(w.SHM_REGION, "<IQ", (region_id, declared), "SHM_REGION")
        if model.backend == "tcp":
            return encoded, [], malformed or "SHM_REGION frame on a tcp connection", None
        descriptors = self.pick(1, 1, 1, 1, 0, 2)
        fds = [memfd(actual, seal=sealed, fill=OUR_CANARY) for _ in range(descriptors)]
        if malformed:
            # Decoding comes before anything else; a descriptor riding along is closed regardless.
            expected = malformed
        elif descriptors == 2:
            expected = "the peer passed 2 file descriptors with a SHM_REGION frame, which carries exactly one"
        elif descriptors == 0:
            expected = "SHM_REGION frame without a file descriptor"
        elif declared > SHM_MAX_MAPPED_BYTES - model.mapped:
            expected = rf"SHM_REGION {region_id} of {declared} bytes would make this process map more than"
        elif declared != actual or not sealed:
            expected = rf"SHM_REGION {region_id}: descriptor is not a sealed region of {declared} bytes"
        elif region_id in model.shared:
            expected = rf"region {region_id} shared twice"
        else:
            expected = None
        if expected:
            return encoded, fds, expected, None

        def effect(model):
            model.shared[region_id] = actual
            model.mapped += actual
            if actual:  # kept, to check what the victim writes there
                model.our_regions[region_id] = mmap.mmap(fds[0], actual)
        return encoded, fds, None, effect

    def fuzz_shm_region_gone(self, model):
        # Not a region holding a grant of ours: a receiver says a region is gone only once no grant
        # into it is out, and whether the victim's write into one came before would be a race.
        granted = {grant[1] for grants in model.our_grants.values() for grant in grants}
        region_id = self.pick(*sorted(set(model.shared) - granted), self.u32(), self.random.randrange(2, 50))
        while region_id in granted:
            region_id = self.u32()
        encoded, malformed = self.fixed_body(w.SHM_REGION_GONE, "<I", (region_id,), "SHM_REGION_GONE")
        if model.backend == "tcp":
            return encoded, [], malformed or "SHM_REGION_GONE frame on a tcp connection", None
        if malformed:
            return encoded, [], malformed, None
        if region_id not in model.shared:
            return encoded, [], rf"SHM_REGION_GONE for region {region_id}, which the peer has not shared", None

        def effect(model):
            model.mapped -= model.shared.pop(region_id)
            model.our_regions.pop(region_id, None)
        return encoded, [], None, effect

    def terminal_frame(self, backend):
        """What ends a batch of acceptable frames: a frame the victim must refuse for its framing."""
        kinds = [
            (w.frame(self.pick(0, w.WITHDRAWN + 1, 99, 255)), [], "unknown frame type"),
            (w.frame(w.PING, reserved=self.pick(b"\1\0\0", b"\0\0\1", b"\xff\xff\xff")), [],
             "malformed frame header: reserved bytes are not zero"),
            (w.frame(w.DATA, length=self.pick(4097, 1 << 20, U32)), [], "exceeds the limit of 4096"),
        ]
        if backend == "shm":
            count = self.pick(1, 3)
            kinds.append((w.frame(w.PING), [memfd(0) for _ in range(count)],
                          rf"the peer passed {count} file descriptors? with a"))
        encoded, fds, expected = self.pick(*kinds)
        return encoded, fds, expected


class Batch:
    """One connection's worth of fuzzed frames against the victim, and what it must make of them."""

    def __init__(self, backend, endpoint, key, fuzzer):
        self.backend = backend
        self.fuzzer = fuzzer
        self.peer = w.RawPeer(backend, endpoint)
        self.peer.handshake(key, name="hostile")
        self.our_regions = {}
        if backend == "shm":
            fd = memfd(OUR_REGION_SIZE, fill=OUR_CANARY)
            self.our_regions[OUR_REGION_ID] = mmap.mmap(fd, OUR_REGION_SIZE)
            socket.send_fds(self.peer.sock, [w.frame(w.SHM_REGION, struct.pack("<IQ", OUR_REGION_ID, OUR_REGION_SIZE))], [fd])
            os.close(fd)
        self.our_grants = {}
        self.reader = Reader(self.peer, self.our_grants, self.our_regions)
        self.sent = []  # frame type names, in order

    def wait_for_victim_grants(self):
        ready = self.reader.wait_for(lambda: len(self.reader.victim_grants) == len(GRANTS)
                                     and len(self.reader.victim_regions) >= (self.backend == "shm"))
        assert ready and not self.reader.closed, "the victim never granted"
        self.model = Model(self.backend, self.reader.victim_grants)
        self.model.our_grants = self.our_grants
        self.model.write_victim_region = self.write_victim_region
        self.model.our_regions = self.our_regions

    def write_victim_region(self, region_id, offset, payload):
        self.reader.victim_regions[region_id][offset:offset + len(payload)] = payload

    def send(self, encoded, fds=()):
        if fds:
            socket.send_fds(self.peer.sock, [encoded], fds)
            for fd in fds:
                os.close(fd)
        else:
            self.peer.send(encoded)

    def flood(self, chunks):
        """Sends `chunks` until the victim closes the connection: one that stopped reading would
        leave a plain sendall blocked. Returns whether all of them went out."""
        for chunk in chunks:
            view = memoryview(chunk)
            while view:
                if self.reader.closed:
                    return False
                if select.select([], [self.peer.sock], [], 0.1)[1]:
                    try:
                        view = view[self.peer.sock.send(view):]
                    except (BrokenPipeError, ConnectionResetError):
                        return False
        return True

    def run(self, max_frames):
        """Sends up to `max_frames` fuzzed frames; returns the regex the victim's error must match."""
        for _ in range(max_frames):
            encoded, fds, expected, effect = self.fuzzer.next_frame(self.model)
            self.sent.append(NAMES.get(encoded[0], encoded[0]))
            if expected is not None:
                self.send(encoded, fds)
                return expected
            # The model first: the victim may answer (write into a grant) before send returns.
            follow = effect(self.model)
            self.send(encoded, fds)
            if follow:
                self.peer.send(follow)
        encoded, fds, expected = self.fuzzer.terminal_frame(self.backend)
        self.sent.append(f"terminal {NAMES.get(encoded[0], encoded[0])}")
        self.send(encoded, fds)
        return expected

    def finish(self):
        """Waits until the victim closed the connection; returns problems seen on our side."""
        closed = self.reader.wait_for(lambda: False, timeout=15)
        problems = list(self.reader.violations)
        if not closed:
            problems.append("the victim did not close the connection within 15 s")
        granted = [g for gs in self.our_grants.values() for g in gs] + self.reader.filled
        for region_id, mapping in self.our_regions.items():
            allowed = bytearray(len(mapping))
            for _, granted_region, offset, capacity in granted:
                if granted_region == region_id and offset < len(mapping):
                    end = min(len(mapping), offset + min(capacity, len(mapping)))
                    allowed[offset:end] = b"\1" * (end - offset)
            changed = [i for i in range(len(mapping)) if not allowed[i] and mapping[i] != OUR_CANARY]
            if changed:
                problems.append(f"the victim wrote outside our grants in region {region_id} at {changed[:8]}")
            mapping.close()
        for region in self.reader.victim_regions.values():
            region.close()
        self.peer.close()
        return problems


def handshake_attack(backend, endpoint, key, fuzzer):
    """A connection that never completes a handshake: garbage, a mutated HELLO, a wrong or
    malformed PROOF, or another frame where the handshake's belongs. Returns (frames sent, the
    REJECT reason or None once the victim closed the connection)."""
    rand = fuzzer.random
    peer = w.RawPeer(backend, endpoint)
    peer.sock.settimeout(15)
    case = rand.randrange(4)
    sent = 1
    if case == 0:
        # At least a header's worth, so that the victim refuses it at once instead of waiting
        # for the rest of a frame until its handshake deadline.
        peer.send(bytes([rand.choice([0, w.WITHDRAWN + 1, 200, w.HELLO])]) + b"\xff" + os.urandom(rand.randrange(6, 80)))
    elif case == 3:
        kind = rand.choice([k for k in NAMES if k != w.HELLO] + [0, 99])
        peer.send(w.frame(kind, os.urandom(rand.choice([0, 8, 16, 40]))))
    else:
        version = rand.choice([w.PROTOCOL_VERSION, w.PROTOCOL_VERSION, 0, w.PROTOCOL_VERSION + 1, U32])
        body = w.greeting(version, rand.choice([backend, backend, "tcp", "shm", "verbs"]), os.urandom(32),
                          fuzzer.text()[:rand.choice([8, 512, 513, 700])], fuzzer.text()[:rand.choice([4, 600])])
        peer.send(w.frame(w.HELLO, fuzzer.maybe_cut(body)))
    reason = None
    try:
        while True:
            kind, body = peer.receive()
            if kind == w.REJECT:
                reason = body[6:].decode(errors="replace")
            elif kind == w.CHALLENGE:
                sent += 1
                wrong = rand.choice([
                    w.frame(w.PROOF, os.urandom(32)), w.frame(w.PROOF, os.urandom(rand.choice([0, 31, 33]))),
                    w.frame(w.HELLO, body), w.grant(1, 0, 1, 1, 0, 10), w.frame(w.PING), w.reject(3, b"no")])
                peer.send(wrong)
    except (EOFError, ConnectionResetError, BrokenPipeError):
        pass
    finally:
        peer.close()
    return sent, reason


def squat(backend):
    """A listening socket where a tf_rdma listener could be, and its endpoint: a tcp port, or for
    shm the abstract socket name that belongs to a port (any local process can bind one)."""
    if backend == "shm":
        listening = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        for port in random.sample(range(20000, 60000), 100):
            try:
                listening.bind(f"\0tf_rdma-shm-{port}")
                break
            except OSError:
                continue
        endpoint = f"127.0.0.1:{port}"
    else:
        listening = socket.socket()
        listening.bind(("127.0.0.1", 0))
        endpoint = f"127.0.0.1:{listening.getsockname()[1]}"
    listening.listen(8)
    listening.settimeout(15)  # a test's accept fails instead of waiting for a victim that never dials
    return listening, endpoint


@contextlib.contextmanager
def answering_each(backend, listening, answer):
    """A thread answering each client of `listening` (from squat) with `answer(peer)`, peer a
    wire_client.RawPeer, for as long as the context lasts; a client that hangs up or breaks off
    ends its answer, not the thread. On leaving, the socket is shut down (a close alone does not
    wake a pending accept), closed, and the thread joined."""
    def serve():
        while True:
            try:
                peer = w.RawPeer.accepted(backend, listening.accept()[0])
            except OSError:
                return  # closed: the test is over
            try:
                answer(peer)
            except (EOFError, OSError):
                pass
            finally:
                peer.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield
    finally:
        try:
            listening.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # not connected in the kernel's eyes: the close below ends the accept
        listening.close()
        thread.join(10)
        assert not thread.is_alive(), "the answering thread did not end"


class Squatter:
    """A listener that does not hold the key, at an address a victim dials (a squatted port; for
    shm, the abstract socket name of a port, which any local process can bind). For each client it
    dials `target` and relays handshake frames between the two, through `rewrite(kind, body)`
    (returns the body to pass on), then bytes as they come, so that the victim may end up proving
    the key to itself. `frames` records (direction, kind, body) of every frame it relayed."""

    def __init__(self, backend, target, rewrite=lambda kind, body: body):
        self.backend, self.target, self.rewrite = backend, target, rewrite
        self.frames = []
        self.listening, self.endpoint = squat(backend)
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def serve(self):
        try:
            victim, _ = self.listening.accept()
        except OSError:
            return
        victim.settimeout(10)  # as the target's: a relay ends when either side goes quiet
        target = w.RawPeer(self.backend, self.target).sock
        relays = [threading.Thread(target=self.relay, args=(victim, target, "to listener"), daemon=True),
                  threading.Thread(target=self.relay, args=(target, victim, "to dialler"), daemon=True)]
        for relay in relays:
            relay.start()
        for relay in relays:
            relay.join(30)
        victim.close()
        target.close()

    def relay(self, source, sink, direction):
        try:
            while True:
                header = b""
                while len(header) < 8:
                    chunk = source.recv(8 - len(header))
                    if not chunk:
                        return
                    header += chunk
                kind, _, length = struct.unpack("<B3sI", header)
                body = b""
                while len(body) < length:
                    chunk = source.recv(length - len(body))
                    if not chunk:
                        return
                    body += chunk
                self.frames.append((direction, kind, body))
                if kind in (w.HELLO, w.CHALLENGE, w.PROOF, w.ACCEPT):
                    body = self.rewrite(kind, body)
                sink.sendall(w.frame(kind, body))
        except OSError:
            return
        finally:
            try:
                sink.shutdown(socket.SHUT_WR)
            except OSError:
                pass

    def close(self):
        self.listening.close()
        self.thread.join(10)


def renamed(name):
    """A rewrite for Squatter: HELLO and CHALLENGE pass on claiming `name`, the rest as it is."""
    def rewrite(kind, body):
        if kind not in (w.HELLO, w.CHALLENGE):
            return body
        version, backend, nonce, _, build = w.parse_greeting(body)
        return struct.pack("<IB", version, backend) + nonce + w.string(name) + w.string(build)
    return rewrite

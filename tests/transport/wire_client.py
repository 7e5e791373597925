"""The tf_rdma stream wire format written independently in Python, to speak to a listener the way a
broken or hostile peer would. Mirrors cc/transport/wire.h."""
import hashlib
import hmac
import os
import socket
import struct

(HELLO, CHALLENGE, PROOF, ACCEPT, REJECT, GRANT, DATA, TOO_SMALL, REVOKE, REVOKED, PING, SHM_REGION, DISCARD,
 SHM_REGION_GONE, WITHDRAWN) = range(1, 16)
BACKEND_IDS = {"tcp": 0, "shm": 1, "verbs": 2}
PROTOCOL_VERSION = 8


def frame(kind, body=b"", reserved=b"\0\0\0", length=None):
    return struct.pack("<B3sI", kind, reserved, len(body) if length is None else length) + body


def string(text):
    """A u16-length-prefixed string; bytes go as they are (peers may send anything)."""
    data = text if isinstance(text, bytes) else text.encode()
    return struct.pack("<H", len(data)) + data


def greeting(version, backend, nonce, name, build="test"):
    return struct.pack("<IB", version, BACKEND_IDS[backend]) + nonce + string(name) + string(build)


def grant(grant_id, tag_hi, tag_lo, region_id, offset, capacity):
    return frame(GRANT, struct.pack("<QQQIQQ", grant_id, tag_hi, tag_lo, region_id, offset, capacity))


def data(grant_id, length):
    return frame(DATA, struct.pack("<QQ", grant_id, length))


def too_small(grant_id, needed):
    return frame(TOO_SMALL, struct.pack("<QQ", grant_id, needed))


def revoked(grant_id):
    return frame(REVOKED, struct.pack("<Q", grant_id))


def withdrawn(grant_id, code, reason):
    """WITHDRAWN {u64 grant id, u32 status code, u16-prefixed reason}: the sender withdrew the message."""
    return frame(WITHDRAWN, struct.pack("<QI", grant_id, code) + string(reason))


def reject(code, message):
    return frame(REJECT, struct.pack("<I", code) + string(message))


def field(data):
    """A u32-length-prefixed field of the handshake's token transcript."""
    data = data if isinstance(data, bytes) else data.encode()
    return struct.pack("<I", len(data)) + data


def token(key, direction, backend, initiator, responder, initiator_nonce, responder_nonce,
          version=PROTOCOL_VERSION):
    """The handshake's PROOF (direction "initiator->responder") or ACCEPT ("responder->initiator")
    body: HMAC-SHA-256 over the direction, version, backend, both names and both nonces."""
    transcript = (field("tf_rdma handshake") + field(direction) + field(str(version)) + field(backend)
                  + field(initiator) + field(responder) + initiator_nonce + responder_nonce)
    return hmac.new(key, transcript, hashlib.sha256).digest()


def parse_greeting(body):
    """(version, backend id, nonce, name, build) of a HELLO or CHALLENGE body."""
    version, backend = struct.unpack("<IB", body[:5])
    nonce = body[5:37]
    name_length = struct.unpack("<H", body[37:39])[0]
    name = body[39:39 + name_length]
    build_length = struct.unpack("<H", body[39 + name_length:41 + name_length])[0]
    build = body[41 + name_length:41 + name_length + build_length]
    return version, backend, nonce, name, build


class RawPeer:
    """A socket to a tf_rdma listener, handshaken by hand."""

    def __init__(self, backend, endpoint):
        host, port = endpoint.rsplit(":", 1)
        if backend == "shm":
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.connect(f"\0tf_rdma-shm-{port}")
        else:
            self.sock = socket.create_connection((host, int(port)))
        self.sock.settimeout(10)
        self.backend = backend

    @classmethod
    def accepted(cls, backend, sock):
        """The peer on the far end of `sock`, a connection accepted where a listener would be."""
        peer = cls.__new__(cls)
        peer.sock, peer.backend = sock, backend
        peer.sock.settimeout(10)
        return peer

    def handshake(self, key, name="raw-peer", version=PROTOCOL_VERSION):
        nonce = os.urandom(32)
        self.send(frame(HELLO, greeting(version, self.backend, nonce, name)))
        kind, body = self.receive()
        assert kind == CHALLENGE, (kind, body)
        _, _, server_nonce, server_name, _ = parse_greeting(body)
        # The initiator proves first; the listener's token comes with its ACCEPT.
        self.send(frame(PROOF, token(key, "initiator->responder", self.backend, name, server_name,
                                     nonce, server_nonce)))
        kind, body = self.receive()
        assert kind == ACCEPT, (kind, body)
        assert body == token(key, "responder->initiator", self.backend, name, server_name, nonce, server_nonce)

    def answer_handshake(self, key, name):
        """The listener's side of the handshake, as task `name`: a CHALLENGE, then the initiator's
        PROOF checked and answered with ACCEPT and its token. The initiator's name."""
        kind, body = self.receive()
        assert kind == HELLO, (kind, body)
        version, _, initiator_nonce, initiator, _ = parse_greeting(body)
        nonce = os.urandom(32)
        self.send(frame(CHALLENGE, greeting(version, self.backend, nonce, name)))
        kind, body = self.receive()
        assert kind == PROOF, (kind, body)
        assert body == token(key, "initiator->responder", self.backend, initiator, name, initiator_nonce, nonce)
        self.send(frame(ACCEPT, token(key, "responder->initiator", self.backend, initiator, name, initiator_nonce, nonce)))
        return initiator

    def send(self, data):
        self.sock.sendall(data)

    def receive_exact(self, n):
        out = b""
        while len(out) < n:
            chunk = self.sock.recv(n - len(out))
            if not chunk:
                raise EOFError(f"closed after {len(out)} of {n} bytes")
            out += chunk
        return out

    def receive(self):
        kind, _, length = struct.unpack("<B3sI", self.receive_exact(8))
        return kind, self.receive_exact(length)

    def receive_with_fds(self):
        """A frame and the descriptors that rode along with it (shm's SHM_REGION)."""
        header, fds, _, _ = socket.recv_fds(self.sock, 8, 4)
        header += self.receive_exact(8 - len(header))
        kind, _, length = struct.unpack("<B3sI", header)
        return kind, self.receive_exact(length), fds

    def receive_until_closed(self):
        """Every frame until the listener closes the socket; the REJECT reason if one came."""
        reason = None
        try:
            while True:
                kind, body = self.receive()
                if kind == REJECT:
                    reason = body[6:].decode()
        except (EOFError, ConnectionResetError):
            return reason

    def share_region(self, region_id, size, seal=True, declared_size=None):
        """Sends SHM_REGION with a memfd of `size` bytes, as a shm receiver does."""
        fd = os.memfd_create("raw-peer-region", os.MFD_ALLOW_SEALING)
        os.ftruncate(fd, size)
        if seal:
            import fcntl
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
        body = struct.pack("<IQ", region_id, size if declared_size is None else declared_size)
        socket.send_fds(self.sock, [frame(SHM_REGION, body)], [fd])
        os.close(fd)
        return fd

    def region_gone(self, region_id):
        """Sends SHM_REGION_GONE, as a shm receiver does once nothing holds the region."""
        self.send(frame(SHM_REGION_GONE, struct.pack("<I", region_id)))

    def close(self):
        self.sock.close()

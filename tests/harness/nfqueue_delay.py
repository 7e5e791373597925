"""Delays every packet of a netfilter queue: `python nfqueue_delay.py QUEUE DELAY_MS JITTER_MS SEED
MAXLEN`, run in the namespace whose iptables rule sends packets to queue QUEUE (tests/harness/netns.py's
delay()). Each packet is accepted DELAY_MS ± JITTER_MS after it was read, the delay drawn uniformly
from [DELAY_MS - JITTER_MS, DELAY_MS + JITTER_MS] by a random.Random(SEED) (netem's jitter without a
distribution table is uniform too), so packets whose delays cross are reordered, as netem's are.

Speaks the NFQUEUE netlink protocol (linux/netfilter/nfnetlink_queue.h) over an AF_NETLINK /
NETLINK_NETFILTER socket: binds the queue, asks for metadata only (NFQNL_COPY_META: no payload is
copied to this process), whole GSO packets (NFQA_CFG_F_GSO: a 64 KiB veth packet is not cut into
MTU-sized ones) and a kernel queue of MAXLEN packets, beyond which the kernel drops what arrives
(as netem drops beyond its limit). The packets this process holds are those in the kernel's queue,
so its memory is bounded by MAXLEN entries.

Says "bound" on stdout once the queue is its own. On SIGTERM it reads no more but keeps releasing
what it holds, each at its time, then exits 0 (the caller removed the rule first, so nothing new
comes): lifting a delay loses no packet. A verdict the kernel answers ENOENT was for a packet it
dropped from the queue meanwhile, which it does to every queued packet when a netfilter hook of the
namespace is unregistered (an nftables base chain deleted, or its device) and to those bound to a
device that goes down: that packet is lost, as a link loses one, and the delayer goes on. Any other
netlink error ends it with status 1 and the error on stderr."""
import errno
import heapq
import os
import random
import select
import signal
import socket
import struct
import sys
import time

NETLINK_NETFILTER = 12
NFNL_SUBSYS_QUEUE = 3
NFQNL_MSG_PACKET, NFQNL_MSG_VERDICT, NFQNL_MSG_CONFIG = 0, 1, 2
NFQA_PACKET_HDR, NFQA_VERDICT_HDR = 1, 2
NFQA_CFG_CMD, NFQA_CFG_PARAMS, NFQA_CFG_QUEUE_MAXLEN, NFQA_CFG_MASK, NFQA_CFG_FLAGS = 1, 2, 3, 4, 5
NFQNL_CFG_CMD_BIND = 1
NFQNL_COPY_META = 1
NFQA_CFG_F_GSO = 4
NF_ACCEPT = 1
NLM_F_REQUEST, NLM_F_ACK = 1, 4
NLMSG_ERROR = 2
SO_RCVBUFFORCE = 33  # not in Python's socket module
NLMSG = struct.Struct("=IHHII")       # length, type, flags, sequence, port id (host order)
NFGEN = struct.Struct("!BBH")         # family, version, resource id = the queue (big-endian)
NLATTR = struct.Struct("=HH")         # length, type
# A packet message: NFQA_PACKET_HDR's packet id; the attributes after it are not needed.
PACKET_ID = struct.Struct("!I")
# Verdicts (32 bytes each) per datagram: well inside a netlink socket's default send buffer.
VERDICTS_PER_SEND = 256


def _attribute(kind, payload):
    padding = b"\0" * (-len(payload) % 4)
    return NLATTR.pack(NLATTR.size + len(payload), kind) + payload + padding


def _message(kind, queue, attributes, flags=NLM_F_REQUEST, sequence=0):
    body = NFGEN.pack(socket.AF_UNSPEC, 0, queue) + b"".join(attributes)
    return NLMSG.pack(NLMSG.size + len(body), (NFNL_SUBSYS_QUEUE << 8) | kind, flags, sequence, 0) + body


def _messages(data):
    """(type, payload after the nlmsghdr) of each netlink message in one datagram."""
    offset = 0
    while offset + NLMSG.size <= len(data):
        length, kind, _, _, _ = NLMSG.unpack_from(data, offset)
        if length < NLMSG.size:
            raise RuntimeError(f"malformed netlink message (length {length})")
        yield kind, data[offset + NLMSG.size:offset + length]
        offset += (length + 3) & ~3


def _attributes(payload):
    offset = NFGEN.size
    while offset + NLATTR.size <= len(payload):
        length, kind = NLATTR.unpack_from(payload, offset)
        if length < NLATTR.size:
            raise RuntimeError(f"malformed netlink attribute (length {length})")
        yield kind & 0x3FFF, payload[offset + NLATTR.size:offset + length]
        offset += (length + 3) & ~3


def _check_error(payload, doing):
    """An NLMSG_ERROR's payload: a negative errno (0 is an ACK) and the request it answers."""
    error = struct.unpack_from("=i", payload)[0]
    if error:
        raise OSError(-error, f"{doing}: {os.strerror(-error)}")


def _configure(sock, queue, maxlen):
    """Binds the queue and sets it up, each request acknowledged (an error names the step)."""
    steps = [("bind the queue (is another process bound to it?)",
              [_attribute(NFQA_CFG_CMD, struct.pack("!BxH", NFQNL_CFG_CMD_BIND, socket.AF_UNSPEC))]),
             ("set metadata-only copy", [_attribute(NFQA_CFG_PARAMS, struct.pack("!IB", 0, NFQNL_COPY_META))]),
             (f"set the queue length to {maxlen}", [_attribute(NFQA_CFG_QUEUE_MAXLEN, struct.pack("!I", maxlen))]),
             ("accept GSO packets whole", [_attribute(NFQA_CFG_FLAGS, struct.pack("!I", NFQA_CFG_F_GSO)),
                                           _attribute(NFQA_CFG_MASK, struct.pack("!I", NFQA_CFG_F_GSO))])]
    for sequence, (doing, attributes) in enumerate(steps, 1):
        sock.send(_message(NFQNL_MSG_CONFIG, queue, attributes, NLM_F_REQUEST | NLM_F_ACK, sequence))
        while True:  # the ACK (packets cannot come yet: no rule sends any here before "bound")
            kinds = list(_messages(sock.recv(65536)))
            errors = [payload for kind, payload in kinds if kind == NLMSG_ERROR]
            if errors:
                _check_error(errors[0], doing)
                break


def run(queue, delay_ms, jitter_ms, seed, maxlen):
    draw = random.Random(seed)
    low, high = (delay_ms - jitter_ms) / 1000, (delay_ms + jitter_ms) / 1000
    stopping = False

    def stop(*_):
        nonlocal stopping
        stopping = True
    signal.signal(signal.SIGTERM, stop)

    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
    # Room for MAXLEN packet messages (a few hundred bytes each with metadata only) in case this
    # process is descheduled; a message the socket cannot take is a packet the kernel drops.
    sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, max(1 << 20, maxlen * 1024))
    sock.bind((0, 0))
    _configure(sock, queue, maxlen)
    sock.setblocking(False)
    print("bound", flush=True)

    held = []                    # (release time, arrival number, packet id)
    arrivals = 0
    while not stopping or held:
        now = time.monotonic()
        verdicts = []
        while held and held[0][0] <= now:
            _, _, packet = heapq.heappop(held)
            verdicts.append(_message(NFQNL_MSG_VERDICT, queue,
                                     [_attribute(NFQA_VERDICT_HDR, struct.pack("!II", NF_ACCEPT, packet))]))
        # A few sends, not one per packet: the kernel processes every message of a datagram in turn,
        # but a datagram must fit the socket's send buffer, and after a stall thousands fall due.
        for first in range(0, len(verdicts), VERDICTS_PER_SEND):
            sock.send(b"".join(verdicts[first:first + VERDICTS_PER_SEND]))
        timeout = max(0.0, held[0][0] - time.monotonic()) if held else 0.1
        if stopping:
            time.sleep(timeout)
            continue
        readable, _, _ = select.select([sock], [], [], timeout)  # SIGTERM ends it early (PEP 475 aside)
        while readable:
            try:
                data = sock.recv(65536)
            except BlockingIOError:
                break
            arrived = time.monotonic()
            for kind, payload in _messages(data):
                if kind == NLMSG_ERROR and struct.unpack_from("=i", payload)[0] != -errno.ENOENT:
                    _check_error(payload, "a verdict")
                elif kind == (NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_PACKET:
                    for attribute, value in _attributes(payload):
                        if attribute == NFQA_PACKET_HDR:
                            arrivals += 1
                            heapq.heappush(held, (arrived + draw.uniform(low, high), arrivals,
                                                  PACKET_ID.unpack_from(value)[0]))
    return 0


if __name__ == "__main__":
    queue, delay_ms, jitter_ms, seed, maxlen = sys.argv[1:6]
    try:
        sys.exit(run(int(queue), float(delay_ms), float(jitter_ms), int(seed), int(maxlen)))
    except OSError as e:
        print(f"nfqueue_delay (queue {queue}): {e}", file=sys.stderr)
        sys.exit(1)

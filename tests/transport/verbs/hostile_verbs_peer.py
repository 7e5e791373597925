"""A verbs peer written from the wire format with pyverbs (Debian's python3-pyverbs, so it runs
under /usr/bin/python3, not the project's interpreter), to do what tf_rdma's own client never
does: RDMA-write with keys and addresses the listener announced on another connection.

usage: python -m tests.transport.verbs.hostile_verbs_peer HOST PORT KEY_HEX CONNECTIONS
Connects CONNECTIONS times (peer names intruder-0, intruder-1, ...), handshakes each, and prints
{"connected": CONNECTIONS}. Then answers one JSON command per stdin line with one JSON line:
  {"learn": i}     wait until connection i announced a region and its grant table; report them
  {"write": i, "rkey": K, "address": A, "fill": B, "length": N}
                   RDMA-write N bytes of B on connection i; report the completion's status
  {"fuzz": SEED, "max": N}
                   a new connection (peer name "fuzzer") that learns the region and grant table
                   the listener announces, then sends up to N seeded fuzzed messages (SENDs of
                   mangled frames, writes with and without immediates into the grant table and
                   the region, writes with keys of connections fuzzed before) until one fails
                   here, and disconnects; reports what it sent, each with whether it completed
"""
import json
import os
import random
import socket
import struct
import sys
import time

import pyverbs.cm_enums as cm_enums
import pyverbs.enums as enums
from pyverbs.cmid import CMID, AddrInfo, ConnParam
from pyverbs.cq import CQ
from pyverbs.mr import MR
from pyverbs.pd import PD
from pyverbs.qp import QP, QPCap, QPInitAttr
from pyverbs.wr import SGE, RecvWR, SendWR

from tests.transport import wire_client

REGION_MESSAGE, GRANT_TABLE_MESSAGE = 0x40, 0x41
MESSAGE_BYTES = 4160  # the largest control message a tf_rdma peer sends
# Posted and never reposted while fuzzing: far more than the listener sends a connection (its
# REGION, GRANT_TABLE, a REJECT, a heartbeat a second), so it never waits for a receive buffer.
RECEIVES = 64
GRANT_SLOT_BYTES = 64
GRANT_IMM_BIT = 1 << 31
U32, U64 = 2**32 - 1, 2**64 - 1
FRAME_KINDS = list(range(1, 14)) + [wire_client.WITHDRAWN, REGION_MESSAGE, GRANT_TABLE_MESSAGE]


class VerbsPeer:
    """One RC queue pair connected through rdma_cm. The queue pair is our own, not rdma_cm's, so
    any work request can be posted on it (pyverbs' CMID calls have no WRITE_WITH_IMM)."""

    def __init__(self, host, port, key, name, timeout=20.0):
        self.timeout = timeout
        self.cmid = CMID(creator=AddrInfo(dst=host, dst_service=str(port), port_space=cm_enums.RDMA_PS_TCP))
        self.pd = PD(self.cmid.context)
        self.cq = CQ(self.cmid.context, 2 * RECEIVES)
        self.qp = QP(self.pd, QPInitAttr(qp_type=enums.IBV_QPT_RC, scq=self.cq, rcq=self.cq,
                                         cap=QPCap(max_send_wr=8, max_recv_wr=RECEIVES)))
        self.transition(enums.IBV_QPS_INIT)
        self.receive_buffers = [MR(self.pd, MESSAGE_BYTES, enums.IBV_ACCESS_LOCAL_WRITE) for _ in range(RECEIVES)]
        for slot in range(RECEIVES):
            self.post_receive(slot)
        self.received = []  # (slot, length) of receives completed, oldest first
        self.next_send = 1 << 32
        self.cmid.connect(ConnParam(qp_num=self.qp.qp_num))
        self.transition(enums.IBV_QPS_RTR)
        # A listener that refused us stops its queue pair: our next request then fails after one
        # retry of 67 ms instead of rdma_cm's default of seconds.
        self.transition(enums.IBV_QPS_RTS, timeout=14, retry_cnt=1)
        self.cmid.establish()
        self.region = None
        self.grant_table = None
        self.handshake(key, name)

    def transition(self, state, **overrides):
        attr, mask = self.cmid.init_qp_attr(state)
        for name, value in overrides.items():
            setattr(attr, name, value)
        self.qp.modify(attr, mask)

    def rejected(self):
        """Whether the listener sent a REJECT (it refused something of ours), without waiting."""
        while True:
            count, completions = self.cq.poll(num_entries=1)
            if not count:
                break
            completion = completions[0]
            if completion.wr_id < 1 << 32 and completion.status == enums.IBV_WC_SUCCESS:
                self.received.append((completion.wr_id, completion.byte_len))
        return any(self.receive_buffers[slot].read(1, 0)[0] == wire_client.REJECT for slot, _ in self.received)

    def post_receive(self, slot):
        buffer = self.receive_buffers[slot]
        self.qp.post_recv(RecvWR(wr_id=slot, num_sge=1, sg=[SGE(buffer.buf, MESSAGE_BYTES, buffer.lkey)]))

    def poll(self, want_send):
        """The next send completion's status, or the next message received (its receive buffer
        reposted); completions of the other kind met on the way are kept or dropped."""
        deadline = time.monotonic() + self.timeout
        while True:
            if not want_send and self.received:
                slot, length = self.received.pop(0)
                message = self.receive_buffers[slot].read(length, 0)
                self.post_receive(slot)
                return message
            count, completions = self.cq.poll(num_entries=1)
            if count:
                completion = completions[0]
                if completion.wr_id >= 1 << 32:
                    if want_send:
                        return completion.status
                elif completion.status == enums.IBV_WC_SUCCESS:
                    self.received.append((completion.wr_id, completion.byte_len))
                continue
            if time.monotonic() > deadline:
                raise TimeoutError("no completion within the timeout")
            time.sleep(0.0005)

    def post(self, opcode, data, rkey=0, address=0, imm=None):
        """Posts one signaled work request carrying `data`; True when it completed successfully."""
        buffer = MR(self.pd, max(len(data), 1), enums.IBV_ACCESS_LOCAL_WRITE)
        if data:
            buffer.write(data, len(data))
        # An empty message is one empty scatter element (pyverbs wants at least one).
        work = SendWR(wr_id=self.next_send, opcode=opcode, num_sge=1, sg=[SGE(buffer.buf, len(data), buffer.lkey)],
                      send_flags=enums.IBV_SEND_SIGNALED)
        self.next_send += 1
        if opcode != enums.IBV_WR_SEND:
            work.set_wr_rdma(rkey, address)
        if imm is not None:
            work.imm_data = socket.htonl(imm)
        self.qp.post_send(work)
        return self.poll(want_send=True) == enums.IBV_WC_SUCCESS

    def send(self, message):
        return self.post(enums.IBV_WR_SEND, message)

    def receive_frame(self):
        message = self.poll(want_send=False)
        return message[0], message[8:]

    def handshake(self, key, name):
        nonce = os.urandom(32)
        self.send(wire_client.frame(wire_client.HELLO, wire_client.greeting(
            wire_client.PROTOCOL_VERSION, "verbs", nonce, name)))
        kind, body = self.receive_frame()
        assert kind == wire_client.CHALLENGE, (kind, body)
        _, _, server_nonce, server_name, _ = wire_client.parse_greeting(body)
        self.send(wire_client.frame(wire_client.PROOF, wire_client.token(
            key, "initiator->responder", "verbs", name, server_name, nonce, server_nonce)))
        kind, body = self.receive_frame()
        assert kind == wire_client.ACCEPT, (kind, body)

    def learn(self):
        """The first region the listener announced here and its grant table (PINGs skipped)."""
        while self.region is None or self.grant_table is None:
            kind, body = self.receive_frame()
            if kind == REGION_MESSAGE:
                region_id, rkey, address, size = struct.unpack("<IIQQ", body)
                self.region = {"region_id": region_id, "rkey": rkey, "address": address, "size": size}
            elif kind == GRANT_TABLE_MESSAGE:
                slots, rkey, address = struct.unpack("<IIQ", body)
                self.grant_table = {"slots": slots, "rkey": rkey, "address": address}
        return {"region": self.region, "grant_table": self.grant_table}

    def write(self, rkey, address, fill, length):
        ok = self.write_bytes(rkey, address, bytes([fill]) * length)
        return {"ok": ok}

    def write_bytes(self, rkey, address, data, imm=None):
        opcode = enums.IBV_WR_RDMA_WRITE if imm is None else enums.IBV_WR_RDMA_WRITE_WITH_IMM
        return self.post(opcode, data, rkey, address, imm)

    def close(self):
        # A DREQ tells the listener at once; without it, it would wait out its peer timeout.
        try:
            self.cmid.disconnect()
        except Exception:  # noqa: BLE001 - a connection the listener already dropped
            pass
        self.cmid.close()
        self.qp.close()


class Fuzzer:
    """Seeded generator of what a hostile verbs peer can put on its queue pair after a valid
    handshake. Every message is something the listener must survive: it may refuse it (closing
    the connection with a ProtocolError) or take it as harmless; it must never write outside the
    memory granted to this connection or crash."""

    def __init__(self, seed):
        self.random = random.Random(seed)

    def pick(self, *choices):
        return self.random.choice(choices)

    def u64(self):
        return self.pick(0, 1, U64, 2**63, 2**32, self.random.getrandbits(64), self.random.randrange(1 << 16))

    def u32(self):
        return self.pick(0, 1, U32, 2**31, self.random.getrandbits(32), self.random.randrange(64))

    def frame(self):
        kind = self.pick(*FRAME_KINDS, self.random.randrange(256))
        if kind == wire_client.GRANT:
            body = struct.pack("<QQQIQQ", self.u64(), self.u64(), self.u64(), self.u32(), self.u64(), self.u64())
        elif kind == REGION_MESSAGE:
            body = struct.pack("<IIQQ", self.u32(), self.u32(), self.u64(), self.u64())
        elif kind == GRANT_TABLE_MESSAGE:
            body = struct.pack("<IIQ", self.u32(), self.u32(), self.u64())
        elif kind in (wire_client.DATA, wire_client.TOO_SMALL):
            body = struct.pack("<QQ", self.u64(), self.u64())
        elif kind in (wire_client.REVOKE, wire_client.REVOKED):
            body = struct.pack("<Q", self.u64())
        elif kind == wire_client.WITHDRAWN:
            body = struct.pack("<QI", self.u64(), self.pick(10, 0, 17, self.u32())) + wire_client.string(
                os.urandom(self.pick(0, 256, 257)))
        else:
            body = os.urandom(self.pick(0, 8, 16, 37, 100, 4000, 4152, 4153, 5000))
        if self.random.random() < 0.1 and body:
            body = body[:self.random.randrange(len(body))]
        reserved = b"\0\0\0" if self.random.random() < 0.9 else os.urandom(3)
        length = len(body) if self.random.random() < 0.85 else self.u32()
        return wire_client.frame(kind, body, reserved=reserved, length=length)

    def message(self, learned, stale):
        """(kind, action) where action(peer) sends it and returns whether it completed."""
        region, table = learned["region"], learned["grant_table"]
        roll = self.random.random()
        if roll < 0.45:
            # Plain writes anywhere in the region, in bounds or across its end: the hardware
            # takes or refuses them; no message tells the listener, and it must not care.
            offset = self.random.randrange(region["size"])
            length = self.pick(0, 1, 64, 4096, self.random.randrange(region["size"] - offset + 1),
                               region["size"] - offset) + (self.random.random() < 0.03)
            data = os.urandom(length)
            return "region write", lambda peer: peer.write_bytes(region["rkey"], region["address"] + offset, data)
        if roll < 0.55:
            ping = wire_client.frame(wire_client.PING)
            return "send 0x0b", lambda peer: peer.send(ping)
        if roll < 0.75:
            data = self.frame()
            return f"send 0x{data[0]:02x}", lambda peer: peer.send(data)
        if roll < 0.83:
            slot = self.pick(self.random.randrange(table["slots"]), 0, table["slots"] - 1, table["slots"],
                             self.random.randrange(table["slots"] + 64))
            if self.random.random() < 0.6:
                record = wire_client.grant(self.u64(), self.u64(), self.u64(),
                                           self.pick(region["region_id"], self.u32()), self.u64(), self.u64())
            else:
                record = self.frame()[:self.pick(GRANT_SLOT_BYTES, 8, 200)]
            imm = self.pick(GRANT_IMM_BIT | slot, GRANT_IMM_BIT | self.random.randrange(1 << 20), self.u32())
            address = table["address"] + slot * GRANT_SLOT_BYTES
            return "grant-table write", lambda peer: peer.write_bytes(table["rkey"], address, record, imm)
        if roll < 0.95:
            offset = self.pick(0, self.random.randrange(region["size"]), region["size"] - 1)
            length = self.pick(0, 1, 64, self.random.randrange(4096), region["size"] - offset,
                               region["size"] - offset + 1)
            imm = self.pick(1, 2, 3, self.random.randrange(64), self.u32() & ~GRANT_IMM_BIT)
            data = os.urandom(length)
            return "region write+imm", lambda peer: peer.write_bytes(region["rkey"], region["address"] + offset,
                                                                     data, imm)
        if stale:
            rkey, address = self.pick(*stale)
            return "stale-key write", lambda peer: peer.write_bytes(rkey, address, b"\x5a" * 64)
        rkey, address = self.u32(), self.u64()
        return "unknown-key write", lambda peer: peer.write_bytes(rkey, address, b"\x5a" * 8)


def fuzz(host, port, key, seed, most, stale):
    """One fuzzed connection; `stale` collects the keys of the connections fuzzed before it."""
    fuzzer = Fuzzer(seed)
    peer = VerbsPeer(host, port, key, "fuzzer")
    learned = peer.learn()
    sent, completed = [], True
    while completed and len(sent) < most and not peer.rejected():
        kind, action = fuzzer.message(learned, stale)
        completed = action(peer)
        sent.append([kind, completed])
    peer.close()
    stale.append((learned["region"]["rkey"], learned["region"]["address"]))
    stale.append((learned["grant_table"]["rkey"], learned["grant_table"]["address"]))
    return {"sent": sent}


def main():
    host, port, key_hex, connections = sys.argv[1:]
    key = bytes.fromhex(key_hex)
    peers = [VerbsPeer(host, int(port), key, f"intruder-{i}") for i in range(int(connections))]
    print(json.dumps({"connected": len(peers)}), flush=True)
    stale = []
    for line in sys.stdin:
        command = json.loads(line)
        if "learn" in command:
            answer = peers[command["learn"]].learn()
        elif "fuzz" in command:
            answer = fuzz(host, int(port), key, command["fuzz"], command["max"], stale)
        else:
            answer = peers[command["write"]].write(command["rkey"], command["address"], command["fill"],
                                                   command["length"])
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()

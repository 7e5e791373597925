"""A hostile verbs peer's control messages (cc/transport/verbs/verbs_messages.h), fuzzed through the
decoder every SEND and every grant record written into our grant table goes through. Seeded and
bounded like the stream backends' adversarial suite; it needs the verbs sources built, not a device.
A live hostile verbs peer (raw rdma_cm/ibverbs) is not part of it."""
import os
import random
import struct

import pytest

from tests.transport import wire_client as w
from tf_rdma import errors
from tf_rdma._transport import _testing

pytestmark = pytest.mark.skipif(not hasattr(_testing, "decode_verbs_message"),
                                reason="built without rdma-core's headers, so without the verbs backend")

REGION, GRANT_TABLE = 0x40, 0x41
SEED = int(os.environ.get("FUZZ_SEED", "9"))
MESSAGES = 3000


def valid_messages(rand):
    """(encoded, kind) as the spec lays them out: REGION {u32 region, u32 rkey, u64 address,
    u64 size}, GRANT_TABLE {u32 slots, u32 rkey, u64 address}, or any stream frame."""
    u64 = rand.getrandbits(64)
    return rand.choice([
        (struct.pack("<B3sI", REGION, b"\0" * 3, 24) + struct.pack("<IIQQ", rand.getrandbits(32),
                                                                   rand.getrandbits(32), u64, u64), "REGION"),
        (struct.pack("<B3sI", GRANT_TABLE, b"\0" * 3, 16) + struct.pack("<IIQ", rand.getrandbits(32),
                                                                        rand.getrandbits(32), u64), "GRANT_TABLE"),
        (w.grant(u64, 0, 1, rand.getrandbits(32), u64, u64), "GRANT"),
        (w.data(u64, u64), "DATA"),
        (w.frame(w.PING), "PING"),
        (w.withdrawn(u64, rand.randrange(1, 17), os.urandom(rand.randrange(257))), "WITHDRAWN"),
    ])


def mutate(rand, encoded):
    mutated = bytearray(encoded)
    choice = rand.randrange(4)
    if choice == 0:
        mutated[rand.randrange(len(mutated))] ^= rand.randrange(1, 256)
    elif choice == 1:
        del mutated[rand.randrange(len(mutated)):]
    elif choice == 2:
        mutated += os.urandom(rand.randrange(1, 16))
    else:
        mutated[4:8] = struct.pack("<I", rand.choice([0, 23, 25, 4097, 2**32 - 1]))
    return bytes(mutated)


def test_every_fuzzed_verbs_message_decodes_or_is_refused_as_a_protocol_error():
    rand = random.Random(SEED)
    refused = 0
    for number in range(MESSAGES):
        encoded, kind = valid_messages(rand)
        assert _testing.decode_verbs_message(encoded) == kind, (number, encoded.hex())
        mutated = mutate(rand, encoded)
        try:
            _testing.decode_verbs_message(mutated)
        except errors.ProtocolError:
            refused += 1
    # A flipped bit inside a field's value still decodes; most mutations must not.
    assert refused > MESSAGES // 2, f"seed {SEED}: only {refused} of {MESSAGES} mutations refused"


def test_a_withdrawn_message_is_refused_past_its_bounds():
    """WITHDRAWN {u64 grant id, u32 status code, u16-prefixed reason}: the code must be an error's
    (1..16) and the reason at most 256 bytes."""
    assert _testing.decode_verbs_message(w.withdrawn(1, 16, b"r" * 256)) == "WITHDRAWN"
    for code in (0, 17, 2**32 - 1):
        with pytest.raises(errors.ProtocolError, match=f"status code {code} is not an error code"):
            _testing.decode_verbs_message(w.withdrawn(1, code, b"why"))
    with pytest.raises(errors.ProtocolError, match="string of 257 bytes exceeds the limit of 256"):
        _testing.decode_verbs_message(w.withdrawn(1, 10, b"r" * 257))
    with pytest.raises(errors.ProtocolError, match="malformed WITHDRAWN frame: truncated"):
        _testing.decode_verbs_message(w.frame(w.WITHDRAWN, struct.pack("<QI", 1, 10)[:10]))


def test_a_grant_table_slot_holds_exactly_one_grant():
    rand = random.Random(SEED)
    for number in range(MESSAGES):
        grant_id, region_id, offset, capacity = (rand.getrandbits(63), rand.getrandbits(32),
                                                 rand.getrandbits(64), rand.getrandbits(64))
        record = w.grant(grant_id, 0, 1, region_id, offset, capacity)
        assert _testing.decode_verbs_grant_record(record) == (grant_id, region_id, offset, capacity)
        mutated = mutate(rand, record)
        other = rand.choice([w.data(1, 2), w.frame(w.PING), mutated])
        try:
            _testing.decode_verbs_grant_record(other)
        except errors.ProtocolError:
            pass
        else:
            # Only a GRANT whose fields a mutation changed may still read as one.
            assert other == mutated, f"seed {SEED}, record {number}: {other.hex()} taken as a grant"

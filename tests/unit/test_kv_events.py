"""KV-event codec: payload bytes built from the documented wire format, both encodings,
unknown fields, malformed payloads; vLLM and SGLang hash formulas."""

from __future__ import annotations

import hashlib
import pickle
import struct

import msgpack
import pytest

from backends.kv_events import (
    END_SEQ,
    NONE_HASH,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEventDecodeError,
    UnknownEvent,
    decode_message,
    decode_payload,
    decode_seq,
    encode_message,
    encode_payload,
    encode_seq,
    normalize_hash,
    sglang_block_hashes,
    vllm_block_digests,
    vllm_block_hashes,
    vllm_extra_keys,
)

# The batch captured from vLLM 0.32 (ENGINES.md), rebuilt byte for byte with msgpack.
CAPTURED_MAP = msgpack.packb([
    1764400000.25,
    [
        {"type": "BlockStored", "block_hashes": [7001372877482414859, 12345678901234567890],
         "parent_block_hash": None, "token_ids": list(range(256)), "block_size": 128,
         "lora_id": None, "medium": "GPU", "lora_name": None, "extra_keys": [None, None],
         "group_idx": 0, "kv_cache_spec_kind": "full_attention"},
        {"type": "BlockRemoved", "block_hashes": [7001372877482414859], "medium": "GPU",
         "group_idx": 0},
        {"type": "AllBlocksCleared"},
    ],
    0,
])

# Older vLLM / SGLang: positional arrays, type name first.
CAPTURED_ARRAY = msgpack.packb([
    1764400000.5,
    [
        ["BlockStored", [-3, 4], 99, list(range(32)), 16, None, "GPU"],
        ["BlockRemoved", [-3], "GPU"],
        ["AllBlocksCleared"],
    ],
    None,
])


def test_decode_map_encoding():
    b = decode_payload(CAPTURED_MAP)
    assert b.ts == 1764400000.25 and b.data_parallel_rank == 0
    st, rm, cl = b.events
    assert isinstance(st, BlockStored)
    assert st.block_hashes == (7001372877482414859, 12345678901234567890)
    assert st.parent_block_hash is None and st.token_ids == tuple(range(256))
    assert st.block_size == 128 and st.medium == "GPU" and st.extra_keys == (None, None)
    assert st.kv_cache_spec_kind == "full_attention"
    assert rm == BlockRemoved((7001372877482414859,), "GPU", 0)
    assert cl == AllBlocksCleared()


def test_decode_array_encoding():
    b = decode_payload(CAPTURED_ARRAY)
    st, rm, cl = b.events
    assert st == BlockStored((-3, 4), 99, tuple(range(32)), 16, None, "GPU")
    assert rm == BlockRemoved((-3,), "GPU")
    assert isinstance(cl, AllBlocksCleared)
    assert b.data_parallel_rank is None


def test_omitted_defaults_and_unknown_fields_are_ignored():
    payload = msgpack.packb([1.0, [
        {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
         "token_ids": [1, 2], "block_size": 2, "future_field": {"x": [1, 2]}, "another": 3},
        ["BlockRemoved", [1], "GPU", 0, "an extra positional item", 42],
        {"type": "BlockRemoved", "block_hashes": [1]},
    ], 0])
    st, rm, rm2 = decode_payload(payload).events
    assert st.lora_id is None and st.medium is None and st.group_idx == 0
    assert rm == BlockRemoved((1,), "GPU", 0) and rm2 == BlockRemoved((1,))


def test_unknown_event_type_is_kept_not_fatal():
    payload = msgpack.packb([1.0, [{"type": "BlockPinned", "x": 1}, ["SomethingNew", 1]], 0])
    assert decode_payload(payload).events == (UnknownEvent("BlockPinned"), UnknownEvent("SomethingNew"))


def test_bytes_hashes_normalised_to_last_8_bytes():
    d = hashlib.sha256(b"x").digest()
    payload = msgpack.packb([1.0, [["BlockRemoved", [d], None]], 0], use_bin_type=True)
    (ev,) = decode_payload(payload).events
    assert ev.block_hashes == (int.from_bytes(d[-8:], "big"),)
    assert normalize_hash(5) == 5


@pytest.mark.parametrize("payload", [
    b"",                                   # empty
    b"\xc1",                               # never-used msgpack byte
    b"\x93\x01",                           # truncated array
    msgpack.packb({"a": 1}),               # not a batch
    msgpack.packb([1.0]),                  # no events
    msgpack.packb(["ts", [], 0]),          # ts not a number
    msgpack.packb([1.0, {"a": 1}, 0]),     # events not a list
    msgpack.packb([1.0, [{"no": "type"}], 0]),
    msgpack.packb([1.0, [[1, 2]], 0]),     # array without type name
    msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [1]}], 0]),  # missing fields
    msgpack.packb([1.0, [["BlockStored", [1], None, "notalist", 16]], 0]),
    msgpack.packb([1.0, [["BlockStored", [1], None, [1, "x"], 16]], 0]),  # non-int token
    msgpack.packb([1.0, [["BlockStored", [1], None, [2**63], 16]], 0]),  # token out of int64 range
    msgpack.packb([1.0, [["BlockRemoved", [1.5]]], 0]),  # float hash
    msgpack.packb([1.0, [["BlockRemoved", "abc"]], 0]),
    msgpack.packb([1.0, [7], 0]),
])
def test_malformed_payload_raises_typed_error(payload):
    with pytest.raises(KVEventDecodeError):
        decode_payload(payload)


def test_seq_frames():
    assert decode_seq(struct.pack(">Q", 0)) == 0
    assert decode_seq(struct.pack(">Q", 2**40 + 7)) == 2**40 + 7
    assert decode_seq(b"\xff" * 8) == END_SEQ
    assert encode_seq(END_SEQ) == b"\xff" * 8 and encode_seq(258) == b"\0" * 6 + b"\x01\x02"
    with pytest.raises(KVEventDecodeError):
        decode_seq(b"\x00\x01")


def test_message_frames_and_errors():
    msg = decode_message([b"eng-1", struct.pack(">Q", 9), CAPTURED_ARRAY])
    assert msg.topic == "eng-1" and msg.seq == 9 and len(msg.batch.events) == 3
    with pytest.raises(KVEventDecodeError):
        decode_message([b"t", CAPTURED_ARRAY])


@pytest.mark.parametrize("encoding", ["map", "array"])
def test_encode_roundtrip(encoding):
    batch = EventBatch(12.5, (
        BlockStored((1, 2), None, tuple(range(8)), 4, None, "GPU", None),
        BlockStored((3,), 2, tuple(range(8, 12)), 4, 7, "GPU", "my-lora"),
        BlockRemoved((1, 2, 3), "GPU"),
        AllBlocksCleared(),
    ), 0)
    frames = encode_message("t", 5, batch, encoding)
    back = decode_message(frames)
    assert back.topic == "t" and back.seq == 5 and back.batch == batch
    raw = msgpack.unpackb(frames[2])
    first = raw[1][0]
    if encoding == "map":
        assert first["type"] == "BlockStored"
    else:
        assert first[0] == "BlockStored" and first[1] == [1, 2]


def test_vllm_hash_formula_fixed_tokens():
    """h_i = sha256(pickle((h_{i-1}, tuple(block), None))), NONE_HASH root; the event value
    is the last 8 bytes big-endian. Expected values computed here from the formula."""
    none = hashlib.sha256(pickle.dumps("vllm-none-hash", pickle.HIGHEST_PROTOCOL)).digest()
    assert none == NONE_HASH
    tokens = [(i * 7919) % 32000 for i in range(40)]
    bs = 16
    h1 = hashlib.sha256(pickle.dumps((none, tuple(tokens[:16]), None), pickle.HIGHEST_PROTOCOL)).digest()
    h2 = hashlib.sha256(pickle.dumps((h1, tuple(tokens[16:32]), None), pickle.HIGHEST_PROTOCOL)).digest()
    assert vllm_block_digests(tokens, bs) == [h1, h2]  # 40 tokens: 2 full blocks only
    got = vllm_block_hashes(tokens, bs)
    assert got == [int.from_bytes(h1[24:], "big"), int.from_bytes(h2[24:], "big")]
    assert all(0 <= v < 2**64 for v in got)
    # resuming from a parent digest equals the full chain
    assert vllm_block_digests(tokens, bs, parent=h1, start_block=1) == [h2]


def test_vllm_hash_golden_values():
    """Frozen values: computed once with an independent few-line implementation of the
    issue's formula (hashlib + pickle only, Python 3.11, pickle protocol 5) and pasted here
    as literals, so any change to the code's formula fails this test."""
    assert NONE_HASH.hex() == "066b1e8987e027138e98701c46128929378935f9b6cd1549105ae6b4f0d71198"
    tokens = [(i * 7919) % 32000 for i in range(40)]
    assert vllm_block_hashes(tokens, 16) == [14628313704954473368, 10653310882587869824]
    assert vllm_block_hashes(list(range(32)), 16, cache_salt="s") == [12631044627581701367,
                                                                     12258177460191399530]


def test_vllm_extra_keys_salt_and_lora():
    assert vllm_extra_keys(0) is None
    assert vllm_extra_keys(0, cache_salt="s") == ("s",)
    assert vllm_extra_keys(1, cache_salt="s") is None
    assert vllm_extra_keys(0, lora_name="l", cache_salt="s") == ("l", "s")
    assert vllm_extra_keys(3, lora_name="l", cache_salt="s") == ("l",)
    tokens = list(range(32))
    plain = vllm_block_hashes(tokens, 16)
    salted = vllm_block_hashes(tokens, 16, cache_salt="s")
    h1 = hashlib.sha256(pickle.dumps((NONE_HASH, tuple(range(16)), ("s",)), pickle.HIGHEST_PROTOCOL)).digest()
    assert salted[0] == int.from_bytes(h1[-8:], "big")
    assert plain[0] != salted[0] and plain[1] != salted[1]  # the salt propagates down the chain
    assert vllm_block_hashes(tokens, 16, lora_name="l")[0] != plain[0]


def test_sglang_hash_formula():
    tokens = list(range(1, 9))
    h1 = hashlib.sha256(b"".join(t.to_bytes(4, "little") for t in tokens[:4])).hexdigest()
    h2 = hashlib.sha256(bytes.fromhex(h1) + b"".join(t.to_bytes(4, "little") for t in tokens[4:])).hexdigest()

    def signed(hx: str) -> int:
        v = int(hx[:16], 16)
        return v - 2**64 if v >= 2**63 else v

    assert sglang_block_hashes(tokens, 4) == [signed(h1), signed(h2)]
    assert all(-(2**63) <= v < 2**63 for v in sglang_block_hashes(list(range(100)), 4))


def test_encode_rejects_unknown_encoding():
    with pytest.raises(ValueError):
        encode_payload(EventBatch(0.0), "json")


def test_vllm_block_hasher_continues_chains_from_64bit_parents():
    from backends.kv_events import VllmBlockHasher

    tokens = list(range(64))
    hasher = VllmBlockHasher()
    whole = vllm_block_hashes(tokens, 16, cache_salt="s")
    first = hasher(tokens[:32], 16, parent=None, model="m", cache_salt="s")
    rest = hasher(tokens[32:], 16, parent=first[-1], model="m", cache_salt="s")
    assert first + rest == whole
    small = VllmBlockHasher(max_entries=2)
    small(tokens, 16, parent=None, model="m")
    assert len(small._digests) == 2

"""The block wire format: exact round trips, and every kind of damaged input refused."""

from __future__ import annotations

import struct

import msgpack
import pytest
import torch

from rayapp.blocks import BlockHash, hash_block
from rayapp.kvtier.codec import BlockFormatError, KVBlock, decode_block, decode_header, encode_block

# SmolLM2-shaped page: [layers, block_size, kv_heads, head_dim].
SHAPE = (30, 16, 3, 64)


def make_block(dtype: torch.dtype = torch.bfloat16, seed: int = 0, parent: int | None = None) -> KVBlock:
    g = torch.Generator().manual_seed(seed)
    tokens = tuple(int(t) for t in torch.randint(0, 49152, (SHAPE[1],), generator=g))
    return KVBlock(
        block_hash=hash_block(None if parent is None else BlockHash(parent), tokens, ("smollm2", "salt")),
        parent_hash=None if parent is None else BlockHash(parent),
        token_ids=tokens,
        model_id="smollm2",
        key=torch.randn(SHAPE, generator=g).to(dtype),
        value=torch.randn(SHAPE, generator=g).to(dtype),
        cache_salt="salt",
        layer_group=2,
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_block_round_trips_bit_for_bit(dtype):
    block = make_block(dtype, parent=(1 << 64) - 1)
    back = decode_block(encode_block(block))
    assert back.key.dtype == dtype and back.key.shape == SHAPE
    # Compare bits, not values: equal bits is what "exact" means (and NaN-safe).
    bits = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}[dtype]
    assert torch.equal(back.key.view(bits), block.key.view(bits))
    assert torch.equal(back.value.view(bits), block.value.view(bits))
    assert (back.block_hash, back.parent_hash, back.token_ids) == (block.block_hash, block.parent_hash, block.token_ids)
    assert (back.model_id, back.cache_salt, back.layer_group) == ("smollm2", "salt", 2)


def test_decoded_tensors_are_writable_copies():
    block = make_block()
    data = bytearray(encode_block(block))
    back = decode_block(data)
    data[-2:] = b"\xff\xff"  # the last bf16 of V in the source buffer becomes NaN
    assert torch.equal(back.value.view(torch.int16), block.value.view(torch.int16))
    back.key.zero_()  # fails on a tensor over a read-only buffer


def test_header_reads_identity_without_tensors():
    block = make_block()
    header = decode_header(memoryview(encode_block(block)))
    assert header.block_hash == block.block_hash and header.token_ids == block.token_ids
    assert header.shape == SHAPE and header.dtype == "bfloat16"
    assert header.tensor_nbytes == 30 * 16 * 3 * 64 * 2


def test_flipped_tensor_byte_is_rejected():
    data = bytearray(encode_block(make_block()))
    data[len(data) // 2] ^= 0x01
    with pytest.raises(BlockFormatError, match="CRC"):
        decode_block(bytes(data))


@pytest.mark.parametrize("cut", [1, 2, 1000])
def test_truncated_or_padded_block_is_rejected(cut):
    data = encode_block(make_block())
    with pytest.raises(BlockFormatError, match="tensor bytes"):
        decode_block(data[:-cut])
    with pytest.raises(BlockFormatError, match="tensor bytes"):
        decode_header(data + b"\0" * cut)


def _reheader(data: bytes, **changes) -> bytes:
    magic, n = struct.unpack_from("<4sI", data)
    header = msgpack.unpackb(data[8 : 8 + n])
    header.update(changes)
    packed = msgpack.packb(header)
    return struct.pack("<4sI", magic, len(packed)) + packed + data[8 + n :]


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"dtype": "int8"}, "dtype"),
        ({"shape": [30, 16, 3, 32]}, "tensor bytes"),
        ({"shape": [30, 16, 3]}, "shape"),
        ({"shape": [30, 16, 3, -64]}, "shape"),
        ({"token_ids": list(range(15))}, "token ids"),
        ({"block_hash": -1}, "unsigned 64-bit"),
        ({"parent_hash": "x"}, "unsigned 64-bit"),
        ({"model_id": 7}, "model_id"),
        ({"layer_group": -1}, "layer_group"),
        ({"extra": 1}, "header fields"),
    ],
)
def test_header_that_disagrees_with_itself_is_rejected(changes, message):
    data = encode_block(make_block())
    with pytest.raises(BlockFormatError, match=message):
        decode_block(_reheader(data, **changes))


@pytest.mark.parametrize(
    "data, message",
    [
        (b"", "shorter"),
        (b"PK\x03\x04" + b"\0" * 100, "magic"),
        (struct.pack("<4sI", b"RKV1", 1 << 30) + b"\0" * 10, "header length"),
        (struct.pack("<4sI", b"RKV1", 3) + b"\xc1\xc1\xc1", "msgpack"),
        (struct.pack("<4sI", b"RKV1", 1) + b"\x90", "header fields"),
    ],
)
def test_foreign_bytes_are_rejected(data, message):
    with pytest.raises(BlockFormatError, match=message):
        decode_block(data)


def test_encode_refuses_inconsistent_blocks():
    block = make_block()
    with pytest.raises(ValueError, match="token ids"):
        encode_block(KVBlock(block.block_hash, None, block.token_ids[:-1], "m", block.key, block.value))
    with pytest.raises(ValueError, match="share one 4-d shape"):
        encode_block(KVBlock(block.block_hash, None, block.token_ids, "m", block.key, block.value.float()))
    with pytest.raises(ValueError, match="not supported"):
        ints = torch.zeros(SHAPE, dtype=torch.int8)
        encode_block(KVBlock(block.block_hash, None, block.token_ids, "m", ints, ints))
    with pytest.raises(ValueError, match="no elements"):
        empty = torch.zeros((0, 16, 3, 64), dtype=torch.bfloat16)
        encode_block(KVBlock(block.block_hash, None, block.token_ids, "m", empty, empty))
    with pytest.raises(ValueError, match="unsigned 64-bit"):
        encode_block(KVBlock(BlockHash(1 << 64), None, block.token_ids, "m", block.key, block.value))

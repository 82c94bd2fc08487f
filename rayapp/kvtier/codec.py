"""Wire format of one cluster-tier block: all layers of one page, K and V, plus its identity.

Layout (little-endian): `MAGIC | u32 header length | msgpack header | K bytes | V bytes`.
The header is plain msgpack (ints, strings, lists), so decoding never runs code from the
buffer, unlike pickle. The tensors travel as their raw bytes, so bfloat16 round-trips bit for bit.
A CRC-32 of the tensor bytes is in the header: a block read back from the object store is either
exactly what was written or rejected, never a silently wrong block.
"""

from __future__ import annotations

import math
import struct
import sys
import zlib
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import torch

from rayapp.blocks import BlockHash

MAGIC = b"RKV1"
_PREFIX = struct.Struct("<4sI")
# A header holds ids and a few strings; anything far larger is a corrupted length field.
_MAX_HEADER_BYTES = 1 << 20
_U64 = 1 << 64

DTYPES: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
_HEADER_KEYS = frozenset(
    {"block_hash", "parent_hash", "token_ids", "model_id", "cache_salt", "layer_group", "dtype", "shape", "crc32"}
)

# Tensor bytes are written in the host's order; every host rayapp runs on (x86-64, aarch64) is little-endian.
if sys.byteorder != "little":
    raise ImportError("rayapp.kvtier.codec supports little-endian hosts only")


class BlockFormatError(ValueError):
    """The bytes are not a well-formed block (truncated, corrupted, or of another format)."""


@dataclass(frozen=True)
class BlockHeader:
    """Identity and layout of an encoded block, readable without touching the tensor bytes."""

    block_hash: BlockHash
    parent_hash: BlockHash | None
    token_ids: tuple[int, ...]
    model_id: str
    cache_salt: str
    layer_group: int
    dtype: str
    # (num_layers, block_size, num_kv_heads, head_dim), the same for K and V.
    shape: tuple[int, int, int, int]
    crc32: int

    @property
    def tensor_nbytes(self) -> int:
        """Bytes of one of K or V."""
        return math.prod(self.shape) * DTYPES[self.dtype].itemsize


@dataclass(frozen=True)
class KVBlock:
    """One full page of KV for every layer of a layer group, with the identity that names it.

    `key` and `value` are `[num_layers, block_size, num_kv_heads, head_dim]` on the CPU;
    `token_ids` are the block's `block_size` tokens, so a reader can check a hit token by token.
    """

    block_hash: BlockHash
    parent_hash: BlockHash | None
    token_ids: tuple[int, ...]
    model_id: str
    key: torch.Tensor
    value: torch.Tensor
    cache_salt: str = ""
    layer_group: int = 0


def _tensor_bytes(t: torch.Tensor) -> np.ndarray:
    # A uint8 view of the contiguous CPU tensor: no copy unless the tensor is on a device or strided.
    return t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()


def _check_u64(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < _U64:
        raise BlockFormatError(f"{name}={value!r} is not an unsigned 64-bit hash")


def encode_block(block: KVBlock) -> bytes:
    """Serialize `block` (header + raw K and V bytes); the inverse of `decode_block`."""
    k, v = block.key, block.value
    if k.shape != v.shape or k.dtype != v.dtype or k.dim() != 4:
        raise ValueError(
            f"key and value must share one 4-d shape and dtype, got {tuple(k.shape)} {k.dtype} "
            f"and {tuple(v.shape)} {v.dtype}"
        )
    if k.numel() == 0:
        raise ValueError(f"key and value of shape {tuple(k.shape)} hold no elements")
    if k.dtype not in _DTYPE_NAMES:
        raise ValueError(f"dtype {k.dtype} is not supported; use one of {sorted(DTYPES)}")
    if len(block.token_ids) != k.shape[1]:
        raise ValueError(f"{len(block.token_ids)} token ids for a block of {k.shape[1]} tokens")
    _check_u64("block_hash", block.block_hash)
    if block.parent_hash is not None:
        _check_u64("parent_hash", block.parent_hash)
    k_bytes, v_bytes = _tensor_bytes(k), _tensor_bytes(v)
    crc = zlib.crc32(v_bytes, zlib.crc32(k_bytes))
    header = msgpack.packb(
        {
            "block_hash": int(block.block_hash),
            "parent_hash": None if block.parent_hash is None else int(block.parent_hash),
            "token_ids": [int(t) for t in block.token_ids],
            "model_id": block.model_id,
            "cache_salt": block.cache_salt,
            "layer_group": int(block.layer_group),
            "dtype": _DTYPE_NAMES[k.dtype],
            "shape": list(k.shape),
            "crc32": crc,
        }
    )
    return b"".join((_PREFIX.pack(MAGIC, len(header)), header, k_bytes, v_bytes))


def _parse_header(raw: Any) -> BlockHeader:
    if not isinstance(raw, dict) or set(raw) != _HEADER_KEYS:
        keys = sorted(raw) if isinstance(raw, dict) else type(raw).__name__
        raise BlockFormatError(f"header fields {keys} are not {sorted(_HEADER_KEYS)}")
    _check_u64("block_hash", raw["block_hash"])
    if raw["parent_hash"] is not None:
        _check_u64("parent_hash", raw["parent_hash"])
    if raw["dtype"] not in DTYPES:
        raise BlockFormatError(f"dtype {raw['dtype']!r} is not one of {sorted(DTYPES)}")
    shape = raw["shape"]
    if not (isinstance(shape, list) and len(shape) == 4 and all(type(d) is int and d > 0 for d in shape)):
        raise BlockFormatError(f"shape {shape!r} is not 4 positive ints")
    tokens = raw["token_ids"]
    if not isinstance(tokens, list) or not all(type(t) is int for t in tokens) or len(tokens) != shape[1]:
        raise BlockFormatError(f"token ids do not hold {shape[1]} ints")
    for name in ("model_id", "cache_salt"):
        if not isinstance(raw[name], str):
            raise BlockFormatError(f"{name} is not a string")
    if type(raw["layer_group"]) is not int or raw["layer_group"] < 0:
        raise BlockFormatError(f"layer_group {raw['layer_group']!r} is not an int >= 0")
    if type(raw["crc32"]) is not int:
        raise BlockFormatError("crc32 is not an int")
    return BlockHeader(
        block_hash=BlockHash(raw["block_hash"]),
        parent_hash=None if raw["parent_hash"] is None else BlockHash(raw["parent_hash"]),
        token_ids=tuple(tokens),
        model_id=raw["model_id"],
        cache_salt=raw["cache_salt"],
        layer_group=raw["layer_group"],
        dtype=raw["dtype"],
        shape=tuple(shape),
        crc32=raw["crc32"],
    )


def _split(data: bytes | bytearray | memoryview | np.ndarray) -> tuple[BlockHeader, memoryview]:
    buf = memoryview(data).cast("B")
    if len(buf) < _PREFIX.size:
        raise BlockFormatError(f"{len(buf)} bytes is shorter than a block prefix")
    magic, header_len = _PREFIX.unpack_from(buf)
    if magic != MAGIC:
        raise BlockFormatError(f"magic {bytes(magic)!r} is not {MAGIC!r}")
    if header_len > min(_MAX_HEADER_BYTES, len(buf) - _PREFIX.size):
        raise BlockFormatError(f"header length {header_len} exceeds the buffer")
    start = _PREFIX.size
    try:
        raw = msgpack.unpackb(buf[start : start + header_len], raw=False, strict_map_key=True)
    except (ValueError, TypeError, msgpack.exceptions.UnpackException) as e:
        raise BlockFormatError(f"header is not valid msgpack: {e}") from e
    header = _parse_header(raw)
    payload = buf[start + header_len :]
    if len(payload) != 2 * header.tensor_nbytes:
        raise BlockFormatError(
            f"{len(payload)} tensor bytes, expected {2 * header.tensor_nbytes} for "
            f"K and V of shape {header.shape} in {header.dtype}"
        )
    return header, payload


def decode_header(data: bytes | bytearray | memoryview | np.ndarray) -> BlockHeader:
    """The header of an encoded block, checked for shape and length but without reading the tensors.

    Raises `BlockFormatError` when the bytes are not a well-formed block.
    """
    return _split(data)[0]


def decode_block(data: bytes | bytearray | memoryview | np.ndarray) -> KVBlock:
    """Rebuild the block `encode_block` wrote; the tensors are fresh, writable CPU copies.

    Raises `BlockFormatError` on any mismatch: magic, header fields, shape vs length, checksum.
    """
    header, payload = _split(data)
    if zlib.crc32(payload) != header.crc32:
        raise BlockFormatError(f"tensor bytes of block {header.block_hash:#018x} fail their CRC-32")
    n = header.tensor_nbytes
    dtype = DTYPES[header.dtype]
    # One copy out of the (possibly read-only, shared-memory) buffer into tensors this process owns.
    k = torch.frombuffer(bytearray(payload[:n]), dtype=torch.uint8).view(dtype).reshape(header.shape)
    v = torch.frombuffer(bytearray(payload[n:]), dtype=torch.uint8).view(dtype).reshape(header.shape)
    return KVBlock(
        block_hash=header.block_hash,
        parent_hash=header.parent_hash,
        token_ids=header.token_ids,
        model_id=header.model_id,
        key=k,
        value=v,
        cache_salt=header.cache_salt,
        layer_group=header.layer_group,
    )

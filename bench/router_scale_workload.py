"""The workload of `bench/router_scale.py` (its docstring describes it): each block's hash, each turn's
`BlockStored` and a prompt's hashes.
"""

from __future__ import annotations

from rayapp.blocks import BlockStored

PAGE, SYSTEM_BLOCKS, TURN_BLOCKS, TURNS = 16, 8, 8, 6
CONVERSATION = TURN_BLOCKS * TURNS
MASK = (1 << 64) - 1


def block_hash(conversation: int, i: int) -> int:
    """Block `i` of a conversation's own chain: a fixed pseudo-random 64-bit hash (a splitmix64 step)."""
    x = ((conversation << 16 | i) + 0x9E3779B97F4A7C15) & MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    return x ^ (x >> 31)


SYSTEM = tuple(block_hash(-1, i) for i in range(SYSTEM_BLOCKS))


def turn(conversation: int, t: int) -> BlockStored:
    first = t * TURN_BLOCKS
    hashes = tuple(block_hash(conversation, i) for i in range(first, first + TURN_BLOCKS))
    parent = block_hash(conversation, first - 1) if t else SYSTEM[-1]
    return BlockStored(hashes, parent, tuple(range(first * PAGE, (first + TURN_BLOCKS) * PAGE)), PAGE)


def prompt(conversation: int) -> list[int]:
    """A 64-block prompt: the system prompt, the whole conversation, 8 blocks nobody holds."""
    return [*SYSTEM, *(block_hash(conversation, i) for i in range(CONVERSATION + 8))]

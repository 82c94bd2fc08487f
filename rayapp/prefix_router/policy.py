"""Which replica should prefill a request: the routing cost, as a pure function of what the router knows.

Kept apart from the Serve `RequestRouter` so the policy is tested without Ray: given each
candidate's cached overlap (from the PrefixIndex) and its ongoing requests (from Serve), rank the
candidates by `cost = prefill work left + queued work`, in prompt-token units.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from rayapp.config import RouterConfig

# Why a request went where it went (the `reason` label of the decisions metric).
OVERLAP = "overlap"  # the replica holding the longest prefix won
LOAD = "load"  # a replica with a shorter prefix won because the longest holder was busier
FALLBACK = "fallback"  # no usable overlap, or no index: power-of-two choices


@dataclass(frozen=True)
class Holding:
    """How many of a request's leading blocks a replica holds, and how many of those are off-device."""

    blocks: int
    offloaded: int = 0


@dataclass(frozen=True)
class Decision:
    """Candidates best first; `predicted_cached_tokens` is what the first one should serve from cache."""

    ranked: list[str]
    reason: str
    predicted_cached_tokens: int


def cached_tokens(blocks: int, prompt_tokens: int, block_size: int) -> int:
    """Prompt tokens an engine serves from `blocks` leading cached blocks (the last token is always computed)."""
    return min(blocks, (prompt_tokens - 1) // block_size) * block_size if prompt_tokens > 0 else 0


def rank(
    candidates: list[str],
    prompt_tokens: int,
    block_size: int,
    holdings: dict[str, Holding] | None,
    ongoing: dict[str, int],
    config: RouterConfig,
    rng: random.Random,
) -> Decision:
    """Rank `candidates` for one request.

    `holdings` is the PrefixIndex's answer (None when the index could not be asked); `ongoing`
    the requests each replica already runs or queues (missing: unknown, taken as 0). Without an
    overlap of at least `min_overlap_blocks` anywhere, two random candidates are returned in
    random order (Serve's power-of-two choices: the lower queue of the two wins downstream).
    """
    holdings = holdings or {}
    best_overlap = max((holdings.get(r, Holding(0)).blocks for r in candidates), default=0)
    if best_overlap < config.min_overlap_blocks:
        return Decision(rng.sample(candidates, min(2, len(candidates))), FALLBACK, 0)

    def cost(replica: str) -> float:
        held = holdings.get(replica, Holding(0))
        cached = cached_tokens(held.blocks, prompt_tokens, block_size)
        offloaded = min(held.offloaded * block_size, cached)
        return (
            config.prefill_weight * (prompt_tokens - cached)
            + config.loadable_weight * config.prefill_weight * offloaded
            + config.queue_weight_tokens * ongoing.get(replica, 0)
        )

    # Ties (equal cost, e.g. nobody holds anything yet on idle replicas) break at random.
    ranked = sorted(candidates, key=lambda r: (cost(r), rng.random()))
    chosen = holdings.get(ranked[0], Holding(0)).blocks
    reason = OVERLAP if chosen == best_overlap else LOAD
    return Decision(ranked, reason, cached_tokens(chosen, prompt_tokens, block_size))

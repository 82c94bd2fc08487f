"""A request inside the engine: its sequence, detokenizer and tier bookkeeping, and the group of its answers."""

from __future__ import annotations

from dataclasses import dataclass

from rayapp.engine.detokenizer import IncrementalDetokenizer
from rayapp.engine.kv_transfer import TierBlock, TierPlan
from rayapp.engine.outputs import TokenLogprob
from rayapp.engine.sequence import Sequence


@dataclass
class Request:
    """A validated request, ready to enter the scheduler."""

    seq: Sequence
    prompt: str | None
    # Kept apart from `seq.token_ids` so each step's output can share it instead of slicing a copy.
    prompt_token_ids: list[int]
    detokenizer: IncrementalDetokenizer
    max_new_tokens: int
    # Each output token's logprobs, when its SamplingParams ask for them.
    logprobs: list[TokenLogprob] | None = None
    counted_cached: bool = False
    # Prompt tokens [start, end) whose pages were loaded from the cluster tier for this request.
    tier_tokens: tuple[int, int] = (0, 0)
    # (preemptions, local blocks) when the tier was last asked for this preempted request's blocks.
    tier_refetched: tuple[int, int] | None = None
    # Blocks fetched back from the tier for this preempted request, until there is room to install them.
    tier_fetched: tuple[TierPlan, list[TierBlock]] | None = None
    # Tokens [start, end) a preempted request loaded back from the tier, until its readmission counts them.
    tier_reloaded: tuple[int, int] | None = None
    # Which of its request's `n` answers this is, and the request's answers when n > 1.
    index: int = 0
    group: RequestGroup | None = None


@dataclass
class RequestGroup:
    """The `n` answers of one request (SamplingParams.n > 1), a sequence each. The first computes the prompt
    and is forked into the others when it samples its first token: they share its prompt pages."""

    request_id: str
    n: int
    members: list[Request]
    unfinished: int = 0
    forked: bool = False

    def __post_init__(self) -> None:
        self.unfinished = self.n

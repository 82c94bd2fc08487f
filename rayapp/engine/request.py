"""A request inside the engine: its sequence and detokenizer, and the group of its answers."""

from __future__ import annotations

import math
from dataclasses import dataclass

from rayapp.blocks import BlockHash
from rayapp.engine.detokenizer import IncrementalDetokenizer
from rayapp.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput, TokenLogprob
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
    # Whether its cached prompt tokens were counted (at its first step).
    counted_cached: bool = False
    # Which of its request's `n` answers this is, and the request's answers when n > 1.
    index: int = 0
    group: RequestGroup | None = None

    def output(
        self,
        delta_ids: list[int],
        delta_text: str,
        stop_reason: str | int | None = None,
        delta_logprobs: list[TokenLogprob | None] = (),
    ) -> RequestOutput:
        """This answer's output now, with what it produced since the last one; a group's carries the first
        answer's cache and timing."""
        seq = self.seq
        completion = CompletionOutput(
            index=self.index,
            text=self.detokenizer.text,
            token_ids=seq.output_token_ids,
            finish_reason=seq.finish_reason,
            stop_reason=stop_reason,
            delta_text=delta_text,
            delta_token_ids=delta_ids,
            logprobs=self.logprobs,
            delta_logprobs=None if self.logprobs is None else list(delta_logprobs),
        )
        group, first = self.group, self if self.group is None else self.group.members[0]
        return RequestOutput(
            request_id=seq.seq_id if group is None else group.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[completion],
            finished=seq.is_finished if group is None else group.unfinished == 0,
            num_cached_tokens=first.seq.num_cached_tokens,
            metrics=RequestMetrics(first.seq.arrival_time, first.seq.first_token_time),
        )


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


@dataclass(frozen=True)
class RequestLimits:
    """What one engine can take: its context length, vocabulary and KV pool."""

    max_model_len: int
    vocab_size: int
    num_pages: int
    block_size: int

    def check(
        self,
        ids: list[int],
        max_tokens: int | None,
        block_hashes: list[BlockHash] | None = None,
        delivered_tokens: int = 0,
    ) -> int:
        """The most tokens `ids` may generate (`max_tokens`, or what the context leaves); ValueError, saying what
        to change, for an empty or too long prompt, a token outside the vocabulary, one that cannot fit in the
        pool, more block hashes than full blocks, or a moved answer's output longer than the prompt."""
        if not ids:
            raise ValueError("prompt is empty: give at least one token")
        if any(not isinstance(t, int) or not 0 <= t < self.vocab_size for t in ids):
            raise ValueError(f"prompt_token_ids must be integers in [0, {self.vocab_size})")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(ids)} tokens; max_model_len is {self.max_model_len}, which must also leave "
                f"room for at least one generated token"
            )
        room = self.max_model_len - len(ids)
        max_new = room if max_tokens is None else min(max_tokens, room)
        pages = math.ceil((len(ids) + max_new - 1) / self.block_size)
        if pages > self.num_pages:
            raise ValueError(
                f"prompt ({len(ids)} tokens) plus max_tokens ({max_new}) needs {pages} KV pages but the pool has "
                f"{self.num_pages}; lower max_tokens or raise num_pages / kv_cache_memory_gb"
            )
        if block_hashes is not None and len(block_hashes) > len(ids) // self.block_size:
            raise ValueError(f"got {len(block_hashes)} block hashes for a {len(ids)}-token prompt")
        if not 0 <= delivered_tokens < len(ids):
            raise ValueError(f"delivered_tokens={delivered_tokens} must be in [0, {len(ids)}) for this prompt")
        return max_new

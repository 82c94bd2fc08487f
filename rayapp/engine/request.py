"""A request inside the engine: its sequence and detokenizer, and the group of its answers."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from rayapp.blocks import BlockHash
from rayapp.engine.detokenizer import IncrementalDetokenizer
from rayapp.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput, TokenLogprob
from rayapp.engine.sampling_params import SamplingParams
from rayapp.engine.sequence import Sequence


@dataclass(frozen=True)
class EngineRequest:
    """One request as an engine takes it: tokenized, and hashed once by the ingress when served.

    The same object crosses every boundary (ingress, router, replica, the engine's process). Request routers
    read it before it leaves the ingress: rayapp's `PrefixAwareRouter` reads `block_hashes` and
    `prompt_token_ids`; text-trie routers (Ray Serve LLM's `PrefixCacheAffinityRouter`) read `prompt`.
    """

    request_id: str
    prompt_token_ids: list[int]
    # The hash chain of the prompt's full blocks, salted by tenant, as `rayapp.blocks.hash_blocks` computes it
    # with the engine's model id and `cache_salt`; None: the engine hashes the prompt itself.
    block_hashes: list[BlockHash] | None = None
    # Derived from the tenant (a hash, never the API key itself): tenants never share KV pages.
    cache_salt: str = ""
    sampling: SamplingParams = SamplingParams()
    # What the client sent: the prompt text (or token ids), or the chat messages; None when it sent token ids.
    prompt: str | list[int] | list[dict[str, Any]] | None = None
    # A moved request: the last `delivered_tokens` prompt tokens are output another replica already streamed,
    # with `delivered_chars` characters of text (None: all of it). The engine reads their text again (held-back
    # text and stop strings spanning the cut come out as if the answer had not moved) and streams only what
    # follows.
    delivered_tokens: int = 0
    delivered_chars: int | None = None


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


# OpenAI's error code for a request past the model's context, which clients match on.
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"


class LimitError(ValueError):
    """A request past what `RequestLimits` allows. `param` names the request field to change (`prompt`,
    `max_tokens`, ...) and `code` is OpenAI's error code, if it has one: the ingress answers both in its 400."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.code = param, code


@dataclass(frozen=True)
class RequestLimits:
    """What one engine can take: its context length, vocabulary and KV pool. The engine checks every request
    against its own; the ingress checks against the same limits with `num_pages=None` (the replicas' pool is not
    known there; their engines check it)."""

    max_model_len: int
    vocab_size: int
    num_pages: int | None
    block_size: int

    def check(
        self,
        ids: list[int],
        max_tokens: int | None,
        block_hashes: list[BlockHash] | None = None,
        delivered_tokens: int = 0,
        *,
        fit_max_tokens: bool = True,
    ) -> int:
        """The most tokens `ids` may generate: `max_tokens`, or what the context leaves when that is less (or
        `max_tokens` is None). Without `fit_max_tokens` (OpenAI's API), a `max_tokens` past the context is an
        error instead. LimitError, saying what to change, for an empty or too long prompt, a token outside the
        vocabulary, one that cannot fit in the pool (when `num_pages` is known), more block hashes than full blocks,
        or a moved answer's output longer than the prompt."""
        if not ids:
            raise LimitError("prompt is empty: give at least one token", "prompt")
        if len(ids) >= self.max_model_len:
            raise LimitError(
                f"this model's maximum context length is {self.max_model_len} tokens (max_model_len is "
                f"{self.max_model_len}), but the prompt has {len(ids)}, which leaves no room for a generated token; "
                f"shorten the prompt",
                "prompt",
                CONTEXT_LENGTH_EXCEEDED,
            )
        room = self.max_model_len - len(ids)
        if not fit_max_tokens and max_tokens is not None and max_tokens > room:
            raise LimitError(
                f"this model's maximum context length is {self.max_model_len} tokens, but "
                f"{len(ids) + max_tokens} were requested ({len(ids)} in the prompt, {max_tokens} to generate); "
                f"shorten the prompt or lower max_tokens",
                "prompt",
                CONTEXT_LENGTH_EXCEEDED,
            )
        # After the length checks: this one reads every token.
        if any(not isinstance(t, int) or not 0 <= t < self.vocab_size for t in ids):
            raise LimitError(f"prompt_token_ids must be integers in [0, {self.vocab_size})", "prompt")
        max_new = room if max_tokens is None else min(max_tokens, room)
        pages = math.ceil((len(ids) + max_new - 1) / self.block_size)
        if self.num_pages is not None and pages > self.num_pages:
            raise LimitError(
                f"prompt ({len(ids)} tokens) plus max_tokens ({max_new}) needs {pages} KV pages but the pool has "
                f"{self.num_pages}; lower max_tokens or raise num_pages / kv_cache_memory_gb",
                "max_tokens",
            )
        if block_hashes is not None and len(block_hashes) > len(ids) // self.block_size:
            raise LimitError(f"got {len(block_hashes)} block hashes for a {len(ids)}-token prompt", "block_hashes")
        if not 0 <= delivered_tokens < len(ids):
            raise LimitError(
                f"delivered_tokens={delivered_tokens} must be in [0, {len(ids)}) for this prompt", "delivered_tokens"
            )
        return max_new

    def check_logit_bias(self, bias: Iterable[tuple[int, float]]) -> None:
        """LimitError naming `logit_bias` when one of its (token id, bias) pairs names a token outside the
        vocabulary (as vLLM refuses them)."""
        outside = sorted(t for t, _ in bias if not 0 <= t < self.vocab_size)
        if outside:
            raise LimitError(
                f"logit_bias names token ids outside this model's vocabulary of {self.vocab_size} tokens "
                f"({', '.join(map(str, outside[:5]))}{', ...' if len(outside) > 5 else ''}); use ids in "
                f"[0, {self.vocab_size})",
                "logit_bias",
            )

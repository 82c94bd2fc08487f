"""The engine interface `LLMReplica` serves: one protocol, implemented by rayapp's engine and by vLLM.

Requests come in as `rayapp.engine.request.EngineRequest`.

A backend streams each request as typed deltas, aborts requests, reports stats under rayapp's
metric names, and reports its prefix cache as rayapp KV events (block hashes chained the way the
ingress hashes a prompt, so the prefix router can match them). `rayapp.deployments.engines`
builds the rayapp one; `rayapp.vllm_ext.engine` the vLLM one.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from rayapp.blocks import BlockHash, KVEvent
from rayapp.engine.outputs import TokenLogprob
from rayapp.engine.request import EngineRequest
from rayapp.observability import Metric


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    # Prompt tokens whose KV came from a cache (the engine's own count) instead of being computed.
    cached_tokens: int


class UsageTally:
    """A request's usage, counted over the deltas it streams: where every backend and the ingress make `Usage`."""

    def __init__(self, prompt_tokens: int) -> None:
        self.prompt_tokens, self.completion_tokens = prompt_tokens, 0

    def add(self, token_ids: list[int]) -> None:
        self.completion_tokens += len(token_ids)

    def usage(self, cached_tokens: int) -> Usage:
        """The usage so far; cached tokens past the prompt (a moved answer's prompt holds output too) count as
        the prompt."""
        return Usage(self.prompt_tokens, self.completion_tokens, min(cached_tokens, self.prompt_tokens))


@dataclass(frozen=True)
class GenerateDelta:
    """What one of a request's answers produced since its previous delta. An answer's last delta carries its
    finish reason; the request's last delta (every answer finished) carries the usage."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    usage: Usage | None = None
    # One per token of `token_ids` when the request's SamplingParams ask for logprobs.
    logprobs: list[TokenLogprob] | None = None
    # Which of the request's `n` answers (SamplingParams.n) this is.
    index: int = 0

    @property
    def finished(self) -> bool:
        """Whether this answer is finished."""
        return self.finish_reason is not None

    @property
    def last(self) -> bool:
        """Whether this is the request's last delta."""
        return self.usage is not None


class EngineDeadError(RuntimeError):
    """The replica's engine stopped working: its requests must move to another replica, and the replica be replaced."""


class EngineBackend(Protocol):
    """What `LLMReplica` needs of an engine. Bad input raises ValueError (the ingress answers 400)."""

    # Tokens per KV page: the block size of the hashes in `EngineRequest.block_hashes` and in the KV events.
    block_size: int

    def generate(self, request: EngineRequest) -> AsyncIterator[GenerateDelta]:
        """Stream one request until it finishes; leaving the iterator early aborts it and frees its pages."""
        ...

    async def abort(self, request_id: str) -> None: ...

    async def stats(self) -> dict[str, float]:
        """Counters and gauges named as on `/metrics` (`prompt_tokens`, `num_running`, `pages_free`, ...)."""
        ...

    async def metrics(self) -> tuple[Metric, ...]:
        """What `stats` reports that `/metrics` shows (declared once, at start)."""
        ...

    async def take_kv_events(self) -> list[KVEvent]:
        """The prefix cache's changes since the last call (or the last snapshot)."""
        ...

    async def kv_snapshot(self) -> list[KVEvent]:
        """`AllCleared` and a `BlockStored` per block the backend knows it holds; drops the pending events."""
        ...

    async def cached_blocks(self) -> list[BlockHash]:
        """Every block the prefix cache holds now, as the index names them; changes nothing (the pending events
        stay): what a check of the PrefixIndex against the replica's own state reads."""
        ...

    async def check_health(self) -> None:
        """Raise EngineDeadError when the engine can no longer serve."""
        ...

    async def flush_tier(self) -> None:
        """Return once every block queued for the cluster KV tier is written (at once without a tier)."""
        ...

    def engine_pid(self) -> int | None:
        """The PID of the process that steps the engine (for an operator's `py-spy dump`, or a drill's kill);
        None when it steps in the replica's own process."""
        ...

    def shutdown(self) -> None: ...

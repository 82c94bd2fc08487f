"""`ScriptedBackend`: an `EngineBackend` without a model, for the served tests of the ingress, the router and the
metrics. A Serve application over it starts in seconds, where one over a real engine loads a model first.

It keeps the contract the real backends keep, which is what those tests judge: deltas streamed token by token at
a steady pace (answers interleaved by `index`, usage on the last), leaving the stream aborts the request and frees
its pages, a paged prefix cache matched by the ingress' salted block hashes (so `cached_tokens` says where a
conversation's pages are) with LRU eviction, KV events and snapshots for the router, and the engine's own stats
and metric declarations. Its answers are words picked from a hash of the prompt (and the answer's index): the
same for the same request, so a moved answer continues exactly where it was cut.
"""

from __future__ import annotations

import asyncio
import math
import zlib
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from rayapp.blocks import AllCleared, BlockHash, BlockRemoved, BlockStored, KVEvent
from rayapp.config import AppConfig
from rayapp.drivers.backend import GenerateDelta, UsageTally
from rayapp.engine.llm_engine import METRICS
from rayapp.engine.outputs import TokenLogprob
from rayapp.engine.request import EngineRequest
from rayapp.models.loader import ModelSpec, resolve_model
from rayapp.models.tokenizer import load_tokenizer
from rayapp.observability import Metric

WORDS = [" the", " sea", " river", " stone", " cloud", " light", " north", " green", " small", " warm", " tree"]


@dataclass
class _Block:
    parent: BlockHash | None
    token_ids: tuple[int, ...]
    refs: int = 0


@dataclass
class _Held:
    """What one running request holds: its prompt blocks in the cache and its private pages."""

    blocks: list[BlockHash] = field(default_factory=list)
    private: int = 0


class _PrefixCache:
    """A pool of `num_pages` pages; a full prompt block, once stored, is a page of the cache, shared by every
    request whose hashes name it and kept (evictable, least recently used first) after they finish."""

    def __init__(self, num_pages: int, block_size: int) -> None:
        self.num_pages, self.block_size = num_pages, block_size
        self.blocks: OrderedDict[BlockHash, _Block] = OrderedDict()
        self.private = 0
        self.events: list[KVEvent] = []

    @property
    def free(self) -> int:
        return self.num_pages - self.private - sum(b.refs > 0 for b in self.blocks.values())

    @property
    def cached(self) -> int:
        return sum(b.refs == 0 for b in self.blocks.values())

    def admit(self, hashes: list[BlockHash], token_ids: list[int], total_tokens: int) -> tuple[_Held, int] | None:
        """Hold the pages of a request of `total_tokens` (prompt and answers): its prompt's full blocks in the cache
        (the cached ones shared, the others stored now), the rest private. The held pages and the number of blocks
        that were cached; None (holding nothing) when the pool cannot take it now."""
        bs = self.block_size
        hits = 0
        while hits < len(hashes) and hashes[hits] in self.blocks:
            hits += 1
        private = math.ceil(total_tokens / bs) - len(hashes)
        # Its private pages and new blocks take empty pages, or those of cached blocks no one holds (LRU first).
        new = private + len(hashes) - hits
        empty = self.num_pages - self.private - len(self.blocks)
        mine = set(hashes[:hits])
        evictable = [h for h, b in self.blocks.items() if b.refs == 0 and h not in mine]
        if new > empty + len(evictable):
            return None
        for victim in evictable[: max(0, new - empty)]:
            del self.blocks[victim]
            self.events.append(BlockRemoved((victim,)))
        for i, h in enumerate(hashes):
            if i >= hits:
                ids = tuple(token_ids[i * bs : (i + 1) * bs])
                parent = hashes[i - 1] if i else None
                self.blocks[h] = _Block(parent, ids)
                self.events.append(BlockStored((h,), parent, ids, bs))
            self.blocks[h].refs += 1
            self.blocks.move_to_end(h)
        self.private += private
        return _Held(list(hashes), private), hits

    def release(self, held: _Held) -> None:
        for h in held.blocks:  # held blocks are never evicted
            self.blocks[h].refs -= 1
        self.private -= held.private

    def snapshot(self) -> list[KVEvent]:
        self.events.clear()
        stored = [BlockStored((h,), b.parent, b.token_ids, self.block_size) for h, b in self.blocks.items()]
        return [AllCleared(), *stored]


class ScriptedBackend:
    """The scripted engine (see the module docstring); class attributes set its pace and its pool."""

    num_pages = 512
    token_interval_s = 0.05
    # An answer ends with the end-of-sequence token after this many tokens (unless ignore_eos, or max_tokens first).
    answer_tokens = 24

    def __init__(self, config: AppConfig) -> None:
        path = resolve_model(config.model, config.revision)
        self.tokenizer = load_tokenizer(path, config.chat_template)
        encoded = [self.tokenizer.encode(word, add_special_tokens=False) for word in WORDS]
        self.words = [ids[0] for ids in encoded if len(ids) == 1]
        self.eos = self.tokenizer.eos_token_id
        self.block_size = config.kv_block_size()
        self.max_model_len = config.context_length(ModelSpec.from_dir(path).max_position_embeddings)
        self.cache = _PrefixCache(self.num_pages, self.block_size)
        self.room = asyncio.Condition()
        self.running = self.waiting = 0
        self.counters = {"prompt_tokens": 0, "cached_prompt_tokens": 0, "generation_tokens": 0, "num_preemptions": 0}

    @classmethod
    def from_app_config(cls, config: AppConfig) -> ScriptedBackend:
        return cls(config)

    def script(self, prompt: list[int], index: int, length: int) -> list[int]:
        """Answer `index` to `prompt`, `length` tokens long."""
        start = zlib.crc32(repr(prompt).encode()) + 7 * index
        return [self.words[(start + 3 * i) % len(self.words)] for i in range(length)]

    async def generate(self, request: EngineRequest) -> AsyncIterator[GenerateDelta]:
        ids, params = request.prompt_token_ids, request.sampling
        room = self.max_model_len - len(ids)
        if room <= 0:
            raise ValueError(f"the prompt has {len(ids)} tokens; this model takes at most {self.max_model_len - 1}")
        max_new = room if params.max_tokens is None else min(params.max_tokens, room)
        # A moved answer's last `delivered_tokens` prompt tokens are its own output: the script goes on after them.
        asked = ids[: len(ids) - request.delivered_tokens]
        done = request.delivered_tokens
        ends = max_new if params.ignore_eos else min(max_new, max(0, max(self.answer_tokens, params.min_tokens) - done))
        answers = [self.script(asked, k, done + max_new)[done:] for k in range(params.n)]
        held, hits = await self._admit(request.block_hashes or [], ids, len(ids) + params.n * max_new)
        tally, cached = UsageTally(len(ids)), hits * self.block_size
        self.counters["prompt_tokens"] += len(ids)
        self.counters["cached_prompt_tokens"] += cached
        self.running += 1
        try:
            # The answers' tokens, and their end-of-sequence token when it comes before max_tokens.
            for step in range(min(ends + 1, max_new)):
                await asyncio.sleep(self.token_interval_s)
                for k, answer in enumerate(answers):
                    token = self.eos if step == ends else answer[step]
                    finish = "stop" if step == ends else "length" if step == max_new - 1 else None
                    tally.add([token])
                    self.counters["generation_tokens"] += 1
                    text = "" if step == ends else self.tokenizer.decode([token])
                    usage = tally.usage(cached) if finish and k == params.n - 1 else None
                    yield GenerateDelta(text, [token], finish, usage, self._logprobs(token, params.logprobs), k)
        finally:
            self.running -= 1
            self.cache.release(held)
            async with self.room:
                self.room.notify_all()

    async def _admit(self, hashes: list[BlockHash], ids: list[int], total_tokens: int) -> tuple[_Held, int]:
        if math.ceil(total_tokens / self.block_size) > self.num_pages:
            raise ValueError(f"{total_tokens} tokens need more than the {self.num_pages} pages: lower max_tokens")
        self.waiting += 1
        try:
            async with self.room:
                while (admitted := self.cache.admit(hashes, ids, total_tokens)) is None:
                    await self.room.wait()
        finally:
            self.waiting -= 1
        return admitted

    def _logprobs(self, token: int, k: int | None) -> list[TokenLogprob] | None:
        if k is None:
            return None
        top = [(token, -0.25), *((w, -2.0 - i) for i, w in enumerate(w for w in self.words if w != token))]
        return [TokenLogprob(token, -0.25, tuple(top[:k]))]

    async def abort(self, request_id: str) -> None:
        """Leaving a request's stream aborts it (its pages are freed as the stream closes)."""

    async def stats(self) -> dict[str, float]:
        cache = self.cache
        return {
            **self.counters, "num_running": self.running, "num_waiting": self.waiting,
            "pages_total": cache.num_pages, "pages_free": cache.free, "pages_cached": cache.cached,
        }  # fmt: skip

    async def metrics(self) -> tuple[Metric, ...]:
        return METRICS

    async def take_kv_events(self) -> list[KVEvent]:
        events, self.cache.events = self.cache.events, []
        return events

    async def kv_snapshot(self) -> list[KVEvent]:
        return self.cache.snapshot()

    async def cached_blocks(self) -> list[BlockHash]:
        return list(self.cache.blocks)

    async def check_health(self) -> None:
        """Always healthy: a dead engine is the real backends' to show."""

    async def flush_tier(self) -> None:
        """No tier."""

    def engine_pid(self) -> None:
        """The script runs in the replica's process."""

    def shutdown(self) -> None:
        """Nothing runs beside the replica."""

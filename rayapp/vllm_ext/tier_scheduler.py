"""The scheduler half of `RayappKVTierConnector`: which tier blocks a request loads, which pages are saved.

Runs in vLLM's engine core process, on the scheduler's thread, so it never waits long: the catalog
is asked once per admission, only when the tier could add at least `min_load_tokens` to vLLM's
local hit, on a thread of its own with a deadline (`LOOKUP_DEADLINE_S`). A lookup past its deadline
is a miss, and while it is still out every later request misses without asking, so a frozen
database costs one deadline, not one per request.

Saves: every step, the full blocks a scheduled request completed in that step (prompt or output),
beyond those it found cached (in vLLM's prefix cache or the tier), go to the worker as `BlockRun`s.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rayapp.blocks import BlockHash, hash_block
from rayapp.kvtier.catalog import Catalog
from rayapp.kvtier.records import ChainMatch
from rayapp.vllm_ext.tier_protocol import BlockRun, Load, TierMetadata, TierSettings

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger("rayapp.kvtier")


@dataclass
class _Tracked:
    """A request the connector has seen, from its first admission to its end."""

    request: Request
    hashes: list[BlockHash] = field(default_factory=list)
    # (local hit, tokens) of the last lookup, and its answer: asked again only when the request changed.
    lookup: tuple[tuple[int, int], int] | None = None
    match: ChainMatch = ChainMatch()
    load: Load | None = None
    loaded_tokens: int = 0
    missed_tokens: int = 0
    # Blocks before this one are cached or saved already; None until the request is first scheduled.
    saved_upto: int | None = None
    # A load of this request came up short: vLLM recomputes, and the tier is not offered to it again (the
    # catalog may well give the same answer, and the request would go round and round).
    load_failed: bool = False


class TierScheduler:
    def __init__(self, settings: TierSettings, vllm_config: VllmConfig) -> None:
        self.settings = settings
        self.block_size = vllm_config.cache_config.block_size
        model = vllm_config.model_config
        representation_dim = model.get_num_kv_heads(vllm_config.parallel_config) * model.get_head_size()
        self.catalog = Catalog(settings.dsn, representation_dim)
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rayapp-kvtier-lookup")
        self._stuck: concurrent.futures.Future | None = None
        self._requests: dict[str, _Tracked] = {}
        self._loads: list[Load] = []
        self._events: list[KVCacheEvent] = []
        self.counters = {"lookups": 0, "lookups_timed_out": 0, "lookups_skipped": 0}
        # Open the connection pool (and the schema) now, not on the first request's deadline.
        self._pool.submit(lambda: self.catalog.available).result()

    def _hashes(self, tracked: _Tracked, num_blocks: int) -> list[BlockHash]:
        """Rayapp's chain over the request's first `num_blocks` full blocks (extended as the request grows)."""
        tokens = tracked.request.all_token_ids
        salt = tracked.request.cache_salt or ""
        bs, hashes = self.block_size, tracked.hashes
        while len(hashes) < num_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block(parent, tuple(tokens[i * bs : (i + 1) * bs]), (self.settings.model_id, salt)))
        return hashes[:num_blocks]

    def _present(self, hashes: Sequence[BlockHash]) -> ChainMatch:
        """The leading blocks of `hashes` the tier holds, and where, as far as the catalog answers in time."""
        if self._stuck is not None and not self._stuck.done():
            self.counters["lookups_skipped"] += 1
            return ChainMatch()
        self.counters["lookups"] += 1
        self._stuck = None
        future = self._pool.submit(self.catalog.longest_chain, list(hashes))
        try:
            return future.result(timeout=self.settings.lookup_deadline_s)
        except concurrent.futures.TimeoutError:
            self.counters["lookups_timed_out"] += 1
            logger.warning(
                "cluster KV tier: the catalog did not answer within %.2f s; requests recompute until it does",
                self.settings.lookup_deadline_s,
            )
            self._stuck = future
            return ChainMatch()
        except Exception:  # the tier is a cache: an unexpected error is a miss
            logger.exception("cluster KV tier: catalog lookup failed")
            return ChainMatch()

    def matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        """Tokens past vLLM's (block-aligned) local hit that the tier holds and that pay to load."""
        tracked = self._requests.setdefault(request.request_id, _Tracked(request))
        if tracked.load_failed:
            return 0
        # vLLM computes at least the last token itself.
        num_blocks = (request.num_tokens - 1) // self.block_size
        if num_blocks * self.block_size - num_computed_tokens < self.settings.min_load_tokens:
            return 0
        key = (num_computed_tokens, request.num_tokens)
        if tracked.lookup is not None and tracked.lookup[0] == key:
            return tracked.lookup[1]
        tracked.match = self._present(self._hashes(tracked, num_blocks))
        gain = tracked.match.num_present * self.block_size - num_computed_tokens
        tokens = gain if gain >= self.settings.min_load_tokens else 0
        tracked.lookup = (key, tokens)
        return tokens

    def plan_load(self, request: Request, block_ids: Sequence[int], num_external_tokens: int) -> None:
        """vLLM allocated pages for the tokens `matched_tokens` offered: load them in the next step."""
        tracked = self._requests[request.request_id]
        assert tracked.lookup is not None
        start = tracked.lookup[0][0] // self.block_size
        end = start + num_external_tokens // self.block_size
        bs = self.block_size
        tracked.load = Load(
            request_id=request.request_id,
            parent=tracked.hashes[start - 1] if start else None,
            token_ids=tuple(request.all_token_ids[start * bs : end * bs]),
            locations=tracked.match.locations[start:end],
            block_ids=tuple(block_ids[start:end]),
            cache_salt=request.cache_salt or "",
        )
        self._loads.append(tracked.load)

    def build_metadata(self, scheduler_output: SchedulerOutput, kv_cache_manager: KVCacheManager) -> TierMetadata:
        """This step's loads, and the runs of blocks its scheduled requests complete."""
        metadata = TierMetadata(loads=self._loads)
        self._loads = []
        computed = {r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs}
        cached = scheduler_output.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        for req_id, num_scheduled in scheduler_output.num_scheduled_tokens.items():
            tracked = self._requests.get(req_id)
            if tracked is None or req_id not in computed:
                continue
            run = self._save_run(tracked, computed[req_id], num_scheduled, kv_cache_manager)
            if run is not None:
                metadata.saves.append(run)
        return metadata

    def _save_run(
        self, tracked: _Tracked, num_computed: int, num_scheduled: int, kv_cache_manager: KVCacheManager
    ) -> BlockRun | None:
        bs = self.block_size
        if tracked.saved_upto is None:  # what it found cached is in a cache already
            tracked.saved_upto = num_computed // bs
        # Output tokens of a step still running are not known yet (async scheduling): their block waits.
        full = min(num_computed + num_scheduled, len(tracked.request.all_token_ids)) // bs
        start = tracked.saved_upto
        if full <= start:
            return None
        tracked.saved_upto = full
        hashes = self._hashes(tracked, full)
        block_ids = kv_cache_manager.get_block_ids(tracked.request.request_id)[0]
        return BlockRun(
            block_ids=tuple(block_ids[start:full]),
            block_hashes=tuple(hashes[start:full]),
            parent=hashes[start - 1] if start else None,
            token_ids=tuple(tracked.request.all_token_ids[start * bs : full * bs]),
            cache_salt=tracked.request.cache_salt or "",
        )

    def update(self, output: KVConnectorOutput) -> None:
        """The worker's report of a step: loads that finished (and which pages failed), tier events."""
        for req_id in output.finished_recving or ():
            tracked = self._requests.get(req_id)
            if tracked is None or tracked.load is None:
                continue
            pages = tracked.load.block_ids
            bad = output.invalid_block_ids or set()
            loaded = next((i for i, page in enumerate(pages) if page in bad), len(pages))
            tracked.loaded_tokens = loaded * self.block_size
            tracked.missed_tokens = (len(pages) - loaded) * self.block_size
            tracked.load_failed = loaded < len(pages)
            tracked.load = None
        if output.kv_cache_events is not None:
            self._events.extend(output.kv_cache_events.get_all_events())

    def finish(self, request_id: str) -> tuple[int, int]:
        """Forget a finished request; the prompt tokens it loaded from the tier, and those offered but not loaded."""
        tracked = self._requests.pop(request_id, None)
        return (0, 0) if tracked is None else (tracked.loaded_tokens, tracked.missed_tokens)

    def take_events(self) -> list[KVCacheEvent]:
        events, self._events = self._events, []
        return events

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.catalog.close()

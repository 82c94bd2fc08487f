"""The worker half of `RayappKVTierConnector`: tier blocks into vLLM's pages, and pages into the tier.

Runs in vLLM's worker process, which joins the Ray cluster (the node's `KVTierStore` actor owns the
blocks) and keeps one `KVTierClient` for writes. Loads run on threads of their own, each request's
blocks fetched from the stores the scheduler's lookup named (no second catalog round trip, and
no wait on a database that froze since: a store that does not answer is a miss after
`LOAD_TIMEOUT_S`), verified (hash, parent, token ids, tenant, model by the tier's loader; dtype and shape
here) and copied into the pages vLLM allocated, while other requests keep stepping; the first block
that is missing or refused ends the load, and its pages and the rest are reported failed, so vLLM
recomputes them. Saves copy the step's newly full pages after the forward and queue them for the
client's writer thread: no decode step waits on the store or the database.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from typing import TYPE_CHECKING, Any

import ray
from vllm.distributed.kv_events import BlockRemoved as VLLMBlockRemoved
from vllm.distributed.kv_events import BlockStored as VLLMBlockStored
from vllm.distributed.kv_events import KVCacheEvent, KVConnectorKVEvents

from rayapp.blocks import BlockRemoved, BlockStored
from rayapp.kvtier import join_ray, pin_thread, spare_cores, threads_on
from rayapp.kvtier.client import KVTierClient
from rayapp.kvtier.loader import load_chain
from rayapp.kvtier.records import ChainMatch
from rayapp.vllm_ext.pages import PagedKV
from rayapp.vllm_ext.retrieval import note_pages_written
from rayapp.vllm_ext.tier_protocol import TIER_MEDIUM, BlockRun, Load, TierSettings

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger("rayapp.kvtier")
# Loads at once: each mostly waits on the object store, and copies with the GIL released.
LOAD_THREADS = 2


class TierEvents(KVConnectorKVEvents):
    """Cluster-tier events of one worker, for vLLM to carry to the scheduler (and its KV event stream)."""

    def __init__(self, events: list[KVCacheEvent]) -> None:
        self._events = events
        self._workers = 1

    def add_events(self, events: list[KVCacheEvent]) -> None:
        self._events.extend(events)

    def aggregate(self) -> TierEvents:
        return self

    def increment_workers(self, count: int = 1) -> None:
        self._workers += count

    def get_all_events(self) -> list[KVCacheEvent]:
        return self._events

    def get_number_of_workers(self) -> int:
        return self._workers

    def clear_events(self) -> None:
        self._events = []


def _vllm_event(event: BlockStored | BlockRemoved) -> KVCacheEvent:
    if isinstance(event, BlockStored):
        return VLLMBlockStored(
            block_hashes=list(event.block_hashes), parent_block_hash=event.parent_block_hash,
            token_ids=list(event.token_ids), block_size=event.block_size, lora_id=None, medium=TIER_MEDIUM,
            lora_name=None,
        )  # fmt: skip
    return VLLMBlockRemoved(block_hashes=list(event.block_hashes), medium=TIER_MEDIUM)


# The tier workers of this process (one per vLLM worker process), for `tier_stats`.
_WORKERS: list[TierWorker] = []


def tier_stats() -> dict[str, int]:
    """The counters of this process's tier clients (`rayapp.kvtier.client.METRICS`), summed."""
    total: dict[str, int] = {}
    for worker in list(_WORKERS):
        for name, n in worker.client.stats().items():
            total[name] = total.get(name, 0) + n
    return total


class TierWorker:
    def __init__(self, settings: TierSettings, vllm_config: VllmConfig) -> None:
        model = vllm_config.model_config
        self.num_kv_heads = model.get_num_kv_heads(vllm_config.parallel_config)
        self.head_dim = model.get_head_size()
        self.block_size = vllm_config.cache_config.block_size
        self._forward_context = vllm_config.compilation_config.static_forward_context
        # Ray's threads, the writer and the loads run on the cores vLLM keeps off its compute threads.
        self.spare_cores = spare_cores()
        with threads_on(self.spare_cores):
            if not ray.is_initialized():
                join_ray(settings.ray_address)
            self.client = KVTierClient(
                settings.tier_config(),
                settings.model_id,
                self.block_size,
                self.num_kv_heads * self.head_dim,
                node_id=settings.node_id,
            )
        self.pages: PagedKV | None = None
        self._pool = concurrent.futures.ThreadPoolExecutor(
            LOAD_THREADS, thread_name_prefix="rayapp-kvtier-load", initializer=pin_thread, initargs=(self.spare_cores,)
        )
        self._lock = threading.Lock()
        self._finished: dict[str, list[int]] = {}  # request id -> its pages that did not load
        self._failed_pages: set[int] = set()
        _WORKERS.append(self)

    def register(self, kv_caches: dict[str, Any]) -> None:
        """Take vLLM's KV caches. A layout `PagedKV` cannot read turns the tier off for this engine (one error
        in the log): nothing is saved, and every load the scheduler plans fails, so vLLM recomputes."""
        layer = self._forward_context.get(next(iter(kv_caches), ""))
        backend, isa = getattr(layer, "attn_backend", None), getattr(layer, "isa", None)
        try:
            self.pages = PagedKV.from_registered(
                kv_caches, self.block_size, self.num_kv_heads, self.head_dim, backend, isa
            )
        except ValueError as error:
            logger.error("cluster KV tier off for this engine: %s", error)

    def start_loads(self, loads: list[Load]) -> None:
        for load in loads:
            self._pool.submit(self._load, load)

    def _load(self, load: Load) -> None:
        loaded = 0 if self.pages is None else self._install(load)
        with self._lock:
            self._finished[load.request_id] = list(load.block_ids[loaded:])

    def _install(self, load: Load) -> int:
        """Fetch, check and copy in the load's blocks; how many leading ones made it."""
        loaded = 0
        try:
            match = ChainMatch(len(load.locations), load.locations)
            keys = (self.client.model_id, load.cache_salt)
            blocks = load_chain(match, load.token_ids, self.block_size, keys, load.parent)
            for block, page in zip(blocks, load.block_ids):
                if tuple(block.key.shape) != self.pages.block_shape or block.key.dtype != self.pages.dtype:
                    logger.warning(
                        "cluster KV tier block %#018x is %s %s, this engine's pages %s %s: recomputed",
                        block.block_hash, block.key.dtype, tuple(block.key.shape), self.pages.dtype,
                        self.pages.block_shape,
                    )  # fmt: skip
                    break
                self.pages.scatter(page, block.key, block.value)
                note_pages_written([page])  # the retrieval plugin's block representations of the page are stale
                loaded += 1
        except Exception:  # the tier is a cache: whatever went wrong, vLLM recomputes what did not load
            logger.exception("cluster KV tier: loading request %s failed", load.request_id)
        return loaded

    def finished_loads(self) -> set[str]:
        """Requests whose load ended since the last call; their failed pages go to `take_failed_blocks`."""
        with self._lock:
            finished, self._finished = self._finished, {}
            for pages in finished.values():
                self._failed_pages.update(pages)
        return set(finished)

    def take_failed_blocks(self) -> set[int]:
        with self._lock:
            failed, self._failed_pages = self._failed_pages, set()
        return failed

    def save(self, runs: list[BlockRun]) -> None:
        if self.pages is None:
            return
        for run in runs:
            key, value = self.pages.gather(run.block_ids)  # [L, n, bs, H, D] copies: the pages may be reused
            stored = BlockStored(run.block_hashes, run.parent, run.token_ids, self.block_size)
            self.client.write(stored, run.cache_salt, key, value)

    def take_events(self) -> TierEvents | None:
        events = self.client.take_events()
        return TierEvents([_vllm_event(e) for e in events]) if events else None

    def close(self) -> None:
        if self in _WORKERS:
            _WORKERS.remove(self)
        self._pool.shutdown(wait=True, cancel_futures=True)
        self.client.close()

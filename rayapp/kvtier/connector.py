"""The cluster KV tier as rayapp's engine sees it: one connector, asked by the scheduler once per admission.

Modelled on vLLM's `KVConnectorBase_V1` and its `WAITING_FOR_REMOTE_KVS` status. The tier itself
(`rayapp.kvtier.client.KVTierClient`) is handed to the engine as a `TierPort`, so the engine never imports Ray.

- Write-through: when the BlockManager caches full blocks, the connector copies their pages (all layers) out
  of the device pool on the engine thread, between steps, in one gather per run of blocks, and gives the copy
  to `TierPort.write`, which only queues it: encoding, the catalog and the object store happen on the tier's
  own thread, never on the decode path.
- Load at admission: right after its prefix match of the queue's front sequence (fresh, or preempted and
  readmitted), the scheduler asks `offer`. When the tier may continue the local prefix and was not asked
  for this sequence in this state yet, the blocks are fetched (`TierPort.fetch`: the catalog, then the
  object stores) on the connector's executor while the sequence waits in `WAITING_FOR_TIER`, out of the
  queue, so the steps go on; offline (no executor) they are fetched inline. A finished load puts the
  sequence back at the queue's front, where `offer` counts its fetched tokens; the scheduler lets the
  BlockManager decide room (`BlockManager.fits`) and then has them adopted (`adopt`).

What the connector guarantees: fetched blocks are installed into cached pages only by `adopt`, which the
scheduler calls in the admission step that allocates the sequence's pages, once the pool has room for the
whole sequence, so no step evicts them before the admission that uses them; it asks the tier again for a
sequence only after a preemption made the local cache lose more of it, never twice for the same local
prefix; and a failing tier is a miss (the prompt is computed), never an error. The middle of a long history
that sparse retrieval would offload goes to the host pool instead of device pages when a `HostPlacement` is
given (sparse retrieval's `HostResume`).
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from rayapp.blocks import BlockHash, BlockRemoved, BlockStored
from rayapp.engine.attention import StepInputs
from rayapp.engine.block_manager import BlockManager
from rayapp.engine.kv_pool import KVPool
from rayapp.engine.pages import PrefixMatch
from rayapp.engine.sequence import Sequence
from rayapp.observability import Metric, counters

if TYPE_CHECKING:
    from rayapp.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)

METRICS = counters(
    {
        "tier_loaded_tokens": "Of the cached prompt tokens, those loaded from the cluster KV tier",
        "tier_reloaded_tokens": "Tokens preempted sequences loaded back from the cluster KV tier, not recomputed",
    }
)


class TierBlock(Protocol):
    """One verified block from the tier (`rayapp.kvtier.codec.KVBlock` is one)."""

    block_hash: BlockHash
    parent_hash: BlockHash | None
    token_ids: tuple[int, ...]
    # key, value: [num_layers, block_size, num_kv_heads, head_dim]
    key: torch.Tensor
    value: torch.Tensor


class TierPort(Protocol):
    """What the engine needs from a cluster KV tier."""

    # Load only when the tier holds at least this many prompt tokens beyond the local prefix.
    min_load_tokens: int

    def write(self, stored: BlockStored, cache_salt: str, key: torch.Tensor, value: torch.Tensor) -> None:
        """Queue the blocks of `stored` for the tier; `key`, `value`: [num_layers, n, block_size, Hkv, D] on
        the CPU, owned by the callee. Must return at once."""
        ...

    def fetch(
        self, block_hashes: Seq[BlockHash], token_ids: Seq[int], cache_salt: str, start_block: int
    ) -> list[TierBlock]:
        """The verified tier blocks continuing `block_hashes[:start_block]` (block `start_block` first), or []
        when the tier holds fewer than `min_load_tokens` tokens past `start_block`. Blocking."""
        ...

    def take_events(self) -> list[BlockStored | BlockRemoved]:
        """The tier's changes since the last call, as `BlockStored` / `BlockRemoved` with `tier="cluster"`: blocks
        this engine wrote, and blocks that left the tier (for the prefix router)."""
        ...

    def stats(self) -> dict[str, int]:
        """The tier's own counters (blocks written, loaded...), named as `metrics` declares them."""
        ...

    def metrics(self) -> tuple[Metric, ...]: ...


class HostPlacement(Protocol):
    """Where a loaded history's middle goes when sparse retrieval would offload it (`rayapp.sparse.resume`)."""

    def host_range(self, seq: Sequence, start: int, num_pages: int) -> range:
        """The pages of `seq` that a load of its pages `[start, start + num_pages)` puts in the host pool."""
        ...

    def resume_to_host(self, seq: Sequence, pages: range, blocks: list[TierBlock]) -> bool:
        """Put `blocks` (one per page of `pages`) in the host pool as `seq`'s offloaded middle; False when full."""
        ...


@dataclass(frozen=True)
class TierAsk:
    """What a fetch needs of a sequence, copied on the engine thread: the fetch may run on another."""

    seq_id: str
    block_hashes: tuple[BlockHash, ...]  # the prompt's blocks a cache may serve (not the last token's)
    token_ids: tuple[int, ...]
    cache_salt: str
    local_blocks: int  # leading blocks the local cache held when asked


@dataclass(frozen=True)
class TierLoad:
    """The tier blocks continuing an ask's local prefix (block `ask.local_blocks` first; none on a miss)."""

    ask: TierAsk
    blocks: list[TierBlock]


class TierConnector:
    """Copies pages between one engine's KV pool and its `TierPort`; loads at admission. Engine thread only,
    except `fetch`. It is also a `KVExtension`: it counts the tokens its loads served after each step."""

    def __init__(
        self, pool: KVPool, block_manager: BlockManager, tier: TierPort, placement: HostPlacement | None = None
    ) -> None:
        if not block_manager.enable_prefix_caching:
            raise ValueError("the cluster KV tier needs enable_prefix_caching=True: tier blocks are cached pages")
        self.pool = pool
        self.placement = placement
        self.block_manager = block_manager
        self.tier = tier
        self.block_size = block_manager.block_size
        self._executor: concurrent.futures.Executor | None = None
        self._wake: Callable[[], None] = lambda: None
        self._finished: queue.SimpleQueue[TierLoad] = queue.SimpleQueue()
        # By sequence id: loads in flight, fetched loads waiting to be installed, the prompt tokens the latest
        # install covered (until the step that admitted it counts them), and (preemptions, local blocks) when
        # the tier was last asked.
        self._loading: dict[str, Sequence] = {}
        self._fetched: dict[str, TierLoad] = {}
        self._installed: dict[str, tuple[int, int]] = {}
        self._asked: dict[str, tuple[int, int]] = {}
        self.counters = {"tier_loaded_tokens": 0, "tier_reloaded_tokens": 0}

    def load_on(self, executor: concurrent.futures.Executor, wake: Callable[[], None]) -> None:
        """Fetch on `executor` from now on (the step loop's driver); `wake()` is called when a load finished."""
        self._executor, self._wake = executor, wake

    def attach(self) -> None:
        """Start writing full blocks through to the tier (`LLMEngine.attach_tier` calls it)."""
        self.block_manager.on_stored = self._write_through

    def detach(self) -> None:
        """Stop writing through (the engine goes on without the tier)."""
        self.block_manager.on_stored = None

    # --- admission (the scheduler) ----------------------------------------------------------------------------

    def offer(self, seq: Sequence, prefix: PrefixMatch) -> int | None:
        """Called once per admission attempt of the queue's front sequence, right after its prefix match: the
        prompt tokens fetched blocks hold past `prefix` (0: none), or None while they are being fetched."""
        load = self._fetched.get(seq.seq_id)
        if load is not None and load.ask.local_blocks * self.block_size != prefix.num_tokens:
            # The local cache changed while the load waited: ask again for what it holds now.
            del self._fetched[seq.seq_id]
            load = None
        if load is None:
            if not self._worth_asking(seq, prefix):
                return 0
            ask = self.ask(seq, prefix)
            if self._executor is not None:
                self._loading[seq.seq_id] = seq
                self._executor.submit(self._fetch_in_background, ask)
                return None
            load = self._fetched[seq.seq_id] = self.fetch(ask)
        if not load.blocks:
            del self._fetched[seq.seq_id]
        return len(load.blocks) * self.block_size

    def adopt(self, seq: Sequence, prefix: PrefixMatch) -> PrefixMatch:
        """Install the blocks `offer` counted (once the BlockManager made room for the whole sequence); returns
        the prefix match extended over them."""
        load = self._fetched.pop(seq.seq_id, None)
        if load is None:
            return prefix
        self.install(seq, load, prefix)
        return self.block_manager.match_prefix(seq, prefix)

    def take_finished(self) -> list[Sequence]:
        """The sequences whose load finished since the last call (not those aborted meanwhile), their blocks
        kept for their next `admit`."""
        done = []
        while not self._finished.empty():
            load = self._finished.get()
            seq = self._loading.pop(load.ask.seq_id, None)
            if seq is not None:
                self._fetched[seq.seq_id] = load
                done.append(seq)
        return done

    def has_finished(self) -> bool:
        """Whether a load finished that `take_finished` has not taken (any thread)."""
        return not self._finished.empty()

    # --- the load's parts -------------------------------------------------------------------------------------

    def ask(self, seq: Sequence, prefix: PrefixMatch) -> TierAsk:
        """Engine thread: note that the tier is asked for `seq` now, and copy what the fetch needs."""
        local = prefix.num_tokens // self.block_size
        self._asked[seq.seq_id] = (seq.num_preemptions, local)
        usable = (seq.num_tokens - 1) // self.block_size  # the last prompt token is always computed
        hashes = tuple(seq.block_hashes[:usable])  # filled by the prefix match
        return TierAsk(seq.seq_id, hashes, tuple(seq.token_ids), seq.cache_salt, local)

    def fetch(self, ask: TierAsk) -> TierLoad:
        """The tier blocks continuing the local prefix, when that beats recompute. Any thread; blocking."""
        if len(ask.block_hashes) <= ask.local_blocks:
            return TierLoad(ask, [])
        try:
            blocks = self.tier.fetch(ask.block_hashes, ask.token_ids, ask.cache_salt, ask.local_blocks)
        except Exception:  # the tier is a cache: whatever went wrong, the prompt is computed instead
            logger.exception("cluster KV tier: fetching blocks for sequence %s failed", ask.seq_id)
            blocks = []
        return TierLoad(ask, blocks)

    def install(self, seq: Sequence, load: TierLoad, local: PrefixMatch) -> tuple[int, int]:
        """Write `load`'s blocks into free pages as cached blocks, after `local` (`seq`'s prefix match this
        step); returns the prompt token range they cover.

        Stops at a block whose shape or dtype differ from this engine's pages (another dtype's K/V would change
        the output) or that is no longer the one `seq` needs; installs nothing when the local cache changed
        since the ask. The middle of a prompt that sparse retrieval offloads goes straight to the host pool
        (the `HostPlacement`): only its init and window pages take device pages.
        """
        bs, start, blocks = self.block_size, load.ask.local_blocks, load.blocks
        if not blocks or local.num_tokens != start * bs:
            return (0, 0)
        pool = self.pool
        usable: list[TierBlock] = []
        for i, block in enumerate(blocks, start=start):
            fits = tuple(block.key.shape) == pool.page_shape and block.key.dtype == pool.k.dtype
            if not fits or i >= len(seq.block_hashes) or block.block_hash != seq.block_hashes[i]:
                break
            usable.append(block)
        parent = seq.block_hashes[start - 1] if start else None
        placement = self.placement
        host = range(0) if placement is None else placement.host_range(seq, start, len(usable))
        head = self._adopt(usable[: host.start - start] if host else usable, parent, local.page_ids)
        end = start + len(head)
        if host and len(head) == host.start - start:
            middle = usable[host.start - start : host.stop - start]
            if placement.resume_to_host(seq, host, middle):
                tail = self._adopt(usable[host.stop - start :], middle[-1].block_hash, (*local.page_ids, *head))
                end = host.stop + len(tail)
        self._installed[seq.seq_id] = (start * bs, end * bs)
        return (start * bs, end * bs)

    def load_now(self, seq: Sequence) -> tuple[int, int]:
        """Ask, fetch and install `seq`'s blocks on the calling thread, for a sequence not yet queued (tests and
        benchmarks look at a loaded history before it runs); its admission then does not ask again."""
        prefix = self.block_manager.match_prefix(seq)
        return self.install(seq, self.fetch(self.ask(seq, prefix)), prefix)

    # --- as an extension: counting, forgetting ------------------------------------------------------------------

    def min_recompute_tokens(self, seq: Sequence) -> int:
        return 1

    def keeps_own_layout(self, seq: Sequence) -> bool:
        return False

    def reserve(self, seq: Sequence, num_new_tokens: int) -> None:
        """The BlockManager holds every page a load fills."""

    def begin_step(self) -> None:
        """Nothing to prepare: loads are installed at admission."""

    def plan(self, step: StepInputs, decode_rows: list[int]) -> None:
        """Nothing in the step's attention: loaded blocks are ordinary cached pages."""

    def after_step(self, seqs: list[Sequence]) -> None:
        """Count what the prefix match of sequences admitted with installed blocks took from them."""
        if not self._installed:
            return
        for seq in seqs:
            span = self._installed.pop(seq.seq_id, None)
            if span is not None:
                start, end = span
                key = "tier_reloaded_tokens" if seq.num_preemptions else "tier_loaded_tokens"
                self.counters[key] += max(0, min(end, seq.num_cached_tokens) - start)

    def drop(self, seq: Sequence) -> None:
        """Forget `seq` at its end; at a preemption, keep what was asked (asked again only if the cache lost
        more of it)."""
        if seq.is_finished:
            self._asked.pop(seq.seq_id, None)
        for state in (self._loading, self._fetched, self._installed):
            state.pop(seq.seq_id, None)

    def stats(self) -> dict[str, int]:
        return {**self.counters, **self.tier.stats()}

    def metrics(self) -> tuple[Metric, ...]:
        return METRICS + self.tier.metrics()

    def take_events(self) -> list[BlockStored | BlockRemoved]:
        """Blocks written to or gone from the tier since the last call (for the prefix router)."""
        return self.tier.take_events()

    # --- internals --------------------------------------------------------------------------------------------

    def _worth_asking(self, seq: Sequence, prefix: PrefixMatch) -> bool:
        local = prefix.num_tokens // self.block_size
        if (seq.num_tokens - 1) // self.block_size <= local:
            return False  # the local cache serves all a cache can
        asked = self._asked.get(seq.seq_id)
        # Asked since this preemption (or since it arrived), and the cache has lost nothing more since.
        return asked is None or asked[0] != seq.num_preemptions or local < asked[1]

    def _fetch_in_background(self, ask: TierAsk) -> None:
        self._finished.put(self.fetch(ask))
        self._wake()

    def _adopt(self, blocks: list[TierBlock], parent: BlockHash | None, keep: tuple[int, ...]) -> tuple[int, ...]:
        """Cached pages for the chain `blocks` (after `parent`), their K/V written in; as many as fit."""
        if not blocks:
            return ()
        page_ids = self.block_manager.adopt_cached_blocks(
            [b.block_hash for b in blocks], parent, [b.token_ids for b in blocks], keep=keep
        )
        if page_ids:
            n = len(page_ids)
            # [L, n, bs, Hkv, D] scattered into the pool's page dimension, all layers at once.
            key = torch.stack([b.key for b in blocks[:n]], dim=1)
            value = torch.stack([b.value for b in blocks[:n]], dim=1)
            self.pool.scatter(page_ids, key, value)
        return tuple(page_ids)

    def _write_through(self, stored: BlockStored, cache_salt: str) -> None:
        page_ids = [self.block_manager.cached_page(h) for h in stored.block_hashes]
        # One gather per run of blocks: [L, n, bs, Hkv, D], a copy the tier owns (the pages get reused).
        key, value = (kv.to("cpu") for kv in self.pool.gather(page_ids))
        self.tier.write(stored, cache_salt, key, value)


def connect(engine: LLMEngine, tier: TierPort) -> TierConnector:
    """Attach `tier` to `engine` through a connector of its own; with sparse retrieval on, loaded histories it
    would offload go to its host pool."""
    sparse = engine.extension("sparse")
    placement = None if sparse is None else sparse.resume
    connector = TierConnector(engine.runner.pool, engine.block_manager, tier, placement)
    engine.attach_tier(connector)
    return connector

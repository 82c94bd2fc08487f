"""Continuous batching with chunked prefill and preemption by recompute."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

from rayapp.config import SchedulerConfig
from rayapp.engine.block_manager import BlockManager
from rayapp.engine.pages import PrefixMatch
from rayapp.engine.sequence import Sequence, SequenceStatus


class PageReserver(Protocol):
    """An extension that may hold a sequence's pages in a layout of its own (`KVExtension.reserve`)."""

    def reserve(self, seq: Sequence, num_new_tokens: int) -> bool | None:
        """Room for `num_new_tokens` more tokens of `seq`: True or False when this extension holds its pages (it
        took the room, or could not), None when the BlockManager does."""
        ...


class AdmissionConnector(Protocol):
    """An external KV source asked at every admission, right after the prefix match (vLLM's
    `KVConnectorBase_V1`): it offers tokens, the BlockManager decides room, and the connector adopts them."""

    def offer(self, seq: Sequence, prefix: PrefixMatch) -> int | None:
        """The tokens it holds ready to continue `prefix` (0: none), or None while it fetches them (`seq` waits
        out of the queue until `take_finished` gives it back). Installs nothing."""
        ...

    def adopt(self, seq: Sequence, prefix: PrefixMatch) -> PrefixMatch:
        """Put the offered blocks into cached pages; returns `prefix` extended over them."""
        ...

    def take_finished(self) -> list[Sequence]: ...

    def has_finished(self) -> bool: ...


@dataclass
class ScheduledBatch:
    """One step's work: `num_new_tokens[i]` tokens of `seqs[i]`, starting at its computed count.

    Sequences with one new token come first (`num_decodes` of them): the model runner sends them
    through the decode kernel and the rest through the prefill kernel.
    """

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    num_decodes: int = 0
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)


class Scheduler:
    """Decides, at each step boundary, which sequences compute how many tokens.

    Every step spends at most `max_num_batched_tokens`: running sequences that decode are served
    first, then running prefills (a long prompt advances one chunk per step, so it never stalls
    decodes for more than one chunk), then waiting sequences are admitted in arrival order. When
    pages run out, the newest running sequence is preempted: its pages are freed (they stay in
    the prefix cache, so recomputing is mostly cache hits) and it goes back to the waiting front.
    With a cluster tier, its connector is asked at every admission, right after the prefix match
    (`AdmissionConnector.offer`): a sequence whose blocks the tier is fetching waits in `WAITING_FOR_TIER`, out
    of the queue, and comes back to the queue's front when they are in; offered blocks are adopted once the
    BlockManager has room for the whole sequence, so no step evicts them before the admission that uses them.
    """

    def __init__(
        self, config: SchedulerConfig, block_manager: BlockManager, reservers: Iterable[PageReserver] = ()
    ) -> None:
        """`reservers`: the engine's extensions (a live view: the engine may rebuild them)."""
        self.config = config
        self.block_manager = block_manager
        self.reservers = reservers
        # The cluster tier's connector (`LLMEngine.attach_tier`), asked at each admission.
        self.connector: AdmissionConnector | None = None
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # Sequences in WAITING_FOR_TIER, by id: taken out of `waiting` while the tier loads their blocks.
        self.loading: dict[str, Sequence] = {}

    def add(self, seq: Sequence, front: bool = False) -> None:
        if front:
            self.waiting.appendleft(seq)
        else:
            self.waiting.append(seq)

    @property
    def is_full(self) -> bool:
        """Whether the running batch holds `max_num_seqs` sequences."""
        return len(self.running) >= self.config.max_num_seqs

    def add_running(self, seq: Sequence) -> None:
        """Put a sequence that already holds its pages (a fork) in the running batch (check `is_full` first)."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def has_work(self) -> bool:
        """Whether a step has anything to schedule (sequences loading from the tier come back when loaded)."""
        return bool(self.waiting or self.running) or (self.connector is not None and self.connector.has_finished())

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        if self.connector is not None:
            for seq in self.connector.take_finished():  # loaded: back to the front, where it left the queue
                del self.loading[seq.seq_id]
                seq.status = SequenceStatus.WAITING
                self.waiting.appendleft(seq)
        budget = self.config.max_num_batched_tokens
        chosen: dict[str, int] = {}
        # Decodes first, then prefills, each in arrival order.
        order = sorted(self.running, key=lambda s: s.num_tokens - s.num_computed_tokens > 1)
        for seq in order:
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            if budget == 0:
                break
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self._allocate(seq, n):
                victim = next(s for s in reversed(self.running) if s.status is SequenceStatus.RUNNING)
                self._preempt(victim)
                batch.preempted.append(victim)
                budget += chosen.pop(victim.seq_id, 0)
                if victim is seq:
                    break
            else:
                chosen[seq.seq_id] = n
                budget -= n
        if not batch.preempted:
            self._admit(budget, chosen)
        self.running = [s for s in self.running if s.status is SequenceStatus.RUNNING]
        for seq in sorted(self.running, key=lambda s: chosen.get(s.seq_id, 0) != 1):
            if seq.seq_id in chosen:
                batch.seqs.append(seq)
                batch.num_new_tokens.append(chosen[seq.seq_id])
        batch.num_decodes = sum(1 for n in batch.num_new_tokens if n == 1)
        return batch

    def _allocate(self, seq: Sequence, n: int) -> bool:
        for reserver in self.reservers:
            reserved = reserver.reserve(seq, n)
            if reserved is not None:
                return reserved
        return self.block_manager.allocate(seq, n)

    def _admit(self, budget: int, chosen: dict[str, int]) -> None:
        while self.waiting and budget > 0 and not self.is_full:
            seq = self.waiting[0]
            prefix = self.block_manager.match_prefix(seq)
            if self.connector is not None:
                offered = self.connector.offer(seq, prefix)
                if offered is None:
                    self.waiting.popleft()
                    seq.status = SequenceStatus.WAITING_FOR_TIER
                    self.loading[seq.seq_id] = seq
                    continue
                if offered:
                    if not self.block_manager.fits(seq, prefix):
                        break  # its blocks wait for room: nothing behind it jumps the queue
                    prefix = self.connector.adopt(seq, prefix)
            n = min(seq.num_tokens - prefix.num_tokens, budget)
            if not self.block_manager.allocate(seq, n, prefix):
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            chosen[seq.seq_id] = n
            budget -= n

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """End a sequence (done, stopped or aborted) and release its pages."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING_FOR_TIER:
            del self.loading[seq.seq_id]
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

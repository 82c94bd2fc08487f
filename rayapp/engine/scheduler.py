"""Continuous batching with chunked prefill and preemption by recompute."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from rayapp.config import SchedulerConfig
from rayapp.engine.block_manager import BlockManager
from rayapp.engine.sequence import Sequence, SequenceStatus


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
    With a cluster tier, the engine may park such a sequence at its readmission (`park_before_admit`)
    until the blocks the cache lost meanwhile are fetched back.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        reserve_compacted: Callable[[Sequence, int], bool] | None = None,
    ) -> None:
        self.config = config
        self.block_manager = block_manager
        # Grows a compacted sequence (layer-wise compression), whose pages are not a token-ordered table.
        self.reserve_compacted = reserve_compacted
        # Asked before the queue's front sequence is admitted: True when the engine parked it instead (to
        # fetch blocks of it the local cache lost back from the cluster tier) or holds it back this step.
        self.park_before_admit: Callable[[Sequence], bool] | None = None
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # Preempted sequences taken out of `waiting` while their blocks are fetched back (`park`).
        self.parked: dict[str, Sequence] = {}

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
        """Whether a step has anything to schedule (parked sequences wait for `unpark`)."""
        return bool(self.waiting or self.running)

    def park(self, seq: Sequence) -> None:
        """Hold a preempted (waiting) sequence out of admission until `unpark`."""
        self.waiting.remove(seq)
        self.parked[seq.seq_id] = seq

    def unpark(self, seq: Sequence) -> None:
        """Put a parked sequence back at the front of the queue, where preemption left it."""
        del self.parked[seq.seq_id]
        self.waiting.appendleft(seq)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
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
        if not seq.compacted:
            return self.block_manager.allocate(seq, n)
        if self.reserve_compacted is None:
            raise RuntimeError(f"sequence {seq.seq_id} is compacted but the scheduler has no reserve_compacted")
        return self.reserve_compacted(seq, n)

    def _admit(self, budget: int, chosen: dict[str, int]) -> None:
        while self.waiting and budget > 0 and not self.is_full:
            seq = self.waiting[0]
            if self.park_before_admit is not None and self.park_before_admit(seq):
                if self.waiting and self.waiting[0] is seq:
                    break  # held back this step: nothing behind it jumps the queue
                continue  # parked
            prefix = self.block_manager.match_prefix(seq)
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
        elif self.parked.pop(seq.seq_id, None) is None and seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

"""The seam a KV feature plugs into rayapp's engine through: sparse retrieval (`SparseKV`) and layer-wise
compression (`LayerwiseKV`) are the two there are.

The engine calls every extension at the same points of a request's life, in the order they were built:
- `min_recompute_tokens(seq)` when a request is prepared: how many of the prompt's last tokens a prefix-cache
  hit must still compute (the extension reads their queries). The engine takes the largest answer.
- `keeps_own_layout(seq)`: True while the extension holds `seq`'s KV in a layout of its own; such a sequence
  is not forked by sharing its pages (its other answers compute their prompt from the prefix cache instead).
- `begin_step()` before each step, `after_step(seqs)` after the model ran and the computed counts advanced,
  before the sampled tokens are appended (a sequence that finishes in this step still holds its pages).
- `drop(seq)` when a sequence finishes, is aborted or is preempted, after the scheduler released its pages.
- `stats()` between steps, on the engine's thread: numbers named as `metrics()` declares them. The replica
  pushes every declared metric to `/metrics`, so a new counter is added here and nowhere else.

What an extension may not do: take or release pages except through the BlockManager, touch KV except in
the runner's `KVPool` (the pages of its sequences, their per-layer slots, or a region reserved for it), or
change a sequence's `num_computed_tokens` or token ids. The model runner reads each extension's plan for the step
(`SparseKV.plan`, `LayerwiseKV.plan`) when it prepares the attention metadata.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from rayapp.config import EngineConfig
from rayapp.engine.layerwise_kv import LayerwiseKV
from rayapp.engine.sparse_kv import SparseKV
from rayapp.observability import Metric

if TYPE_CHECKING:
    from rayapp.engine.block_manager import BlockManager
    from rayapp.engine.model_runner import ModelRunner
    from rayapp.engine.scheduler import Scheduler
    from rayapp.engine.sequence import Sequence


class KVExtension(Protocol):
    def min_recompute_tokens(self, seq: Sequence) -> int: ...

    def keeps_own_layout(self, seq: Sequence) -> bool: ...

    def begin_step(self) -> None: ...

    def after_step(self, seqs: list[Sequence]) -> None: ...

    def drop(self, seq: Sequence) -> None: ...

    def stats(self) -> dict[str, int]: ...

    def metrics(self) -> tuple[Metric, ...]: ...


def build_extensions(
    config: EngineConfig, runner: ModelRunner, block_manager: BlockManager, scheduler: Scheduler, max_model_len: int
) -> list[KVExtension]:
    """The extensions `config` turns on, wired to the runner (which reads their step plans) and the scheduler
    (which grows compacted sequences through layer-wise compression)."""
    runner.sparse = SparseKV(config, runner, block_manager, max_model_len) if config.sparse.enabled else None
    runner.layerwise = LayerwiseKV(config, runner, block_manager) if config.layerwise.enabled else None
    scheduler.reserve_compacted = None if runner.layerwise is None else runner.layerwise.reserve
    return [e for e in (runner.sparse, runner.layerwise) if e is not None]

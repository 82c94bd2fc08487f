"""The seam a KV feature plugs into rayapp's engine through, and the registry the engine finds features in.

A feature is a package of its own (`rayapp.layerwise`, `rayapp.sparse`; the cluster tier's connector,
`rayapp.kvtier.connector`, is attached at run time by `LLMEngine.attach_tier`). The core imports none of them:
`EXTENSIONS` names each by module path, as vLLM's `KVConnectorFactory` does, and `build_extensions` imports
those the config turns on.

The engine calls every extension at the same points of a request's life, in the order they were built:
- `min_recompute_tokens(seq)` when a request is prepared: how many of the prompt's last tokens a prefix-cache
  hit must still compute (the extension reads their queries). The engine takes the largest answer.
- `keeps_own_layout(seq)`: True while the extension holds `seq`'s KV in a layout of its own; such a sequence
  is not forked by sharing its pages (its other answers compute their prompt from the prefix cache instead).
- `reserve(seq, n)` when the scheduler needs room for `n` more tokens of `seq`: True or False when the
  extension holds that sequence's pages itself (it took the room, or could not), None to leave it to the
  BlockManager.
- `begin_step()` before each step; `plan(step, decode_rows)` while the model runner prepares it: the
  extension's hooks into the step's attention, and the decode rows it takes (of those no extension before it
  took; the rest attend densely); `after_step(seqs)` after the model ran and the computed counts advanced,
  before the sampled tokens are appended (a sequence that finishes in this step still holds its pages).
- `drop(seq)` when a sequence finishes, is aborted or is preempted, after the scheduler released its pages.
- `stats()` between steps, on the engine's thread: numbers named as `metrics()` declares them. The replica
  pushes every declared metric to `/metrics`, so a new counter is added here and nowhere else.

What an extension may not do: take or release pages except through the BlockManager, touch KV except in
the runner's `KVPool` (the pages of its sequences, their per-layer slots, or a region it reserved with
`reserved_pages`), or change a sequence's `num_computed_tokens` or token ids.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from concurrent.futures import Executor
from typing import TYPE_CHECKING, Protocol

from rayapp.blocks import KVEvent
from rayapp.config import EngineConfig
from rayapp.engine.attention import StepInputs, StepPlan
from rayapp.observability import Metric

if TYPE_CHECKING:
    from rayapp.engine.block_manager import BlockManager
    from rayapp.engine.model_runner import ModelRunner
    from rayapp.engine.pages import PrefixMatch
    from rayapp.engine.sequence import Sequence
    from rayapp.models.loader import ModelSpec

# The features `EngineConfig` can turn on (its section of that name has `enabled`), by module path, in the order
# they are built and asked to plan: layer-wise compression takes the decode rows it compacted before sparse
# retrieval plans the others.
EXTENSIONS = {
    "layerwise": "rayapp.layerwise.extension:LayerwiseKV",
    "sparse": "rayapp.sparse.extension:SparseKV",
}


class KVExtension(Protocol):
    def min_recompute_tokens(self, seq: Sequence) -> int: ...

    def keeps_own_layout(self, seq: Sequence) -> bool: ...

    def reserve(self, seq: Sequence, num_new_tokens: int) -> bool | None: ...

    def begin_step(self) -> None: ...

    def plan(self, step: StepInputs, decode_rows: list[int]) -> StepPlan | None: ...

    def after_step(self, seqs: list[Sequence]) -> None: ...

    def drop(self, seq: Sequence) -> None: ...

    def stats(self) -> dict[str, int]: ...

    def metrics(self) -> tuple[Metric, ...]: ...


class KVConnector(KVExtension, Protocol):
    """An extension that loads KV from outside the engine (the cluster tier's `TierConnector`), asked by the
    scheduler at every admission (`rayapp.engine.scheduler.AdmissionConnector`), after vLLM's
    `KVConnectorBase_V1`."""

    def offer(self, seq: Sequence, prefix: PrefixMatch) -> int | None: ...

    def adopt(self, seq: Sequence, prefix: PrefixMatch) -> PrefixMatch: ...

    def take_finished(self) -> list[Sequence]: ...

    def has_finished(self) -> bool: ...

    def take_events(self) -> list[KVEvent]: ...

    def load_on(self, executor: Executor, wake: Callable[[], None]) -> None: ...

    def attach(self) -> None: ...

    def detach(self) -> None: ...


class ExtensionClass(Protocol):
    """How the registry builds an extension."""

    @staticmethod
    def reserved_pages(config: EngineConfig, spec: ModelSpec, num_pages: int) -> dict[str, int]:
        """Pool pages to reserve beside the `num_pages` of the main region, by region name (before the pool is
        built; the extension finds them with `runner.pool.region(name)`)."""
        ...

    def __call__(
        self, config: EngineConfig, runner: ModelRunner, block_manager: BlockManager, max_model_len: int
    ) -> KVExtension: ...


def extension_classes(config: EngineConfig) -> dict[str, ExtensionClass]:
    """The classes of the extensions `config` turns on, by name, in `EXTENSIONS` order."""
    classes = {}
    for name, target in EXTENSIONS.items():
        if getattr(config, name).enabled:
            module, attribute = target.split(":")
            classes[name] = getattr(importlib.import_module(module), attribute)
    return classes


def build_extensions(
    config: EngineConfig, runner: ModelRunner, block_manager: BlockManager, max_model_len: int
) -> dict[str, KVExtension]:
    """The extensions `config` turns on, by name, over the runner's pool and the block manager."""
    return {name: cls(config, runner, block_manager, max_model_len) for name, cls in extension_classes(config).items()}

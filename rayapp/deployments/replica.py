"""`LLMReplica`: one engine on one device, streaming token deltas to the ingress."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from ray import serve

from rayapp.config import AppConfig
from rayapp.deployments.metrics import PUSH_PERIOD_S, ReplicaMetrics, metrics_hub
from rayapp.engine.async_engine import AsyncLLMEngine
from rayapp.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class LLMReplica:
    """Serve deployment body (decorated in the builder, so tests can bind a fake engine class).

    The engine's step loop runs on its own thread (`AsyncLLMEngine`), so this replica's event
    loop stays free to accept requests and stream outputs while the model computes.
    """

    def __init__(self, app_config: dict[str, Any], engine_cls: type = AsyncLLMEngine) -> None:
        config = AppConfig(**app_config)
        self.engine = engine_cls.from_config(config.engine_config())
        context = serve.get_replica_context()
        self.replica = context.replica_id.unique_id
        self.metrics = ReplicaMetrics(self.replica)
        self._hub = metrics_hub(context.app_name)
        self._pusher = asyncio.get_event_loop().create_task(self._push_metrics())

    async def generate(self, request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """Stream one request: each item carries the new text; the last one the finish reason and usage.

        `request`: `prompt_token_ids`, `block_hashes`, `cache_salt`, `sampling` (SamplingParams
        fields). A ValueError (bad request) propagates to the ingress, which answers 400.
        """
        params = SamplingParams(**request["sampling"])
        start = last = time.monotonic()
        first = True
        stream = self.engine.generate(
            request.get("request_id") or uuid.uuid4().hex,
            params=params,
            prompt_token_ids=request["prompt_token_ids"],
            cache_salt=request.get("cache_salt", ""),
            block_hashes=request.get("block_hashes"),
        )
        async for out in stream:
            now = time.monotonic()
            completion = out.outputs[0]
            if completion.delta_token_ids:
                if first:
                    self.metrics.first_token(now - start)
                else:
                    self.metrics.next_token(now - last)
                first, last = False, now
            item: dict[str, Any] = {"text": completion.delta_text}
            if out.finished:
                self.metrics.finished(completion.finish_reason)
                item.update(
                    finish_reason=completion.finish_reason,
                    prompt_tokens=len(out.prompt_token_ids),
                    cached_tokens=out.num_cached_tokens,
                    completion_tokens=len(completion.token_ids),
                )
            yield item

    async def stats(self) -> dict[str, int]:
        return self.engine.stats()

    async def _push_metrics(self) -> None:
        while True:
            with contextlib.suppress(Exception):  # metrics must never take a replica down
                await self._hub.push.remote(self.replica, self.metrics.snapshot(self.engine.stats()))
            await asyncio.sleep(PUSH_PERIOD_S)

    def __del__(self) -> None:
        # Serve calls this on graceful shutdown: stop the engine thread, take our numbers down.
        self._pusher.cancel()
        self._hub.remove.remote(self.replica)
        self.engine.shutdown()

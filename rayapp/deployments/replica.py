"""`LLMReplica`: one engine on one device, streaming token deltas to the ingress."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from ray import serve

from rayapp.config import AppConfig
from rayapp.deployments.metrics import PUSH_PERIOD_S, ReplicaMetrics, metrics_hub
from rayapp.deployments.protocol import GenerateRequest
from rayapp.engine.async_engine import AsyncLLMEngine
from rayapp.engine.sampling_params import SamplingParams
from rayapp.prefix_router.actor import prefix_index
from rayapp.prefix_router.publisher import KVEventPublisher

logger = logging.getLogger(__name__)


class LLMReplica:
    """Serve deployment body (decorated in the builder, so tests can bind a fake engine class).

    The engine's step loop runs on its own thread (`AsyncLLMEngine`), so this replica's event
    loop stays free to accept requests and stream outputs while the model computes.
    """

    def __init__(self, app_config: dict[str, Any], engine_cls: type = AsyncLLMEngine) -> None:
        self.config = AppConfig(**app_config)
        self.engine = engine_cls.from_config(self.config.engine_config())
        self.tier: Any = None
        if self.config.kvtier.enabled:
            from rayapp.kvtier.client import attach_tier  # psycopg and the tier only where the tier is on

            try:
                self.tier = attach_tier(self.engine.engine)
            except Exception as error:  # no database, no store: serve without the tier rather than not at all
                logger.warning("cluster KV tier unavailable (%s); serving without it", error)
        context = serve.get_replica_context()
        self.app_name, self.replica = context.app_name, context.replica_id.unique_id
        self.metrics = ReplicaMetrics(self.replica)
        self._hub = metrics_hub(self.app_name)
        self._index = prefix_index(self.app_name, self.config.router)
        publisher = KVEventPublisher(
            self.replica,
            functools.partial(prefix_index, self.app_name, self.config.router),
            self.engine.take_kv_events,
            self.engine.kv_snapshot,
            self.config.router.event_batch_period_s,
            self.config.router.event_batch_max,
        )
        loop = asyncio.get_event_loop()
        self._tasks = [loop.create_task(self._push_metrics()), loop.create_task(publisher.run())]

    async def generate(self, request: GenerateRequest) -> AsyncIterator[dict[str, Any]]:
        """Stream one request: each item carries the new text and token ids; the last one the finish
        reason and usage. A ValueError (bad request) propagates to the ingress, which answers 400.
        """
        params = SamplingParams(**request.sampling)
        start = last = time.monotonic()
        first = True
        stream = self.engine.generate(
            request.request_id,
            params=params,
            prompt_token_ids=request.prompt_token_ids,
            cache_salt=request.cache_salt,
            block_hashes=request.block_hashes,
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
            item: dict[str, Any] = {"text": completion.delta_text, "token_ids": completion.delta_token_ids}
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

    async def flush_tier(self) -> None:
        """Return once every block this replica queued for the cluster KV tier is written (no-op without one)."""
        if self.tier is not None:
            await asyncio.to_thread(self.tier.flush)

    async def _push_metrics(self) -> None:
        while True:
            with contextlib.suppress(Exception):  # metrics must never take a replica down
                await self._hub.push.remote(self.replica, self.metrics.snapshot(self.engine.stats()))
            await asyncio.sleep(PUSH_PERIOD_S)

    def __del__(self) -> None:
        # Serve calls this on graceful shutdown: stop the engine thread, take our numbers and pages down.
        for task in self._tasks:
            task.cancel()
        self._hub.remove.remote(self.replica)
        self._index.remove_replica.remote(self.replica)
        self.engine.shutdown()
        if self.tier is not None:
            self.tier.close()

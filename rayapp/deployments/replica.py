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

from rayapp.blocks import BlockHash
from rayapp.config import AppConfig
from rayapp.deployments.engines import backend_class
from rayapp.deployments.metrics import ReplicaMetrics
from rayapp.drivers.backend import GenerateDelta
from rayapp.engine.request import EngineRequest
from rayapp.observability import PUSH_PERIOD_S
from rayapp.observability.hub import HubClient
from rayapp.prefix_router.actor import prefix_index, shard_of
from rayapp.prefix_router.publisher import KVEventPublisher

logger = logging.getLogger(__name__)


class LLMReplica:
    """Serve deployment body (decorated in the builder, so tests can bind a fake backend class).

    The engine computes in a process of its own (rayapp's `EngineProcess`, vLLM's engine core), so
    this replica's event loop stays free to accept requests and stream outputs, and shares no GIL
    with the steps.
    """

    def __init__(self, app_config: dict[str, Any], backend_cls: type | None = None) -> None:
        self.config = AppConfig(**app_config)
        context = serve.get_replica_context()
        self.app_name, self.replica = context.app_name, context.replica_id.unique_id
        backend_cls = backend_cls or backend_class(self.config)
        try:
            self.engine = backend_cls.from_app_config(self.config)
        except Exception as error:
            # One line a reader of `serve run` finds; Serve retries a few times, then marks the deployment failed
            # with this error (which the ingress' /health reports).
            logger.error("LLMReplica cannot start its engine: %s", error)
            raise
        self.metrics = ReplicaMetrics(self.replica)
        self._hub = HubClient(self.app_name)
        # This replica's shard of the index: the one its events go to.
        connect = functools.partial(
            prefix_index, self.app_name, self.config.router, shard_of(self.replica, self.config.router.index_shards)
        )
        self._index = connect()
        publisher = KVEventPublisher(
            self.replica,
            connect,
            self.engine.take_kv_events,
            self.engine.kv_snapshot,
            self.config.router.event_batch_period_s,
            self.config.router.event_batch_max,
        )
        loop = asyncio.get_event_loop()
        self._tasks = [loop.create_task(self._push_metrics()), loop.create_task(publisher.run())]

    async def generate(self, request: EngineRequest) -> AsyncIterator[GenerateDelta]:
        """Stream one request as deltas; the last carries the finish reason and usage. A ValueError (bad
        request) propagates to the ingress, which answers 400; an EngineDeadError moves the request."""
        start = last = time.monotonic()
        first = True
        async for delta in self.engine.generate(request):
            now = time.monotonic()
            if delta.token_ids:
                if first:
                    self.metrics.first_token(now - start)
                else:
                    self.metrics.next_token(now - last)
                first, last = False, now
            if delta.finished:
                self.metrics.finished(delta.finish_reason)
            yield delta

    async def stats(self) -> dict[str, float]:
        return await self.engine.stats()

    async def cached_blocks(self) -> tuple[str, list[BlockHash]]:
        """This replica's ID and every block its prefix cache holds now: what the PrefixIndex may name for it."""
        return self.replica, await self.engine.cached_blocks()

    async def check_health(self) -> None:
        """Serve's periodic probe: a replica whose engine died fails it and is replaced."""
        await self.engine.check_health()

    async def flush_tier(self) -> None:
        """Return once every block this replica queued for the cluster KV tier is written (no-op without one)."""
        await self.engine.flush_tier()

    def engine_pid(self) -> int | None:
        """The PID of the process stepping this replica's engine (rayapp's engine process, vLLM's engine core)."""
        return self.engine.engine_pid()

    async def _push_metrics(self) -> None:
        while True:
            with contextlib.suppress(Exception):  # metrics must never take a replica down
                if not self.metrics.declared:
                    self.metrics.declare(await self.engine.metrics())
                stats = await self.engine.stats()
                await self._hub.call("push", self.replica, self.metrics.snapshot(stats))
            await asyncio.sleep(PUSH_PERIOD_S)

    def __del__(self) -> None:
        # Serve calls this on graceful shutdown: stop the engine, take our numbers and pages down.
        if not hasattr(self, "_tasks"):  # __init__ failed (say the engine did not start): nothing to undo
            return
        for task in self._tasks:
            task.cancel()
        self._hub.send("remove", self.replica)
        self._index.remove_replica.remote(self.replica)
        self.engine.shutdown()

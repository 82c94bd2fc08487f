"""`RayappLLMServer`: Ray Serve LLM's `LLMServer`, with its vLLM's KV events feeding rayapp's PrefixIndex.

Everything a request meets is Ray Serve LLM's: its `VLLMEngine`, vLLM's OpenAI serving, its batching, LoRA and
health checks. This subclass adds, per replica, what `LLMReplica` does for rayapp's own app: vLLM's KV events on
an IPC endpoint of the replica's own (`kv_events_config`), `VLLMKVEvents` re-keying them by rayapp's hash chain,
and a `KVEventPublisher` sending them to the application's PrefixIndex actor under the replica's Serve id (the
id the router's candidates carry).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ray import serve
from ray.serve.llm import LLMConfig, LLMServer

from rayapp.blocks import KVEvent
from rayapp.config import RouterConfig
from rayapp.prefix_router.actor import prefix_index, shard_of
from rayapp.prefix_router.publisher import KVEventPublisher
from rayapp.vllm_ext.kv_events import VLLMKVEvents

logger = logging.getLogger(__name__)

# Batches vLLM keeps for a subscriber that missed some (one batch per engine step with cache changes), as on
# rayapp's own vLLM replicas.
REPLAY_BUFFER_STEPS = 10_000


@dataclass(frozen=True)
class Routing:
    """What the replica shares with the router: the builder put it in the router's `request_router_kwargs`."""

    block_size: int
    model_id: str
    router: RouterConfig

    @classmethod
    def of(cls, llm_config: LLMConfig) -> Routing:
        config = llm_config.deployment_config.get("request_router_config")
        kwargs = config.get("request_router_kwargs") if isinstance(config, dict) else None
        kwargs = dict(kwargs if kwargs is not None else getattr(config, "request_router_kwargs", None) or {})
        if "block_size" not in kwargs or "model_id" not in kwargs:
            raise ValueError(
                "RayappLLMServer is set up by rayapp.integrations.ray_serve_llm:build_openai_app; use that builder "
                "as the application's import_path rather than naming the server class"
            )
        kwargs.pop("llm_config", None)
        return cls(int(kwargs.pop("block_size")), str(kwargs.pop("model_id")), RouterConfig(**kwargs))


class RayappLLMServer(LLMServer):
    """The LLMServer deployment of a `rayapp.integrations.ray_serve_llm` app."""

    async def __init__(self, llm_config: LLMConfig, **kwargs: Any) -> None:
        self._routing = routing = Routing.of(llm_config)
        context = serve.get_replica_context()
        self._app_name, self._replica = context.app_name, context.replica_id.unique_id
        base = Path(tempfile.gettempdir()) / f"rayapp-kv-{uuid.uuid4().hex[:12]}"
        endpoint, replay = f"ipc://{base}.pub", f"ipc://{base}.replay"
        llm_config.update_engine_kwargs(
            kv_events_config={
                "enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint, "replay_endpoint": replay,
                "buffer_steps": REPLAY_BUFFER_STEPS,
            }
        )  # fmt: skip
        # Subscribed before the engine starts: its first stored blocks are not missed.
        self._events = VLLMKVEvents(endpoint, replay, routing.model_id, routing.block_size)
        try:
            await super().__init__(llm_config, **kwargs)
            self._check_block_size()
            shard = shard_of(self._replica, routing.router.index_shards)
            connect = functools.partial(prefix_index, self._app_name, routing.router, shard)
            self._index = await asyncio.to_thread(connect)
        except BaseException:
            self._events.close()
            raise
        publisher = KVEventPublisher(
            self._replica, connect, self._take_events, self._snapshot,
            routing.router.event_batch_period_s, routing.router.event_batch_max,
        )  # fmt: skip
        self._publishing = asyncio.get_running_loop().create_task(publisher.run())

    def _check_block_size(self) -> None:
        """vLLM may run another page size than the one asked for (some platforms and models force theirs): the
        router would then hash prompts with pages vLLM never reports, and route by load only, unsaid."""
        client = getattr(self.engine, "_engine_client", None)
        actual = getattr(getattr(getattr(client, "vllm_config", None), "cache_config", None), "block_size", None)
        if actual is not None and actual != self._routing.block_size:
            raise ValueError(
                f"vLLM runs block_size={actual} here, not the {self._routing.block_size} rayapp's router hashes "
                f"prompts with; set engine_kwargs.block_size: {actual} in the llm_config"
            )

    async def _take_events(self) -> list[KVEvent]:
        return self._events.take()

    async def _snapshot(self) -> list[KVEvent]:
        return self._events.snapshot()

    async def __del__(self) -> None:
        # Serve calls this on graceful shutdown: stop publishing, and take this replica's blocks out of the index.
        if hasattr(self, "_publishing"):
            self._publishing.cancel()
            with contextlib.suppress(Exception):
                self._index.remove_replica.remote(self._replica)
        if hasattr(self, "_events"):
            self._events.close()
        await super().__del__()

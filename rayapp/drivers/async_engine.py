"""Asyncio front of the engine: per-request streams, with the step loop on its own thread (`EngineLoop`).

The step loop runs off the event loop so handlers stay responsive while the model computes
(torch releases the GIL inside its kernels). Outputs cross back with `call_soon_threadsafe`.
A served replica runs the same loop in a process of its own instead (`EngineProcess`), so it
shares no GIL with the replica's other threads.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from rayapp.blocks import BlockHash, KVEvent
from rayapp.config import EngineConfig
from rayapp.drivers.loop import EngineLoop
from rayapp.engine.llm_engine import LLMEngine
from rayapp.engine.outputs import RequestOutput
from rayapp.engine.request import EngineRequest
from rayapp.observability import Metric

_Stream = tuple[asyncio.AbstractEventLoop, "asyncio.Queue[RequestOutput | BaseException]"]


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._streams: dict[str, _Stream] = {}
        self._loop = EngineLoop(engine, self._deliver, self._fail)

    @classmethod
    def from_options(cls, **options: Any) -> AsyncLLMEngine:
        return cls(LLMEngine.from_options(**options))

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncLLMEngine:
        return cls(LLMEngine(config))

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs until it finishes.

        Bad input raises ValueError before anything is queued. Leaving the iterator early (the
        client went away, the task was cancelled) aborts the request and frees its pages.
        """
        request_id = request.request_id
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        # Validation happens here, on the caller's thread, so errors reach the caller.
        prepared = self.engine.prepare_request(request)
        out_queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), out_queue)
        self._loop.add(prepared)
        finished = False
        try:
            while not finished:
                item = await out_queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._loop.abort(request_id)

    async def abort(self, request_id: str) -> None:
        """Abort a request; returns once its pages are freed. Its stream ends with finish_reason 'abort'."""
        await asyncio.wrap_future(self._loop.abort(request_id))

    async def stats(self) -> dict[str, float]:
        """`LLMEngine.stats` and the step loop's time counters, read on the engine thread between two steps
        (a consistent snapshot)."""
        if not self.is_running():  # no step loop mutates the engine any more
            return self._loop.stats()
        return await self._call(self._loop.stats)

    async def metrics(self) -> tuple[Metric, ...]:
        """What `stats` reports that `/metrics` shows."""
        return self._loop.metrics()

    async def take_kv_events(self) -> list[KVEvent]:
        """KV cache events since the last call, taken on the engine thread between two steps."""
        return await self._call(self.engine.take_kv_events)

    async def kv_snapshot(self) -> list[KVEvent]:
        """`LLMEngine.kv_snapshot`, taken on the engine thread between two steps."""
        return await self._call(self.engine.kv_snapshot)

    async def cached_blocks(self) -> list[BlockHash]:
        """`LLMEngine.cached_blocks`, read on the engine thread between two steps."""
        return await self._call(self.engine.cached_blocks)

    async def _call(self, fn: Any) -> Any:
        return await asyncio.wrap_future(self._loop.call(fn))

    def is_running(self) -> bool:
        """Whether the step loop still runs (it ends only at `shutdown`)."""
        return self._loop.is_running()

    def shutdown(self) -> None:
        """Stop the step loop; requests still running get an error."""
        self._loop.shutdown()

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is not None:
                loop, out_queue = stream
                loop.call_soon_threadsafe(out_queue.put_nowait, output)

    def _fail(self, error: BaseException, request_ids: list[str]) -> None:
        for loop, out_queue in list(self._streams.values()):
            loop.call_soon_threadsafe(out_queue.put_nowait, error)

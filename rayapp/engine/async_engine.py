"""Asyncio front of the engine: per-request streams, with the step loop on its own thread.

The step loop runs off the event loop so HTTP handlers stay responsive while the model
computes (torch releases the GIL inside its kernels). Requests and aborts cross into the
engine thread through a queue; outputs cross back with `call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from rayapp.blocks import BlockHash, KVEvent
from rayapp.config import EngineConfig
from rayapp.engine.kv_transfer import TierPlan
from rayapp.engine.llm_engine import LLMEngine
from rayapp.engine.outputs import RequestOutput
from rayapp.engine.request import Request
from rayapp.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_Stream = tuple[asyncio.AbstractEventLoop, "asyncio.Queue[RequestOutput | BaseException]"]


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._wakeup = threading.Event()
        self._stopped = False
        # Time inside `step()`: wall, and the CPU time of this loop's own thread (torch's intra-op threads not
        # counted). Their difference is what the step waited for: the GIL, or a core another process held.
        self._step_counters = {"engine_steps": 0, "engine_step_seconds": 0.0, "engine_step_cpu_seconds": 0.0}
        # Preempted requests' tier fetches, off the engine thread (the step loop must not wait on the tier).
        self._fetches = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="rayapp-tier-refetch")
        engine.fetch_parked = self._refetch
        self._thread = threading.Thread(target=self._run, name="rayapp-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_options(cls, **options: Any) -> AsyncLLMEngine:
        return cls(LLMEngine.from_options(**options))

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncLLMEngine:
        return cls(LLMEngine(config))

    async def generate(
        self,
        request_id: str,
        prompt: str | None = None,
        params: SamplingParams | None = None,
        prompt_token_ids: list[int] | None = None,
        cache_salt: str = "",
        block_hashes: list[BlockHash] | None = None,
        delivered_tokens: int = 0,
        delivered_chars: int | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs until it finishes.

        Bad input raises ValueError before anything is queued. Leaving the iterator early (the
        client went away, the task was cancelled) aborts the request and frees its pages.
        """
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        # Validation and tokenization happen here, on the caller's thread, so errors reach the caller.
        request = self.engine.prepare_request(
            request_id, prompt, params, prompt_token_ids, cache_salt, block_hashes, delivered_tokens, delivered_chars
        )
        out_queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), out_queue)
        if self.engine.kv_transfer is not None:
            await self._enqueue_with_tier(request)
        else:
            self._submit(lambda: self.engine.enqueue(request))
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
                self._submit(lambda: self.engine.abort_request(request_id))

    async def abort(self, request_id: str) -> None:
        """Abort a request; returns once its pages are freed. Its stream ends with finish_reason 'abort'."""
        done: concurrent.futures.Future[None] = concurrent.futures.Future()

        def command() -> None:
            try:
                self._deliver(self.engine.abort_request(request_id))
            finally:
                done.set_result(None)

        self._submit(command)
        await asyncio.wrap_future(done)

    async def stats(self) -> dict[str, float]:
        """`LLMEngine.stats` and the step loop's time counters, read on the engine thread between two steps
        (a consistent snapshot)."""
        if not self.is_running():  # no step loop mutates the engine any more
            return self._stats()
        return await self._call(self._stats)

    def _stats(self) -> dict[str, float]:
        return {**self.engine.stats(), **self._step_counters}

    async def take_kv_events(self) -> list[KVEvent]:
        """KV cache events since the last call, taken on the engine thread between two steps."""
        return await self._call(self.engine.take_kv_events)

    async def kv_snapshot(self) -> list[KVEvent]:
        """`LLMEngine.kv_snapshot`, taken on the engine thread between two steps."""
        return await self._call(self.engine.kv_snapshot)

    async def _call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the engine thread (where the engine's state is consistent) and return its result."""
        done: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def command() -> None:
            try:
                done.set_result(fn())
            except BaseException as error:
                done.set_exception(error)

        self._submit(command)
        return await asyncio.wrap_future(done)

    async def _enqueue_with_tier(self, request: Any) -> None:
        """Queue `request` after putting the prompt's blocks the cluster tier holds beyond the local prefix
        into cached pages. The local match, and the install with the enqueue (one command, so no step can
        evict the pages in between), run on the engine thread; the fetch on a worker thread, since it waits
        on the catalog and the object store, which must block neither the step loop nor the event loop."""
        plan = await self._call(lambda: self.engine.plan_tier_load(request))
        blocks = await asyncio.to_thread(self.engine.fetch_from_tier, request, plan)

        def install_and_enqueue() -> None:
            self.engine.install_from_tier(request, plan, blocks)
            self.engine.enqueue(request)

        self._submit(install_and_enqueue)

    def _refetch(self, request: Request, plan: TierPlan) -> None:
        """Engine thread: fetch a parked (preempted) request's blocks from the tier on a worker thread, then
        hand it back to the engine with them."""

        def fetch() -> None:
            try:
                blocks = self.engine.fetch_from_tier(request, plan)
            except Exception:  # the tier is a cache: the request recomputes instead
                logger.exception("fetching a preempted request's blocks from the cluster tier failed")
                blocks = []
            self._submit(lambda: self.engine.requeue(request, plan, blocks))

        self._fetches.submit(fetch)

    def is_running(self) -> bool:
        """Whether the step loop still runs (it ends only at `shutdown`)."""
        return self._thread.is_alive()

    def shutdown(self) -> None:
        """Stop the step loop; requests still running get an error."""
        self._stopped = True
        self._wakeup.set()
        self._thread.join()
        self._fetches.shutdown(wait=False, cancel_futures=True)

    def _submit(self, command: Callable[[], None]) -> None:
        self._commands.put(command)
        self._wakeup.set()

    def _deliver(self, output: RequestOutput | None) -> None:
        stream = self._streams.get(output.request_id) if output is not None else None
        if stream is not None:
            loop, out_queue = stream
            loop.call_soon_threadsafe(out_queue.put_nowait, output)

    def _fail_all(self, error: BaseException) -> None:
        for request_id, (loop, out_queue) in list(self._streams.items()):
            self.engine.abort_request(request_id)
            loop.call_soon_threadsafe(out_queue.put_nowait, error)

    def _run(self) -> None:
        while not self._stopped:
            while not self._commands.empty():
                self._commands.get()()
            if not self.engine.has_runnable_requests():  # parked requests come back through a command
                self._wakeup.wait()
                self._wakeup.clear()
                continue
            try:
                wall, cpu = time.perf_counter(), time.thread_time()
                outputs = self.engine.step()
                counters = self._step_counters
                counters["engine_steps"] += 1
                counters["engine_step_seconds"] += time.perf_counter() - wall
                counters["engine_step_cpu_seconds"] += time.thread_time() - cpu
                for output in outputs:
                    self._deliver(output)
            except Exception as error:  # an engine bug: fail loudly, but keep serving new requests
                logger.exception("engine step failed; failing every running request")
                self._fail_all(RuntimeError(f"engine step failed: {error}"))
        self._fail_all(RuntimeError("engine shut down"))

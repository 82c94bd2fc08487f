"""rayapp's engine in a child process of its own, as vLLM runs its EngineCore: the step loop shares no GIL.

Served in the replica's process, the step loop lost ~13% of every step waiting for the GIL behind
the replica's other Python threads (Ray Serve's per-token serialization and event loops), and ran
slower on the CPU it got. Here the child owns the `LLMEngine` and its `EngineLoop`; the parent
keeps only pipes and streams.

Over one duplex pipe, the dataclasses of `rayapp.drivers.messages`:
- parent → child: `AddRequest` (the `EngineRequest` itself), `AbortRequest`, `Call` (for `abort`, `stats`,
  `metrics`, `take_kv_events`, `kv_snapshot` and `flush_tier`) and `Shutdown`;
- child → parent: `Started` once, then one `Outputs` per step, `Rejected` for a request `prepare_request`
  refused (the ValueError the client caused, pickled whole: a `LimitError` keeps its `param` and `code`),
  `Ended` for requests an engine failure ended, and a `Reply` per `Call`.

The child reads the pipe on its main thread and leaves when it closes (the parent exited or was
killed): no engine outlives its replica. A child that dies makes every open stream and call raise
`EngineDeadError`, and `is_running()` false, so Serve replaces the replica.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import itertools
import logging
import multiprocessing
import os
import threading
from collections.abc import AsyncIterator, Callable
from multiprocessing.connection import Connection
from typing import Any

import torch

from rayapp.blocks import BlockHash, KVEvent
from rayapp.config import EngineConfig
from rayapp.drivers.backend import EngineDeadError, GenerateDelta, UsageTally
from rayapp.drivers.loop import EngineLoop
from rayapp.drivers.messages import (
    AbortRequest,
    AddRequest,
    Call,
    Ended,
    Outputs,
    Rejected,
    Reply,
    Shutdown,
    Started,
)  # fmt: skip
from rayapp.engine.llm_engine import LLMEngine
from rayapp.engine.outputs import RequestOutput
from rayapp.engine.request import EngineRequest
from rayapp.observability import Metric

logger = logging.getLogger(__name__)

# What ps and top show for the engine's process (Linux keeps 15 bytes of it).
PROCESS_NAME = "rayapp-engine"
PR_SET_NAME = 15

# Something the child holds beside the engine (a cluster-tier client): flushed on `flush_tier`, closed at exit.
Attachment = Any
# Runs in the child once the engine is built (say, to attach the cluster tier); returns what to flush and close.
Setup = Callable[[LLMEngine], Attachment]
_Stream = tuple[asyncio.AbstractEventLoop, "asyncio.Queue[GenerateDelta | BaseException]"]


class EngineProcess:
    """An `LLMEngine` stepping in a child process; streams its requests as `GenerateDelta`s.

    `setup` (picklable) runs in the child after the engine is built. The constructor returns once the
    model is loaded, and raises RuntimeError with the child's error when the engine cannot start.
    """

    def __init__(self, config: EngineConfig, setup: Setup | None = None) -> None:
        self.block_size = config.cache.block_size
        context = multiprocessing.get_context("spawn")  # a fork would copy the replica's threads and locks
        self._conn, child_conn = context.Pipe()
        self._process = context.Process(
            target=_child_main, args=(child_conn, config, setup, torch.get_num_threads()),
            name=PROCESS_NAME, daemon=True,
        )  # fmt: skip
        self._process.start()
        child_conn.close()
        try:
            started = self._conn.recv()
        except EOFError:
            started = Started(f"the engine process exited with code {self._process.exitcode} while starting")
        if started.error is not None:
            self._process.join(timeout=10)
            raise RuntimeError(f"rayapp's engine did not start: {started.error}")
        self._send_lock = threading.Lock()
        self._streams: dict[str, _Stream] = {}
        self._calls: dict[int, concurrent.futures.Future[Any]] = {}
        self._call_ids = itertools.count()
        self._dead: str | None = None
        self._reader = threading.Thread(target=self._read, name="rayapp-engine-reader", daemon=True)
        self._reader.start()

    async def generate(self, request: EngineRequest) -> AsyncIterator[GenerateDelta]:
        """Stream one request until its last delta (the one with usage). A request the engine refuses raises
        the engine's ValueError (a `LimitError` with its `param` and `code`); leaving early aborts it and frees
        its pages."""
        request_id = request.request_id
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        out_queue: asyncio.Queue[GenerateDelta | BaseException] = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), out_queue)
        finished = False
        try:
            self._send(AddRequest(request))
            while not finished:
                item = await out_queue.get()
                if isinstance(item, BaseException):
                    finished = True  # the child forgot it already
                    raise item
                finished = item.last
                yield item
        finally:
            self._streams.pop(request_id, None)
            if not finished and self._dead is None:
                self._send(AbortRequest(request_id))

    async def abort(self, request_id: str) -> None:
        """Abort a request; returns once its pages are freed. Its stream ends with finish_reason 'abort'."""
        await self._call("abort", request_id)

    async def stats(self) -> dict[str, float]:
        """The engine's counters and the step loop's, read between two steps (a consistent snapshot)."""
        return await self._call("stats")

    async def metrics(self) -> tuple[Metric, ...]:
        """What `stats` reports that `/metrics` shows: the engine's, its extensions' and the step loop's."""
        return await self._call("metrics")

    async def take_kv_events(self) -> list[KVEvent]:
        return await self._call("take_kv_events")

    async def kv_snapshot(self) -> list[KVEvent]:
        return await self._call("kv_snapshot")

    async def cached_blocks(self) -> list[BlockHash]:
        return await self._call("cached_blocks")

    async def flush_tier(self) -> None:
        """Return once every block the engine queued for the cluster tier is written (at once without one)."""
        await self._call("flush_tier")

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def is_running(self) -> bool:
        return self._dead is None and self._process.is_alive()

    def shutdown(self) -> None:
        """Stop the child (its running requests fail); kill it if it does not stop within 30 s."""
        with contextlib.suppress(EngineDeadError):
            self._send(Shutdown())
        self._process.join(timeout=30)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()
        self._reader.join(timeout=5)
        self._conn.close()

    async def _call(self, name: str, *args: Any) -> Any:
        done: concurrent.futures.Future[Any] = concurrent.futures.Future()
        call_id = next(self._call_ids)
        self._calls[call_id] = done
        self._send(Call(call_id, name, args))
        return await asyncio.wrap_future(done)

    def _send(self, message: AddRequest | AbortRequest | Call | Shutdown) -> None:
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        try:
            with self._send_lock:
                self._conn.send(message)
        except OSError as error:
            raise EngineDeadError(f"rayapp's engine process is gone ({error})") from None

    def _read(self) -> None:
        """Reader thread: route the child's messages to their streams (one event-loop wakeup per step)."""
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                break
            if isinstance(message, Outputs):
                self._route(message.deltas)
            elif isinstance(message, Reply):
                done = self._calls.pop(message.call_id)
                done.set_result(message.value) if message.error is None else done.set_exception(message.error)
            elif isinstance(message, Rejected):
                self._route([(message.request_id, message.error)])
            elif isinstance(message, Ended):
                self._route([(request_id, RuntimeError(message.reason)) for request_id in message.request_ids])
        code = self._process.exitcode
        self._dead = f"rayapp's engine process exited (code {code})" if code else "rayapp's engine process stopped"
        error = EngineDeadError(self._dead)
        self._route([(request_id, error) for request_id in list(self._streams)])
        for done in list(self._calls.values()):
            done.set_exception(error)
        self._calls.clear()

    def _route(self, items: list[tuple[str, GenerateDelta | BaseException]]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, GenerateDelta | BaseException]]] = {}
        for request_id, item in items:
            stream = self._streams.get(request_id)
            if stream is not None:
                by_loop.setdefault(stream[0], []).append((stream[1], item))
        for loop, puts in by_loop.items():
            loop.call_soon_threadsafe(_put_all, puts)


def _put_all(puts: list[tuple[asyncio.Queue, Any]]) -> None:
    for out_queue, item in puts:
        out_queue.put_nowait(item)


class _Deltas:
    """The child's side of `GenerateDelta`: each request's usage tallied over its outputs (all its answers), for
    its last delta."""

    def __init__(self) -> None:
        self._tallies: dict[str, UsageTally] = {}

    def __call__(self, out: RequestOutput) -> tuple[str, GenerateDelta]:
        completion = out.outputs[0]  # the answer that progressed
        tally = self._tallies.setdefault(out.request_id, UsageTally(len(out.prompt_token_ids)))
        tally.add(completion.delta_token_ids)
        usage = None
        if out.finished:
            del self._tallies[out.request_id]
            usage = tally.usage(out.num_cached_tokens)
        delta = GenerateDelta(
            completion.delta_text, completion.delta_token_ids, completion.finish_reason, usage,
            completion.delta_logprobs, completion.index,
        )  # fmt: skip
        return out.request_id, delta

    def forget(self, request_ids: list[str]) -> None:
        """Requests an engine failure ended: no last output comes for them."""
        for request_id in request_ids:
            self._tallies.pop(request_id, None)


def _name_process(name: str) -> None:
    """Show `name` for this process in ps, top and psutil (Linux; elsewhere the name stays python's)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)


def _child_main(conn: Connection, config: EngineConfig, setup: Setup | None, num_threads: int) -> None:
    _name_process(PROCESS_NAME)
    torch.set_num_threads(num_threads)
    send_lock = threading.Lock()

    def send(message: Started | Outputs | Rejected | Ended | Reply) -> None:
        with send_lock, contextlib.suppress(OSError):  # OSError: the parent is gone, and this process exits
            conn.send(message)

    try:
        engine = LLMEngine(config)
        attachment = setup(engine) if setup is not None else None
    except Exception as error:
        logger.exception("rayapp's engine did not start")
        send(Started(f"{type(error).__name__}: {error}"))
        return
    deltas = _Deltas()

    def end(error: BaseException, request_ids: list[str]) -> None:
        deltas.forget(request_ids)
        send(Ended(str(error), request_ids))

    loop = EngineLoop(engine, deliver=lambda outputs: send(Outputs([deltas(out) for out in outputs])), fail=end)
    flusher = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rayapp-engine-flush")
    calls: dict[str, Callable[..., concurrent.futures.Future[Any]]] = {
        "abort": loop.abort,
        "stats": lambda: loop.call(loop.stats),
        "metrics": lambda: loop.call(loop.metrics),
        "take_kv_events": lambda: loop.call(engine.take_kv_events),
        "kv_snapshot": lambda: loop.call(engine.kv_snapshot),
        "cached_blocks": lambda: loop.call(engine.cached_blocks),
        # Waits on the tier's writer: on a thread of its own, never the step loop's.
        "flush_tier": lambda: flusher.submit(lambda: attachment is not None and attachment.flush()),
    }

    def reply(call_id: int, done: concurrent.futures.Future[Any]) -> None:
        error = done.exception()
        send(Reply(call_id, error=error) if error is not None else Reply(call_id, done.result()))

    send(Started())
    try:
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):  # the parent is gone
                break
            if isinstance(message, AddRequest):
                try:
                    loop.add(engine.prepare_request(message.request))
                except ValueError as error:
                    send(Rejected(message.request.request_id, error))
            elif isinstance(message, AbortRequest):
                loop.abort(message.request_id)
            elif isinstance(message, Call):
                done = calls[message.name](*message.args)
                done.add_done_callback(lambda done, call_id=message.call_id: reply(call_id, done))
            elif isinstance(message, Shutdown):
                break
    finally:
        loop.shutdown()
        if attachment is not None:
            attachment.close()
        # Threads a setup started (Ray's, the tier's) must not keep an engine alive without its parent.
        os._exit(0)

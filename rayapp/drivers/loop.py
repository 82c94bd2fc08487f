"""The step loop on a thread of its own: commands in, each step's outputs out through a callback.

`AsyncLLMEngine` (streams on an event loop, in this process) and `EngineProcess`'s child (outputs
over a pipe) both drive the engine with it. Everything that touches the engine's state runs on the
loop's thread, between two steps: commands from any thread cross through a queue. With a cluster
tier, the loop gives its connector worker threads to fetch on (a fetch waits on the catalog and the
object store, which must not stall the steps) and is woken when a load finished.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from rayapp.engine.llm_engine import LLMEngine
from rayapp.engine.outputs import RequestOutput
from rayapp.engine.request import Request
from rayapp.observability import Metric, counters

logger = logging.getLogger(__name__)

METRICS = counters(
    {
        "engine_steps": "Steps rayapp's engine ran",
        "engine_step_seconds": "Wall time inside rayapp's engine steps",
        "engine_step_cpu_seconds": "CPU time of the engine's step thread inside its steps (torch's intra-op threads "
        "not counted); below engine_step_seconds by the time the step waited for the GIL or for a core",
    }
)


class EngineLoop:
    """Runs `engine.step()` on thread `rayapp-engine` while there is work.

    `deliver(outputs)` gets each step's outputs (and an aborted request's last one) on that thread;
    `fail(error, request_ids)` gets the requests an engine bug or the shutdown ended, after their pages
    were freed.
    """

    def __init__(
        self,
        engine: LLMEngine,
        deliver: Callable[[list[RequestOutput]], None],
        fail: Callable[[BaseException, list[str]], None],
    ) -> None:
        self.engine = engine
        self._deliver, self._fail = deliver, fail
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._stopped = False
        # Requests added and not yet finished or aborted.
        self._live: set[str] = set()
        # Time inside `step()`: wall, and the CPU time of this loop's own thread (torch's intra-op threads not
        # counted). Their difference is what the step waited for: the GIL, or a core another process held.
        self._step_counters = {"engine_steps": 0, "engine_step_seconds": 0.0, "engine_step_cpu_seconds": 0.0}
        self._fetches = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="rayapp-tier-fetch")
        if engine.tier is not None:
            engine.tier.load_on(self._fetches, self._wakeup.set)
        self._thread = threading.Thread(target=self._run, name="rayapp-engine", daemon=True)
        self._thread.start()

    def add(self, request: Request) -> None:
        """Queue a prepared request (any thread)."""
        request_id = request.seq.seq_id if request.group is None else request.group.request_id

        def enqueue() -> None:
            self._live.add(request_id)
            self.engine.enqueue(request)

        self.submit(enqueue)

    def abort(self, request_id: str) -> concurrent.futures.Future[None]:
        """Abort a request (any thread); the future is done once its pages are freed and its last output
        (finish reason 'abort') was delivered."""

        def abort() -> None:
            self._live.discard(request_id)
            output = self.engine.abort_request(request_id)
            if output is not None:
                self._deliver([output])

        return self.call(abort)

    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future[Any]:
        """Run `fn` on the loop's thread, between two steps (where the engine's state is consistent)."""
        done: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def command() -> None:
            try:
                done.set_result(fn())
            except BaseException as error:
                done.set_exception(error)

        self.submit(command)
        return done

    def metrics(self) -> tuple[Metric, ...]:
        """What `stats` reports that `/metrics` shows."""
        return self.engine.metrics() + METRICS

    def stats(self) -> dict[str, float]:
        """`LLMEngine.stats` and the step loop's time counters (loop thread, or once the loop has stopped)."""
        return {**self.engine.stats(), **self._step_counters}

    def submit(self, command: Callable[[], None]) -> None:
        self._commands.put(command)
        self._wakeup.set()

    def is_running(self) -> bool:
        """Whether the step loop still runs (it ends only at `shutdown`)."""
        return self._thread.is_alive()

    def shutdown(self) -> None:
        """Stop the step loop; requests still running fail."""
        self._stopped = True
        self._wakeup.set()
        self._thread.join()
        self._fetches.shutdown(wait=False, cancel_futures=True)

    def _fail_all(self, error: BaseException) -> None:
        request_ids, self._live = sorted(self._live), set()
        for request_id in request_ids:
            self.engine.abort_request(request_id)
        self._fail(error, request_ids)

    def _run(self) -> None:
        while not self._stopped:
            while not self._commands.empty():
                self._commands.get()()
            if not self.engine.has_runnable_requests():  # a finished tier load wakes the loop
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
                    if output.finished:
                        self._live.discard(output.request_id)
                if outputs:
                    self._deliver(outputs)
            except Exception as error:  # an engine bug: fail loudly, but keep serving new requests
                logger.exception("engine step failed; failing every running request")
                self._fail_all(RuntimeError(f"engine step failed: {error}"))
        self._fail_all(RuntimeError("engine shut down"))

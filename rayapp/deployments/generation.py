"""One admitted request at the ingress: its replica streams, and its answers as the client has received them,
each moved to another replica when theirs dies."""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import Callable
from typing import Any

from ray.exceptions import RayActorError, RayTaskError

from rayapp.blocks import BlockHash
from rayapp.deployments.protocol import APIError
from rayapp.drivers.backend import EngineDeadError, GenerateDelta, UsageTally
from rayapp.engine.request import EngineRequest, LimitError

# A request whose replica dies is moved to another replica at most this many times.
MAX_REPLICA_FAILURES = 3


@dataclasses.dataclass
class Answer:
    """One of a request's answers, as far as the client has received it."""

    generated: list[int] = dataclasses.field(default_factory=list)
    delivered_chars: int = 0
    finished: bool = False


@dataclasses.dataclass
class InFlight:
    """The ingress' count of admitted requests (each holds a slot until its `Generation` is released) and of
    requests moved off a failed replica."""

    requests: int = 0
    moved: int = 0


# A prompt's block hashes for a tenant's salt, as the replicas hash them (`rayapp.blocks.hash_blocks`).
Hasher = Callable[[list[int], str], list[BlockHash]]

# Marks the end of one replica stream in `Generation`'s queue.
_END = object()


class Generation:
    """One admitted request's replica streams, holding one in-flight slot until released (exactly once).

    The request goes to one replica, which computes its prompt once for all `n` answers. If the replica
    dies mid-request (crash, node loss, scale-down), each unfinished answer moves to another replica and
    continues after the tokens already produced, so the client sees uninterrupted answers. (A sampled
    answer continues with fresh randomness; a greedy one is unchanged.) Each stream is read by a task of
    its own into one queue, so the answers of moved streams interleave as they come.
    """

    def __init__(self, replica: Any, request: EngineRequest, hasher: Hasher, inflight: InFlight) -> None:
        """`replica`: the replicas' deployment handle; `hasher`: how a moved answer's longer prompt is hashed."""
        self.replica, self.request, self.hasher, self.inflight = replica, request, hasher, inflight
        self.answers = [Answer() for _ in range(request.sampling.n)]
        self.failures = 0
        self.released = False
        # Prompt tokens the first replica to report found cached (a moved answer's prompt holds output too).
        self.cached_tokens: int | None = None
        self._queue: asyncio.Queue[tuple[tuple[int, ...], Any]] = asyncio.Queue()
        self._streams: list[Any] = []
        self._readers: list[asyncio.Task] = []
        self._done = False
        inflight.requests += 1
        self._open(request, tuple(range(request.sampling.n)))

    def _open(self, request: EngineRequest, answers: tuple[int, ...]) -> None:
        """Stream `request` from a replica; its answer i is this request's answer `answers[i]`."""
        stream = self.replica.options(stream=True).generate.remote(request)
        self._streams.append(stream)
        self._readers.append(asyncio.get_running_loop().create_task(self._read(stream, answers)))

    async def _read(self, stream: Any, answers: tuple[int, ...]) -> None:
        while True:
            try:
                item = await stream.__anext__()
            except StopAsyncIteration:
                self._queue.put_nowait((answers, _END))
                return
            except Exception as error:
                self._queue.put_nowait((answers, error))
                return
            self._queue.put_nowait((answers, item))

    async def next(self) -> GenerateDelta:
        """The next delta, indexed and with usage counted over the whole request; an engine rejection
        becomes a 400. The request's last delta (`last`) comes once every answer finished."""
        while True:
            answers, item = await self._queue.get()
            if isinstance(item, RayTaskError):
                if isinstance(item.cause, LimitError):
                    raise APIError(400, str(item.cause), param=item.cause.param, code=item.cause.code) from None
                if isinstance(item.cause, ValueError):
                    raise APIError(400, str(item.cause)) from None
                if not isinstance(item.cause, EngineDeadError):
                    raise item
                self._move(answers)  # the replica lives but its engine died: Serve replaces it, the answers move
                continue
            if isinstance(item, RayActorError):
                self._move(answers)
                continue
            if isinstance(item, BaseException):
                raise item
            if item is _END:
                if any(not self.answers[i].finished for i in answers):
                    raise RuntimeError("a replica ended a stream before its answers finished")
                if all(a.finished for a in self.answers) and not self._done:
                    return self._last(GenerateDelta("", []))
                continue
            if item.usage is not None and self.cached_tokens is None:
                self.cached_tokens = item.usage.cached_tokens
            index = answers[item.index]
            answer = self.answers[index]
            answer.generated.extend(item.token_ids)
            answer.delivered_chars += len(item.text)
            answer.finished = item.finished
            item = dataclasses.replace(item, index=index, usage=None)
            if answer.finished and all(a.finished for a in self.answers):
                return self._last(item)
            return item

    def _last(self, item: GenerateDelta) -> GenerateDelta:
        self._done = True
        tally = UsageTally(len(self.request.prompt_token_ids))
        for answer in self.answers:
            tally.add(answer.generated)
        return dataclasses.replace(item, usage=tally.usage(self.cached_tokens or 0))

    def _move(self, answers: tuple[int, ...]) -> None:
        """Continue the unfinished `answers` on another replica (each request at most MAX_REPLICA_FAILURES
        times)."""
        self.failures += 1
        if self.failures > MAX_REPLICA_FAILURES:
            raise RuntimeError(f"the request failed on {self.failures} replicas")
        self.inflight.moved += 1
        for i in answers:
            if not self.answers[i].finished:
                self._open(self._continuation(i), (i,))

    def _continuation(self, i: int) -> EngineRequest:
        """The rest of answer `i`: the prompt plus what it generated, asking for what is left (its output is
        prompt there: the frequency and presence penalties no longer count it)."""
        answer, sampling = self.answers[i], dataclasses.replace(self.request.sampling, n=1)
        done = len(answer.generated)
        sampling = dataclasses.replace(sampling, min_tokens=max(0, sampling.min_tokens - done))
        if sampling.max_tokens is not None:
            sampling = dataclasses.replace(sampling, max_tokens=max(1, sampling.max_tokens - done))
        ids = self.request.prompt_token_ids + answer.generated
        return dataclasses.replace(
            self.request,
            request_id=uuid.uuid4().hex,
            prompt_token_ids=ids,
            block_hashes=self.hasher(ids, self.request.cache_salt),
            sampling=sampling,
            delivered_tokens=len(answer.generated),
            delivered_chars=answer.delivered_chars,
        )

    def release(self, cancel: bool) -> None:
        if self.released:
            return
        self.released = True
        self.inflight.requests -= 1
        if cancel:
            for reader, stream in zip(self._readers, self._streams):
                reader.cancel()
                stream.cancel()

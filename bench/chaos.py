"""A chaos soak: rayapp served with two replicas and the cluster KV tier, many multi-turn conversations at once for a
bounded time (10 minutes by default), and faults injected from a seeded schedule, sometimes two at once: SIGKILL of a
replica, the PrefixIndex, the tier store or the MetricsHub, the catalog database frozen (SIGSTOP) for seconds, a
client that vanishes mid-stream (`chaos_faults.py`).

    python bench/chaos.py [--duration 600] [--seed 0] [--json report.json]

Served as README.md runs it, behind Serve's HAProxy ingress (`--proxy python`: Serve's Python proxy). First each
conversation is played once without faults: its greedy answers are the references, and every later turn
sends the references as its history, so each request has one right answer. Then the clients replay conversations at
random while faults land. Each request ends as one of: `ok` (a well-formed answer equal to the reference),
`mismatch` (well-formed, other text), `clean_error` (an OpenAI error body with a retryable status, or an error event
in the stream; the client retries the turn), `refused` (a 4xx for a valid request), `cut` (a stream or connection
that ended without `[DONE]` or an error event), `hung` (no end within `--deadline`), `abandoned` (the vanishing
client's). After the load, the faults heal and the app settles; then it checks that every replica's pages are free,
and that the PrefixIndex names only blocks the replica it names holds (asked of each replica, `cached_blocks`).
`/health` and `/metrics` are polled every second throughout: each must answer within 10 s.

Exit status 1 when an invariant fails: any `mismatch`, `refused`, `cut` or `hung` request, a fault not healed, a page
still held, an index entry no replica holds, or `/health` or `/metrics` not answering.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import shutil
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path

import httpx
import ray
from chaos_faults import HEAL_BOUND_S, KINDS, Faults, live_replicas
from chat_servers import app_config, port_in_use
from chat_workloads import Script, Workload, workload_scripts
from ray import serve

from rayapp.config import AppConfig
from rayapp.deployments.builder import build
from rayapp.kvtier.embedded import start_embedded_database, stop_embedded_database
from rayapp.prefix_router.actor import CLUSTER_HOLDER, prefix_index

APP = "rayapp"
MODEL = "SmolLM2-135M-Instruct"
RETRYABLE = {408, 429, 500, 502, 503, 504}
FAILURES = ("mismatch", "refused", "cut", "hung")
SETTLE_S = 60.0  # after the faults healed: how long pages and the index may take to settle


def request(script: Script, turn: int, answers: list[str]) -> dict:
    """Turn `turn` of `script` as a greedy chat request, its history answered with `answers` (the references)."""
    history = [{"role": "system", "content": script.system}] if script.system else []
    for t in range(turn):
        reply = script.turns[t].reply if script.turns[t].reply is not None else answers[t]
        history += [{"role": "user", "content": script.turns[t].user}, {"role": "assistant", "content": reply}]
    messages = [*history, {"role": "user", "content": script.turns[turn].user}]
    return {"model": MODEL, "messages": messages, "max_tokens": script.turns[turn].max_tokens, "temperature": 0}


async def ask(http: httpx.AsyncClient, body: dict, stream: bool, vanish: bool, deadline_s: float) -> tuple[str, str]:
    """One request: (its outcome, its text or what went wrong)."""
    try:
        async with asyncio.timeout(deadline_s):
            if not stream:
                response = await http.post("/v1/chat/completions", json=body)
                if response.status_code == 200:
                    return "answered", response.json()["choices"][0]["message"]["content"]
                return _error(response.status_code, response.content)
            text, finish, done = "", None, False
            async with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
                if response.status_code != 200:
                    return _error(response.status_code, await response.aread())
                async for line in response.aiter_lines():
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: "):
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            return "clean_error", f"error event: {chunk['error'].get('message', '')[:80]}"
                        for choice in chunk["choices"]:
                            text += choice["delta"].get("content") or ""
                            finish = choice["finish_reason"] or finish
                        if vanish:
                            return "abandoned", ""  # leaving the block drops the connection mid-stream
            if not (done and finish):
                return "cut", f"ended without [DONE] (finish {finish})"
            return "answered", text
    except TimeoutError:
        return "hung", f"no end within {deadline_s:.0f} s"
    except httpx.HTTPError as error:
        return "cut", f"{type(error).__name__}: {error}"


def _error(status: int, content: bytes) -> tuple[str, str]:
    try:
        message = json.loads(content)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return "cut", f"HTTP {status} without an OpenAI error body"
    return ("clean_error" if status in RETRYABLE else "refused"), f"HTTP {status}: {message[:80]}"


class Load:
    """Clients replaying conversations: each picks one at random, plays its turns in order (retrying a turn that
    failed cleanly, up to 5 tries), then the next."""

    def __init__(self, base_url: str, scripts: list[Script], references: list[list[str]], args: argparse.Namespace):
        self.base_url, self.scripts, self.references, self.args = base_url, scripts, references, args
        self.outcomes: Counter[str] = Counter()
        self.problems: list[str] = []
        self._vanish = 0
        self._lock = threading.Lock()

    def vanish(self) -> None:
        with self._lock:
            self._vanish += 1

    def _take_vanish(self) -> bool:
        with self._lock:
            if self._vanish:
                self._vanish -= 1
                return True
        return False

    async def run(self, until: float) -> None:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(base_url=self.base_url, timeout=None, limits=limits) as http:
            await asyncio.gather(*(self._client(http, random.Random(self.args.seed * 1000 + c), until)
                                   for c in range(self.args.clients)))  # fmt: skip

    async def _client(self, http: httpx.AsyncClient, rng: random.Random, until: float) -> None:
        while time.monotonic() < until:
            c = rng.randrange(len(self.scripts))
            script = self.scripts[c]
            for t in range(len(script.turns)):
                body = request(script, t, self.references[c])
                for _ in range(5):
                    vanish = self._take_vanish()
                    outcome, detail = await ask(http, body, rng.random() < 0.75 or vanish, vanish, self.args.deadline)
                    if outcome == "answered":
                        outcome = "ok" if detail == self.references[c][t] else "mismatch"
                        detail = f"conversation {c} turn {t}: {detail[:60]!r} != {self.references[c][t][:60]!r}"
                    self.outcomes[outcome] += 1
                    if outcome in FAILURES or outcome == "clean_error":
                        self.problems.append(f"{outcome}: {detail}")
                    if outcome not in ("clean_error", "abandoned"):
                        break
                    await asyncio.sleep(1.0)


async def play_references(base_url: str, scripts: list[Script], deadline_s: float) -> list[list[str]]:
    """Every conversation played once, all at once, before any fault: the answers every later request must equal."""
    answers: list[list[str]] = [[] for _ in scripts]

    async def play(http: httpx.AsyncClient, c: int) -> None:
        for t in range(len(scripts[c].turns)):
            outcome, text = await ask(http, request(scripts[c], t, answers[c]), False, False, deadline_s)
            if outcome != "answered":
                raise SystemExit(f"the reference pass failed before any fault: {outcome}: {text}")
            answers[c].append(text)

    async with httpx.AsyncClient(base_url=base_url, timeout=None) as http:
        await asyncio.gather(*(play(http, c) for c in range(len(scripts))))
    return answers


async def schedule(faults: Faults, kinds: list[str], rng: random.Random, mean_gap_s: float, until: float) -> None:
    """Fault events at exponential gaps; each takes the next kinds of a shuffled round of all kinds (so every kind
    comes once a round), two at once with probability 0.3; a kind whose last fault still heals is passed over."""
    rounds = itertools.chain.from_iterable(rng.sample(kinds, len(kinds)) for _ in itertools.count())
    for event in itertools.count():
        gap = rng.expovariate(1 / mean_gap_s)
        if gap >= until - time.monotonic():
            return
        await asyncio.sleep(gap)
        for _ in range(2 if rng.random() < 0.3 else 1):
            kind = next(rounds)
            if not faults.outstanding(kind):
                fault = await asyncio.to_thread(faults.inject, kind, event)
                print(f"[{fault.at_s:6.1f} s] {kind}: {fault.target}", flush=True)


class HealthPoller(threading.Thread):
    """GET /health and /metrics every second; an answer must come within 10 s (a 503 from /health is an answer)."""

    def __init__(self, base_url: str) -> None:
        super().__init__(name="chaos-health", daemon=True)
        self.base_url, self.statuses, self.failures = base_url, Counter(), []
        self._done = threading.Event()

    def run(self) -> None:
        with httpx.Client(base_url=self.base_url, timeout=10) as http:
            while not self._done.wait(1.0):
                for path in ("/health", "/metrics"):
                    try:
                        self.statuses[f"{path} {http.get(path).status_code}"] += 1
                    except httpx.HTTPError as error:
                        self.failures.append(f"{path}: {type(error).__name__}")

    def stop(self) -> None:
        self._done.set()
        self.join()


def settle(base_url: str, index: ray.actor.ActorHandle, replicas: int) -> dict:
    """After the load and the faults: the replicas' pages held and the index's entries no replica holds."""
    deadline = time.monotonic() + HEAL_BOUND_S
    while len(live_replicas(APP)) != replicas:
        if time.monotonic() > deadline:
            return {"replicas_back": False}
        time.sleep(1.0)
    live = live_replicas(APP)
    handle = serve.get_deployment_handle("LLMReplica", app_name=APP)
    deadline = time.monotonic() + SETTLE_S
    while True:
        text = httpx.get(f"{base_url}/metrics", timeout=10).text
        held = {r: _gauge(text, "pages_total", r) - _gauge(text, "pages_free", r) for r in live}
        cached: dict[str, set[int]] = {}
        for _ in range(50):  # Serve picks the replica: ask until each has answered
            replica, blocks = handle.cached_blocks.remote().result()
            cached[replica] = set(blocks)
            if set(live) <= set(cached):
                break
        indexed = {r: set(ray.get(index.blocks.remote(r))) for r in live}
        unknown = set(ray.get(index.replicas.remote())) - set(live) - {CLUSTER_HOLDER}
        stray = {r: len(indexed[r] - cached.get(r, set())) for r in live}
        tier = {n: _total(text, f"tier_{n}_blocks") for n in ("written", "loaded", "dropped")}
        state = {"replicas_back": True, "pages_held": held, "index_blocks_not_held": stray,
                 "index_unknown_replicas": sorted(unknown), "cached_blocks": {r: len(cached.get(r, ())) for r in live},
                 "tier_blocks_since_restart": tier}  # fmt: skip
        if (not any(held.values()) and not any(stray.values()) and not unknown) or time.monotonic() > deadline:
            return state
        time.sleep(1.0)


def _gauge(text: str, name: str, replica: str) -> float:
    prefix = f'rayapp_{name}{{replica="{replica}"}} '
    values = [float(line[len(prefix) :]) for line in text.splitlines() if line.startswith(prefix)]
    return values[0] if values else float("nan")


def _total(text: str, name: str) -> float:
    """A counter summed over the replicas (over the live ones: a dead replica's series leave /metrics)."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(f"rayapp_{name}"))


def verdict(load: Load, faults: Faults, health: HealthPoller, end: dict) -> list[str]:
    """What broke an invariant (nothing: the soak passed)."""
    broken = [f"{load.outcomes[o]} requests {o}" for o in FAILURES if load.outcomes[o]]
    broken += [f"{f.kind} fault at {f.at_s:.0f} s not healed within {HEAL_BOUND_S:.0f} s"
               for f in faults.faults if f.heal_s is None]  # fmt: skip
    broken += [f"/health or /metrics did not answer {len(health.failures)} times"] if health.failures else []
    if not end["replicas_back"]:
        return [*broken, "the replicas never all came back"]
    broken += [f"replica {r} holds {n:.0f} pages with no request running" for r, n in end["pages_held"].items() if n]
    broken += [f"the index names {n} blocks replica {r} does not hold" for r, n in end["index_blocks_not_held"].items()
               if n]  # fmt: skip
    if end["index_unknown_replicas"]:
        broken.append(f"the index still names replicas {end['index_unknown_replicas']}")
    return broken


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of load under faults")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--clients", type=int, default=8, help="conversations at once")
    parser.add_argument("--conversations", type=int, default=12)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--context-tokens", type=int, default=400, help="a pasted document opening each conversation")
    parser.add_argument("--faults", nargs="+", choices=KINDS, default=list(KINDS), help="the kinds to inject")
    parser.add_argument("--fault-every", type=float, default=20.0, help="mean seconds between fault events")
    parser.add_argument("--deadline", type=float, default=180.0, help="seconds a request may take")
    parser.add_argument("--engine", choices=("rayapp", "vllm"), default="rayapp")
    # bfloat16 answers depend on the batch they ran in (a greedy answer differed with no fault near it), so the
    # answers are judged in float32 unless asked otherwise.
    parser.add_argument("--dtype", default="float32", help="the replicas' dtype (AppConfig.dtype)")
    # Smaller than the conversations' histories (~46 KB a token in float32): pages are evicted and reloaded from the
    # tier, as on a busy cluster.
    parser.add_argument("--kv-cache-gb", type=float, default=0.1, help="each replica's KV pool")
    parser.add_argument("--proxy", choices=("haproxy", "python"), default="haproxy",
                        help="Serve's ingress: HAProxy (README.md's command) or Serve's Python proxy")  # fmt: skip
    parser.add_argument("--port", type=int, default=8100, help="the app's HTTP port (on 127.0.0.1)")
    parser.add_argument("--json", type=Path, help="write the report here too")
    args = parser.parse_args()

    workload = Workload("chaos", 2, args.conversations, args.turns, args.max_tokens, args.context_tokens)
    settings = app_config("rayapp-vllm" if args.engine == "vllm" else "rayapp", workload)["applications"][0]["args"]
    data_dir = Path(tempfile.mkdtemp(prefix="rayapp-chaos-")) / "db"
    tier = {"enabled": True, "data_dir": str(data_dir)}
    config = AppConfig(**{**settings, "dtype": args.dtype, "kv_cache_memory_gb": args.kv_cache_gb, "kvtier": tier})
    if port_in_use(args.port):
        raise SystemExit(f"port {args.port} is taken; pass --port")
    base_url = f"http://127.0.0.1:{args.port}"
    # Read by Serve's controller, a process of the Ray started here: it inherits this environment.
    os.environ["RAY_SERVE_ENABLE_HA_PROXY"] = "1" if args.proxy == "haproxy" else "0"
    ray.init(address="local", include_dashboard=False)
    faults = None
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": args.port})
        serve.run(build(config, app_name=APP), name=APP, route_prefix="/")
        scripts = workload_scripts(workload, count_tokens=len)
        references = asyncio.run(play_references(base_url, scripts, args.deadline))
        print(f"references: {len(scripts)} conversations of {args.turns} turns; soak of {args.duration:.0f} s",
              flush=True)  # fmt: skip
        load = Load(base_url, scripts, references, args)
        index = prefix_index(APP, config.router)
        dsn = start_embedded_database(data_dir)
        faults = Faults(APP, workload.replicas, base_url, index, data_dir, dsn, load.vanish, args.seed)
        health = HealthPoller(base_url)
        health.start()

        async def soak() -> None:
            until = time.monotonic() + args.duration
            injected = schedule(faults, args.faults, random.Random(args.seed), args.fault_every, until)
            await asyncio.gather(load.run(until), injected)

        asyncio.run(soak())
        faults.release()
        faults.wait_healed()
        end = settle(base_url, index, workload.replicas)
        health.stop()
    finally:
        if faults is not None:
            faults.release()
        try:
            serve.shutdown()
            stop_embedded_database()
        finally:
            ray.shutdown()
            shutil.rmtree(data_dir.parent, ignore_errors=True)
    broken = verdict(load, faults, health, end)
    report = {
        "seed": args.seed, "duration_s": args.duration, "requests": dict(load.outcomes),
        "faults": [asdict(f) for f in faults.faults], "health": dict(health.statuses),
        "health_failures": health.failures, "end": end, "problems": load.problems[:50], "broken": broken,
    }  # fmt: skip
    print_report(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    sys.exit(1 if broken else 0)


def print_report(report: dict) -> None:
    print(f"\nrequests: {report['requests']}")
    kinds = Counter(f["kind"] for f in report["faults"])
    for kind in KINDS:
        heals = [f["heal_s"] for f in report["faults"] if f["kind"] == kind]
        healed = sorted(h for h in heals if h is not None)
        times = f"heal {healed[len(healed) // 2]:.1f} s median, {healed[-1]:.1f} s max" if healed else ""
        print(f"faults {kind:8s} {kinds[kind]:3d}  {times}")
    print(f"/health and /metrics: {report['health']}, {len(report['health_failures'])} unanswered")
    print(f"end: {report['end']}")
    for problem in report["problems"][:10]:
        print(f"  {problem}")
    print("PASS" if not report["broken"] else "FAIL: " + "; ".join(report["broken"]))


if __name__ == "__main__":
    main()

"""The modes of `bench/ruler.py`, each run in a child process of its own (`ruler.py --worker`): greedy, the same
token ids, no prefix cache; a mode past its time is ended and keeps the cases it finished.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

RAYAPP_MODES = ("dense", "sparse", "layerwise")
VLLM_MODES = ("sparse-vllm", "dense-vllm")
MODES = (*RAYAPP_MODES, *VLLM_MODES)
# The child's program: ruler.py's hidden `--worker`, which calls `worker`.
RULER = Path(__file__).with_name("ruler.py")


def worker(mode: str, job_file: str, result_file: str) -> None:
    """A child's whole job: generate every case of the job with `mode`, one JSON line per finished case."""
    job = json.loads(Path(job_file).read_text())
    cases = job["cases"]
    t0 = time.perf_counter()
    generate, applied = (_vllm if mode in VLLM_MODES else _rayapp)(mode, job)
    with open(result_file, "a") as out:
        out.write(json.dumps({"load_s": time.perf_counter() - t0}) + "\n")
        out.flush()
        for case in cases:
            t = time.perf_counter()
            before = applied()
            text = generate(case["prompt_token_ids"], case["max_tokens"])
            ran = None if before is None else applied() > before
            out.write(json.dumps({"id": case["id"], "text": text, "applied": ran, "s": time.perf_counter() - t}))
            out.write("\n")
            out.flush()


def _rayapp(mode: str, job: dict):
    from rayapp import LLM, SamplingParams

    # No prefix cache (both engines): NIAH cases share their essay's start, and a cached prefix changes the
    # bfloat16 numerics enough to flip a small model's answer: each case is scored as if it ran alone.
    options = {"model": job["model"], "dtype": job["dtype"], "max_num_batched_tokens": 2048}
    options["enable_prefix_caching"] = False
    counter = None
    if mode == "sparse":
        options["sparse"] = {**job["sparse"], "enabled": True}
        counter = ("sparse_seqs_sparse", "sparse_seqs_offload")
    elif mode == "layerwise":
        options["layerwise"] = {**job["layerwise"], "enabled": True}
        counter = ("layerwise_compacted_seqs",)
    llm = LLM(**options)

    def generate(ids: list[int], max_tokens: int) -> str:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        return llm.generate(prompt_token_ids=ids, sampling_params=params)[0].outputs[0].text

    def applied() -> int | None:
        stats = llm.stats()
        return None if counter is None else sum(stats[k] for k in counter)

    return generate, applied


def _vllm(mode: str, job: dict):
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from rayapp.models.loader import resolve_model
    from rayapp.vllm_ext.retrieval import WORKER_EXTENSION

    plugin = mode == "sparse-vllm"
    longest = max(len(c["prompt_token_ids"]) + c["max_tokens"] for c in job["cases"])
    llm = LLM(
        str(resolve_model(job["model"])), dtype=job["dtype"], block_size=job["vllm_block_size"], enforce_eager=True,
        max_model_len=longest, kv_cache_memory_bytes=2 << 30, seed=0, enable_prefix_caching=False,
        **({"worker_extension_cls": WORKER_EXTENSION} if plugin else {}),
    )  # fmt: skip

    def generate(ids: list[int], max_tokens: int) -> str:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        return llm.generate(TokensPrompt(prompt_token_ids=ids), params, use_tqdm=False)[0].outputs[0].text

    def applied() -> int | None:
        return llm.collective_rpc("retrieval_stats")[0]["sparse_decode_steps_sparse"] if plugin else None

    return generate, applied


@dataclass
class ModeRun:
    texts: dict[int, str]
    applied: dict[int, bool | None]
    seconds: dict[int, float]  # each finished case's generation time
    wall_s: float
    load_s: float | None
    stopped: str | None  # why it ended before the last case, if it did


def run_mode(mode: str, job: dict, max_minutes: float, workdir: Path) -> ModeRun:
    """One mode in a child process of its own, ended (its process group) at `max_minutes`."""
    job_file, result, log = workdir / "job.json", workdir / f"{mode}.jsonl", workdir / f"{mode}.log"
    job_file.write_text(json.dumps(job))
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_RETRIEVAL_") and k != "VLLM_PLUGINS"}
    env["VLLM_PLUGINS"] = "retrieval" if mode == "sparse-vllm" else ""
    env["RAYAPP_RETRIEVAL_SETTINGS"] = json.dumps(job["sparse"])
    root = Path(__file__).resolve().parent.parent
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    cmd = [sys.executable, str(RULER), "--worker", mode, "--job", str(job_file), "--result", str(result)]
    t0 = time.perf_counter()
    stopped = None
    with open(log, "w") as out:
        child = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            child.wait(timeout=max_minutes * 60)
        except subprocess.TimeoutExpired:
            stopped = f"stopped at --max-minutes {max_minutes:g}"
        finally:
            if child.poll() is None:  # past its time, or this process interrupted: end the child's whole group
                os.killpg(child.pid, signal.SIGTERM)
                try:
                    child.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(child.pid, signal.SIGKILL)
                    child.wait()
    wall = time.perf_counter() - t0
    if stopped is None and child.returncode != 0:
        tail = log.read_text().splitlines()[-15:]
        stopped = f"failed (exit {child.returncode})"
        print(f"[{mode}] {stopped}; last lines of its log:\n  " + "\n  ".join(tail), flush=True)
    # Only whole lines: a line cut off by the end of the child is a case it did not finish.
    lines = [json.loads(x) for x in result.read_text().split("\n")[:-1]] if result.exists() else []
    done = [x for x in lines if "id" in x]
    load = next((x["load_s"] for x in lines if "load_s" in x), None)
    by_id = {x["id"]: x for x in done}
    return ModeRun(
        {i: x["text"] for i, x in by_id.items()},
        {i: x["applied"] for i, x in by_id.items()},
        {i: x["s"] for i, x in by_id.items()},
        wall,
        load,
        stopped,
    )

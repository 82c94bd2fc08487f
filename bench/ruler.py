"""RULER quality at long context: dense, sparse retrieval (rayapp's engine and the vLLM plugin), layer-wise. One run.

    PYTHONPATH=. python bench/ruler.py --model qwen2.5-coder-0.5b --lengths 8192 16384 28672 \\
        --tasks niah_single niah_multikey vt qa --samples 4 --modes dense sparse sparse-vllm layerwise
    PYTHONPATH=. python bench/ruler.py --smoke  # SmolLM2, 2K, 1 sample per task, the four default modes: a quick check

Cases come from RULER's own generators in `nvidia-long-context-eval` (install it with `--no-deps`, plus
`wonderwords nltk tenacity`, which its generator modules import), run as its `prepare.py` runs them: the
task's entry of the package's `synthetic.yaml` over its `constants.TASKS`, the template its 'base' model
template plus the answer prefix, seeded, haystacks and QA documents read from the package at run time.
  niah_single    `niah_single_2`: one word key, a 7-digit number, in Paul Graham essays (`niah.generate_samples`)
  niah_multikey  `niah_multikey_1`: four such needles, one asked for (`niah.generate_samples`)
  vt             `vt`: one chain of 4 hops in repeated noise, with RULER's in-context example
                 (`variable_tracking.sys_vartrack_w_noise_random`, twice, as its `main`)
  qa, qa_squad   `qa_2` (HotpotQA), `qa_1` (SQuAD): the question's documents among distractors (`qa.generate_samples`)
RULER's length counts the prompt and the tokens to generate; here it also counts the model's chat template: the
task text is the user's message and the answer prefix opens the assistant's turn (as RULER's chat templates put
it after the user turn). Without nltk's `punkt_tab` data (it downloads from outside PyPI) the essay haystack is cut
into sentences by nltk's Punkt with default parameters instead of its trained English model: the needles land on
sentence boundaries a little differently from RULER's own files. Scores are RULER's (`eval/synthetic/constants.py`):
string_match_all for NIAH and VT (share of expected answers contained in the output), string_match_part for QA.

Modes, each in a fresh child process, greedy, the same token ids, no prefix cache (each case scored as if alone):
  dense        rayapp's engine, sparse and layer-wise off
  sparse       rayapp's engine, `SparseConfig` defaults overlaid with `--sparse-settings`
  sparse-vllm  vllm.LLM with the `retrieval` plugin (`VLLM_PLUGINS=retrieval`, `RAYAPP_RETRIEVAL_SETTINGS`)
  dense-vllm   vllm.LLM, stock (the plugin's own baseline; not run unless asked)
  layerwise    rayapp's engine, `LayerwiseConfig` defaults overlaid with `--layerwise-settings`
`SparseConfig`'s defaults keep prompts under dense_boundary=32768 dense, and a sequence needs more than
init_tokens + local_tokens = 8216 tokens to have a middle to select from: the default `--sparse-settings` lowers
dense_boundary to 12288, so 16K and 28K prompts decode sparsely and 8K ones (nothing to drop) densely. A cell
marked `~` is one where the mode's sparse or compressed path ran on none of its cases. `--max-minutes` bounds each
mode (its start included); a mode stopped there is scored on the cases it finished, and Δ (points vs dense) on the
cases both finished.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

RAYAPP_MODES = ("dense", "sparse", "layerwise")
VLLM_MODES = ("sparse-vllm", "dense-vllm")
MODES = (*RAYAPP_MODES, *VLLM_MODES)
# Our name -> the entry of RULER's synthetic.yaml it runs.
TASKS = {
    "niah_single": "niah_single_2",
    "niah_multikey": "niah_multikey_1",
    "vt": "vt",
    "qa": "qa_2",
    "qa_squad": "qa_1",
}
DEFAULT_SPARSE = {"dense_boundary": 12288}
# SparseConfig scaled to SmolLM2's 8K context (as bench/sparse_vllm.py's quality run), for --smoke at 2K.
SMOKE_SPARSE = {"init_tokens": 64, "local_tokens": 512, "retrieval_block_size": 64, "dense_boundary": 1024}
# Below this RULER's generators can loop forever: the retry after a too-long case never shrinks past one step.
MIN_LENGTH = 2048


@dataclass(frozen=True)
class Case:
    id: int
    task: str
    length: int
    index: int  # RULER's sample index within (task, length)
    prompt_token_ids: list[int]
    max_tokens: int
    outputs: list[str]  # RULER's expected answers
    metric: str  # the RULER task whose metric scores it: niah, variable_tracking or qa


# ---- building cases with RULER's generators ----------------------------------------------------------------------


@contextlib.contextmanager
def _as_script(argv: list[str], aliases: dict[str, object]):
    """Run a RULER generator module's top level as its command line would: its argv, its sibling imports
    (`from constants import ...`) resolved to the package's modules, its progress output dropped."""
    saved_argv, saved = sys.argv, {k: sys.modules.get(k) for k in aliases}
    sys.argv = argv
    sys.modules.update(aliases)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        sys.argv = saved_argv
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v


def load_generators(model_dir: Path, needed: set[str]) -> tuple[dict, str]:
    """RULER's generator modules, imported with the model's tokenizer (RULER's `HFTokenizer` over `model_dir`);
    returns them and which sentence splitter the NIAH essay haystack uses."""
    try:
        import long_context_eval.data.synthetic.constants as constants
        import long_context_eval.data.tokenizer as tokenizer
    except ImportError as error:
        raise SystemExit(
            f"RULER's generators need `pip install --no-deps nvidia-long-context-eval` and "
            f"`pip install wonderwords nltk tenacity` ({error})"
        ) from None
    base = ["--save_dir", "unused", "--save_name", "unused", "--tokenizer_type", "hf", "--tokenizer_path"]
    argv = {
        "niah": [*base, str(model_dir), "--max_seq_length", "4096", "--tokens_to_generate", "128"],
        "variable_tracking": [*base, str(model_dir), "--max_seq_length", "4096"],
        "qa": [*base, str(model_dir), "--max_seq_length", "4096", "--tokens_to_generate", "32", "--template", "-"],
    }
    argv["qa"] += ["--dataset", "hotpotqa"]
    modules, splitter = {}, "nltk punkt_tab (RULER's)"
    for name in sorted(needed):
        with _as_script([name, *argv[name], "--num_samples", "1"], {"constants": constants, "tokenizer": tokenizer}):
            try:
                modules[name] = importlib.import_module(f"long_context_eval.data.synthetic.{name}")
            except ImportError as error:
                raise SystemExit(f"RULER's {name}.py needs `pip install wonderwords nltk tenacity` ({error})") from None
    if "niah" in modules:
        try:
            modules["niah"].sent_tokenize("One. Two.")
        except LookupError:
            from nltk.tokenize.punkt import PunktSentenceTokenizer

            modules["niah"].sent_tokenize = PunktSentenceTokenizer().tokenize
            splitter = "nltk Punkt, default parameters (punkt_tab data not installed)"
    return modules, splitter


def ruler_config(task: str) -> dict:
    """The task's settings as RULER's prepare.py makes them: synthetic.yaml's entry over constants.TASKS."""
    import long_context_eval
    import yaml
    from long_context_eval.data.synthetic.constants import TASKS as BASE

    entries = yaml.safe_load((Path(long_context_eval.__file__).parent / "synthetic.yaml").read_text())
    config = dict(entries[TASKS[task]])
    config.update(BASE[config["task"]])
    return config


def ruler_samples(module, config: dict, num_samples: int, length: int, seed: int) -> list[dict]:
    """`num_samples` RULER samples ({input, outputs, length}) of at most `length` tokens, seeded as a fresh run of
    the generator with `--random_seed seed` (its module state is reused, so it is seeded here again)."""
    import numpy as np

    args = module.args
    for key, value in config["args"].items():
        setattr(args, key, value)
    args.template = config["template"] + config["answer_prefix"]  # the 'base' model template, as prepare.py
    args.tokens_to_generate, args.max_seq_length = config["tokens_to_generate"], length
    args.num_samples, args.random_seed, args.pre_samples = num_samples, seed, 0
    random.seed(seed)
    np.random.seed(seed)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        if config["task"] == "niah":
            args.num_needle_k = max(args.num_needle_k, args.num_needle_q)
            return module.generate_samples(num_samples=num_samples, max_seq_length=length, save_dir=None)
        if config["task"] == "qa":
            return module.generate_samples(num_samples=num_samples, max_seq_length=length, save_dir=None)
        # variable_tracking's main: an in-context example of at most 500 tokens, then the samples.
        chains = {"num_chains": args.num_chains, "num_hops": args.num_hops}
        icl = module.sys_vartrack_w_noise_random(num_samples=1, max_seq_length=500, incremental=5, **chains)[0]
        return module.sys_vartrack_w_noise_random(num_samples, length, icl_example=icl, **chains)


def build_cases(model_dir: Path, tasks: list[str], lengths: list[int], num_samples: int, seed: int):
    """Every (length, sample, task) case as chat-templated token ids, shortest lengths first."""
    from rayapp.models.tokenizer import chat_token_ids, load_tokenizer

    tok = load_tokenizer(model_dir)
    configs = {t: ruler_config(t) for t in tasks}
    modules, splitter = load_generators(model_dir, {c["task"] for c in configs.values()})
    datasets = {"hotpotqa": (modules["qa"].QAS, modules["qa"].DOCS)} if "qa" in modules else {}  # read at import
    overhead = len(chat_token_ids(tok, [{"role": "user", "content": ""}]))
    by_cell: dict[tuple[str, int], list[dict]] = {}
    for task, config in configs.items():
        module = modules[config["task"]]
        if config["task"] == "qa":
            name = config["args"]["dataset"]
            if name not in datasets:
                path = Path(module.__file__).parent / "json" / f"{name}.json"
                datasets[name] = getattr(module, f"read_{name}")(str(path))
            module.QAS, module.DOCS = datasets[name]
        for length in lengths:
            by_cell[task, length] = ruler_samples(module, config, num_samples, length - overhead, seed)
    cases: list[Case] = []
    for length in lengths:
        for index in range(num_samples):
            for task, config in configs.items():
                sample = by_cell[task, length][index]
                lead = config["answer_prefix"].split("{")[0]  # the answer prefix's fixed start
                cut = sample["input"].rindex(lead)
                user, prefix = sample["input"][:cut], sample["input"][cut:].lstrip()
                ids = chat_token_ids(tok, [{"role": "user", "content": user}])
                ids += tok.encode(prefix, add_special_tokens=False)
                cases.append(
                    Case(len(cases), task, length, index, ids, config["tokens_to_generate"], sample["outputs"],
                         config["task"])
                )  # fmt: skip
    return cases, splitter


# ---- running a mode (in a child process) -------------------------------------------------------------------------


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
    cmd = [sys.executable, __file__, "--worker", mode, "--job", str(job_file), "--result", str(result)]
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


# ---- scoring and the table ---------------------------------------------------------------------------------------


def postprocess_pred(text: str) -> str:
    """RULER eval's `postprocess_pred` (eval/evaluate.py, whose module cannot be imported: it parses its own
    command line and needs pandas): strip, control characters to newlines."""
    import re

    return re.sub(r"[\x00-\x1f]", "\n", text.strip()).strip()


def sample_scores(cases: list[Case], texts: dict[int, str]) -> dict[int, float]:
    """RULER's per-sample score (0-100) of each finished case."""
    from long_context_eval.eval.synthetic.constants import TASKS as METRICS

    done = [c for c in cases if c.id in texts]
    return {
        c.id: METRICS[c.metric]["metric_fn_per_sample"]([postprocess_pred(texts[c.id])], [c.outputs])[0] for c in done
    }


def print_table(cases: list[Case], modes: list[str], runs: dict[str, ModeRun], num_samples: int) -> None:
    scores = {m: sample_scores(cases, runs[m].texts) for m in modes}
    others = [m for m in modes if m != "dense"] if "dense" in modes else []
    w = max(11, *(len(m) + 1 for m in modes))
    print(f"{'task':<14} {'length':>6} {'tokens':>6}" + "".join(f"{m:>{w}}" for m in modes), end="")
    print("  |" + "".join(f"{'Δ ' + m:>{w + 2}}" for m in others))
    cells = sorted({(c.task, c.length) for c in cases}, key=lambda x: (list(TASKS).index(x[0]), x[1]))
    groups = [(f"{t:<14} {n:>6}", [c for c in cases if (c.task, c.length) == (t, n)]) for t, n in cells]
    for label, mine in [*groups, (f"{'mean':<21}", cases)]:
        tokens = round(sum(len(c.prompt_token_ids) for c in mine) / len(mine))
        row = f"{label} {tokens:>6}"
        for m in modes:
            got = [scores[m][c.id] for c in mine if c.id in scores[m]]
            if not got:
                row += f"{'-':>{w}}"
                continue
            ran = [runs[m].applied[c.id] for c in mine if c.id in scores[m]]
            mark = "~" if all(r is False for r in ran) else ""
            short = f"[{len(got)}]" if len(got) < len(mine) else ""
            row += f"{f'{sum(got) / len(got):.1f}{mark}{short}':>{w}}"
        row += "  |"
        for m in others:
            both = [c.id for c in mine if c.id in scores[m] and c.id in scores["dense"]]
            delta = sum(scores[m][i] - scores["dense"][i] for i in both) / len(both) if both else None
            row += f"{'-' if delta is None else f'{delta:+.1f}':>{w + 2}}"
        print(row)
    print(f"{'time (min)':<28}" + "".join(f"{runs[m].wall_s / 60:>{w}.1f}" for m in modes))
    loads = ["-" if runs[m].load_s is None else f"{runs[m].load_s:.0f}" for m in modes]
    print(f"{'load (s)':<28}" + "".join(f"{x:>{w}}" for x in loads))
    per_case = [f"{sum(r.seconds.values()) / len(r.seconds):.1f}" if r.seconds else "-" for r in map(runs.get, modes)]
    print(f"{'s per case':<28}" + "".join(f"{x:>{w}}" for x in per_case))
    print(f"{'cases done':<28}" + "".join(f"{f'{len(runs[m].texts)}/{len(cases)}':>{w}}" for m in modes))
    for m in modes:
        if runs[m].stopped:
            print(f"{m}: {runs[m].stopped}")
    print(f"(score: RULER string match, 0-100, mean over up to {num_samples} samples; [n]: samples the mode finished;")
    print(" ~: the mode's sparse or compressed path ran on none of the cell's cases; Δ: points vs dense, same cases)")


# ---- main --------------------------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b", help="a shipped model's name or a model folder")
    ap.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384, 28672], help="RULER sequence lengths")
    ap.add_argument("--tasks", nargs="+", choices=list(TASKS), default=["niah_single", "niah_multikey", "vt", "qa"])
    ap.add_argument("--samples", type=int, default=4, help="samples per task and length")
    ap.add_argument("--modes", nargs="+", choices=MODES, default=["dense", "sparse", "sparse-vllm", "layerwise"])
    ap.add_argument("--sparse-settings", type=json.loads, default=None, help=f"JSON over SparseConfig's defaults, "
                    f"for sparse and sparse-vllm (default {json.dumps(DEFAULT_SPARSE)}; --smoke: "
                    f"{json.dumps(SMOKE_SPARSE)})")  # fmt: skip
    ap.add_argument("--layerwise-settings", type=json.loads, default={}, help="JSON over LayerwiseConfig's defaults")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--seed", type=int, default=42, help="RULER's --random_seed (its prepare.py uses 42)")
    ap.add_argument("--max-minutes", type=float, default=15.0, help="per mode, its start included")
    ap.add_argument("--json", help="also write cases, outputs and scores to this file")
    ap.add_argument("--smoke", action="store_true", help="SmolLM2, 2K, 1 sample per task, 5 minutes per mode")
    ap.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    ap.add_argument("--job", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.job, args.result)
        return
    if args.smoke:  # its defaults; flags given still win
        ap.set_defaults(model="SmolLM2-135M-Instruct", lengths=[2048], samples=1, max_minutes=5.0)
        args = ap.parse_args()
    sparse = args.sparse_settings or (SMOKE_SPARSE if args.smoke else DEFAULT_SPARSE)
    run(args, sparse)


def run(args: argparse.Namespace, sparse_settings: dict) -> None:
    from rayapp.config import LayerwiseConfig, SparseConfig
    from rayapp.models.loader import ModelInfo, resolve_model

    try:
        sparse = SparseConfig(**{**sparse_settings, "enabled": True})
        layerwise = LayerwiseConfig(**{**args.layerwise_settings, "enabled": True})
    except (TypeError, ValueError) as error:
        raise SystemExit(f"--sparse-settings / --layerwise-settings: {error}") from None
    rb = sparse.retrieval_block_size
    block_size = next(b for b in (128, 64, 32) if rb % b == 0) if rb % 32 == 0 else None
    if "sparse-vllm" in args.modes and (block_size is None or sparse.vllm_plugin_errors(block_size)):
        raise SystemExit("sparse-vllm: " + "; ".join(sparse.vllm_plugin_errors(block_size) or ["block size"]))
    model_dir = resolve_model(args.model)
    context = ModelInfo.from_dir(model_dir).context_length
    bad = [n for n in args.lengths if not MIN_LENGTH <= n <= context]
    if bad:
        raise SystemExit(f"--lengths {bad}: each must be from {MIN_LENGTH} to the model's context, {context}")
    t0 = time.perf_counter()
    cases, splitter = build_cases(model_dir, args.tasks, sorted(args.lengths), args.samples, args.seed)
    print(f"{len(cases)} RULER cases built in {time.perf_counter() - t0:.0f} s (sentence splitter: {splitter})")
    job = {
        "model": args.model, "dtype": args.dtype, "vllm_block_size": block_size,
        "sparse": {k: v for k, v in asdict(sparse).items() if k != "enabled"},
        "layerwise": {k: v for k, v in asdict(layerwise).items() if k != "enabled"},
        "cases": [{"id": c.id, "prompt_token_ids": c.prompt_token_ids, "max_tokens": c.max_tokens} for c in cases],
    }  # fmt: skip
    runs: dict[str, ModeRun] = {}
    with tempfile.TemporaryDirectory(prefix="ruler-") as tmp:
        for mode in args.modes:
            runs[mode] = run_mode(mode, job, args.max_minutes, Path(tmp))
            print(f"[{mode}] {len(runs[mode].texts)}/{len(cases)} cases in {runs[mode].wall_s:.0f} s", flush=True)
    print(f"\n## RULER on {args.model} ({args.dtype}), seed {args.seed}, {args.samples} sample(s) per task and length")
    print(f"sparse (both engines): {json.dumps(job['sparse'])}")
    print(f"layerwise: {json.dumps(job['layerwise'])}; vLLM block size {block_size}")
    print_table(cases, args.modes, runs, args.samples)
    if args.json:
        write_json(Path(args.json), args, job, cases, runs)


def write_json(path: Path, args: argparse.Namespace, job: dict, cases: list[Case], runs: dict[str, ModeRun]) -> None:
    """The run's settings and every case with each mode's output, score and whether its path ran."""
    scores = {m: sample_scores(cases, runs[m].texts) for m in runs}
    rows = []
    for c in cases:
        row = {k: v for k, v in asdict(c).items() if k != "prompt_token_ids"}
        row["prompt_tokens"] = len(c.prompt_token_ids)
        row["modes"] = {
            m: {
                "text": r.texts.get(c.id),
                "score": scores[m].get(c.id),
                "applied": r.applied.get(c.id),
                "seconds": r.seconds.get(c.id),
            }
            for m, r in runs.items()
        }
        rows.append(row)
    path.write_text(json.dumps({"args": vars(args), "job": {**job, "cases": None}, "cases": rows}, indent=1))


if __name__ == "__main__":
    main()

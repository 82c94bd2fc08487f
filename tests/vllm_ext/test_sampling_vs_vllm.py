"""vLLM's sampling fields mean the same on both engines: greedy answers with min_tokens, logit_bias and the
presence, frequency and repetition penalties are token for token `vllm.LLM`'s (float32, same prompt token ids).

One `vllm.LLM` for the module (its start takes a minute or two), every case asked of it in one batch.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from vllm import LLM as VLLM  # noqa: E402

from rayapp import LLM, SamplingParams  # noqa: E402
from rayapp.models.loader import resolve_model  # noqa: E402
from rayapp.vllm_ext.engine import _sampling  # noqa: E402

pytestmark = pytest.mark.slow

EOS = 2  # SmolLM2's <|im_end|>
QUESTIONS = [
    "Name three colours of the rainbow.",
    "Count from one to ten in words.",
    "Write one sentence about the sea.",
]
CASES = {
    "presence_and_frequency": SamplingParams(presence_penalty=1.5, frequency_penalty=0.8),
    "repetition": SamplingParams(repetition_penalty=1.3),
    "repetition_below_one": SamplingParams(repetition_penalty=0.8),
    "logit_bias": SamplingParams(logit_bias={11: 6.0, 30: -100.0, 284: 3.5}),
    "min_tokens_over_a_forced_eos": SamplingParams(min_tokens=12, logit_bias={EOS: 100.0}),
    "min_tokens_over_stop_token_ids": SamplingParams(min_tokens=5, stop_token_ids=(30,), logit_bias={30: 100.0}),
    "stop_string_after_min_tokens": SamplingParams(min_tokens=6, stop=["e"]),
    "everything": SamplingParams(
        presence_penalty=0.4,
        frequency_penalty=0.3,
        repetition_penalty=1.1,
        logit_bias={EOS: 5.0, 11: 2.0},
        min_tokens=8,
        stop_token_ids=(13,),
    ),
}
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def vllm_llm():
    llm = VLLM(str(resolve_model(None)), dtype="float32", kv_cache_memory_bytes=1 << 30, enforce_eager=True)
    yield llm
    llm.llm_engine.engine_core.shutdown()


@pytest.fixture(scope="module")
def prompts(vllm_llm) -> list[list[int]]:
    tokenizer = vllm_llm.get_tokenizer()
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        for q in QUESTIONS
    ]


def _greedy(params: SamplingParams) -> SamplingParams:
    fields = {k: getattr(params, k) for k in params.__dataclass_fields__}
    return SamplingParams(**{**fields, "temperature": 0.0, "max_tokens": MAX_TOKENS})


def test_greedy_answers_with_every_sampling_field_are_vllms(vllm_llm, prompts):
    asks = [(name, prompt, _greedy(params)) for name, params in CASES.items() for prompt in prompts]
    theirs = vllm_llm.generate(
        [{"prompt_token_ids": prompt} for _, prompt, _ in asks],
        # What rayapp's vLLM replicas hand vLLM (`vllm.LLM` asks for whole answers, not their deltas).
        [_sampling(params) for _, _, params in asks],
        use_tqdm=False,
    )
    ours = LLM(dtype="float32", num_pages=256).generate(
        prompt_token_ids=[prompt for _, prompt, _ in asks], sampling_params=[params for _, _, params in asks]
    )
    mismatches = [
        (name, i % len(prompts), o.outputs[0].token_ids, list(t.outputs[0].token_ids))
        for i, ((name, _, _), o, t) in enumerate(zip(asks, ours, theirs))
        if o.outputs[0].token_ids != list(t.outputs[0].token_ids) or o.outputs[0].text != t.outputs[0].text
    ]
    assert not mismatches
    # The cases did what they are named for (so the comparison is not vacuous).
    by_name = {name: o.outputs[0] for (name, _, _), o in zip(asks, ours)}
    assert by_name["min_tokens_over_a_forced_eos"].token_ids[12:] == [EOS]
    assert by_name["min_tokens_over_stop_token_ids"].token_ids[5:] == [30]

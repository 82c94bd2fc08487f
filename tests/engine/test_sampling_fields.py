"""min_tokens, logit_bias and the penalties through rayapp's engine on the shipped model, greedy: what a user of
vLLM's sampling fields sees (the tokens themselves are checked against vLLM in tests/vllm_ext)."""

from __future__ import annotations

import pytest

from rayapp import LLM, SamplingParams

EOS = 2  # SmolLM2's <|im_end|>
CAT = 2644  # " cat"
PROMPT = [504, 3458, 282, 4649, 314, 253]


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", num_pages=64)


def _answer(llm: LLM, params: SamplingParams, prompt: list[int] = PROMPT):
    return llm.generate(prompt_token_ids=prompt, sampling_params=params)[0].outputs[0]


def test_min_tokens_holds_back_eos_then_lets_it_end_the_answer(llm):
    eager = SamplingParams(temperature=0.0, max_tokens=20, logit_bias={EOS: 100.0})
    assert _answer(llm, eager).token_ids == [EOS]
    held = _answer(llm, SamplingParams(temperature=0.0, max_tokens=20, logit_bias={EOS: 100.0}, min_tokens=5))
    assert EOS not in held.token_ids[:5] and held.token_ids[5:] == [EOS] and held.finish_reason == "stop"


def test_min_tokens_holds_back_stop_token_ids_too(llm):
    params = SamplingParams(temperature=0.0, max_tokens=20, logit_bias={CAT: 100.0}, stop_token_ids=(CAT,))
    assert _answer(llm, params).token_ids == [CAT]
    held = _answer(llm, SamplingParams(**{**_fields(params), "min_tokens": 3}))
    assert held.token_ids[3:] == [CAT] and CAT not in held.token_ids[:3] and held.stop_reason == CAT
    # As vLLM's, the stop token's own text is not part of the answer.
    assert held.text == llm.get_tokenizer().decode(held.token_ids[:3])


def _fields(params: SamplingParams) -> dict:
    return {k: getattr(params, k) for k in params.__dataclass_fields__}


def test_logit_bias_forces_a_token_and_a_stop_string_waits_for_min_tokens(llm):
    forced = _answer(llm, SamplingParams(temperature=0.0, max_tokens=6, logit_bias={CAT: 100.0}, ignore_eos=True))
    assert forced.token_ids == [CAT] * 6 and forced.text == " cat" * 6
    # As vLLM: the stop string does not count in the first min_tokens tokens; the 4th completes it and ends there.
    params = SamplingParams(temperature=0.0, max_tokens=10, logit_bias={CAT: 100.0}, stop=["cat"], min_tokens=3)
    waited = _answer(llm, params)
    assert waited.token_ids == [CAT] * 4 and waited.text == " cat" * 3 + " " and waited.stop_reason == "cat"


def test_penalties_change_the_answer_without_touching_a_neighbour(llm):
    counting = llm.get_tokenizer().encode("1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2,")
    plain = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    penalised = SamplingParams(**{**_fields(plain), "repetition_penalty": 1.8, "presence_penalty": 1.5})
    alone = _answer(llm, plain, counting)
    together = llm.generate(prompt_token_ids=[counting, counting], sampling_params=[plain, penalised])
    assert together[0].outputs[0].token_ids == alone.token_ids
    changed = together[1].outputs[0].token_ids
    assert changed != alone.token_ids
    assert changed == _answer(llm, penalised, counting).token_ids


def test_frequency_penalty_grows_with_each_repeat_and_presence_penalty_does_not(llm):
    # A +10 bias makes " cat" every token; a frequency penalty of 2 takes 2 more off at each repeat until others win.
    params = SamplingParams(temperature=0.0, max_tokens=16, logit_bias={CAT: 10.0}, ignore_eos=True)
    assert _answer(llm, params).token_ids == [CAT] * 16
    assert _answer(llm, SamplingParams(**{**_fields(params), "presence_penalty": 2.0})).token_ids == [CAT] * 16
    penalised = _answer(llm, SamplingParams(**{**_fields(params), "frequency_penalty": 2.0})).token_ids
    assert penalised[0] == CAT and 1 < penalised.count(CAT) < 16


def test_a_logit_bias_outside_the_vocabulary_is_refused_saying_so(llm):
    with pytest.raises(ValueError, match="logit_bias.*49152"):
        _answer(llm, SamplingParams(logit_bias={49152: 1.0}))

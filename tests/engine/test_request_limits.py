"""One `RequestLimits.check` for the engine and the HTTP ingress: the engine lowers max_tokens to fit the context,
the ingress answers OpenAI's 400, and both reject the same prompts with the same errors."""

from __future__ import annotations

import pickle

import pytest

from rayapp.engine.request import LimitError, RequestLimits

ENGINE = RequestLimits(max_model_len=256, vocab_size=1000, num_pages=64, block_size=16)
# The ingress does not know the replicas' KV pool.
INGRESS = RequestLimits(max_model_len=256, vocab_size=1000, num_pages=None, block_size=16)


def test_the_engine_lowers_max_tokens_to_what_the_context_leaves():
    assert ENGINE.check([1] * 200, 100) == 56
    assert ENGINE.check([1] * 200, None) == 56


def test_the_api_rejects_max_tokens_past_the_context_with_openais_code():
    with pytest.raises(LimitError, match="maximum context length is 256 tokens, but 300 were requested") as error:
        INGRESS.check([1] * 200, 100, fit_max_tokens=False)
    assert (error.value.param, error.value.code) == ("prompt", "context_length_exceeded")
    assert INGRESS.check([1] * 200, 56, fit_max_tokens=False) == 56
    assert INGRESS.check([1] * 200, None, fit_max_tokens=False) == 56


@pytest.mark.parametrize("fit_max_tokens", [True, False])
def test_a_prompt_that_fills_the_context_is_rejected_either_way(fit_max_tokens):
    with pytest.raises(LimitError, match="maximum context length is 256 tokens") as error:
        INGRESS.check([1] * 256, None, fit_max_tokens=fit_max_tokens)
    assert error.value.code == "context_length_exceeded"


@pytest.mark.parametrize("limits", [ENGINE, INGRESS])
def test_engine_and_ingress_reject_bad_prompts_alike(limits):
    with pytest.raises(LimitError, match=r"prompt_token_ids must be integers in \[0, 1000\)") as error:
        limits.check([1, 1000], 4, fit_max_tokens=limits is ENGINE)
    assert error.value.param == "prompt" and isinstance(error.value, ValueError)
    with pytest.raises(LimitError, match="empty"):
        limits.check([], 4, fit_max_tokens=limits is ENGINE)


def test_only_the_engine_checks_its_pool():
    small = RequestLimits(max_model_len=256, vocab_size=1000, num_pages=4, block_size=16)
    with pytest.raises(LimitError, match="needs 5 KV pages but the pool has 4") as error:
        small.check([1] * 60, 16)
    assert error.value.param == "max_tokens"
    assert INGRESS.check([1] * 60, 16, fit_max_tokens=False) == 16


def test_a_limit_error_keeps_its_param_and_code_across_processes():
    # A replica's engine raises it; Ray pickles it to the ingress.
    error = pickle.loads(pickle.dumps(LimitError("too long", "prompt", "context_length_exceeded")))
    assert (str(error), error.param, error.code) == ("too long", "prompt", "context_length_exceeded")

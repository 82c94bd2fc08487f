"""A 10-turn conversation stores its shared history once and prefills only each turn's new tokens."""

from __future__ import annotations

import pytest

from rayapp import LLM, SamplingParams
from rayapp.models.tokenizer import chat_token_ids

pytestmark = pytest.mark.slow  # the real model over many turns

USER_TURNS = [
    "Hi! I am planning a trip to Norway.",
    "What should I pack for October?",
    "Which cities are worth a visit?",
    "How do I get from Oslo to Bergen?",
    "Is the train ride scenic?",
    "What food should I try there?",
    "Are things expensive?",
    "Any tips for seeing the northern lights?",
    "How many days would you plan in total?",
    "Thanks! Summarize the plan in one sentence.",
]


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def test_each_turn_prefills_only_new_tokens_and_history_is_stored_once():
    llm = LLM(dtype="float32")
    bs = llm.stats()["page_size"]
    tok = llm.get_tokenizer()
    params = SamplingParams(temperature=0.0, max_tokens=40)
    messages: list[dict[str, str]] = []
    previous: list[int] = []  # last turn's prompt + output tokens
    for turn, text in enumerate(USER_TURNS, start=1):
        messages.append({"role": "user", "content": text})
        prompt = chat_token_ids(tok, messages)
        out = llm.chat(messages, params)[0]
        if turn > 1:
            # The previous turn computed K/V for all its tokens but the last one it generated.
            reusable = min(_common_prefix(prompt, previous), len(previous) - 1, len(prompt) - 1)
            assert reusable > len(previous) - bs, f"turn {turn}: the template did not reproduce the history"
            assert out.num_cached_tokens == reusable // bs * bs, f"turn {turn}"
            assert len(prompt) - out.num_cached_tokens < len(prompt) - len(previous) + 2 * bs
        previous = prompt + out.outputs[0].token_ids
        messages.append({"role": "assistant", "content": out.outputs[0].text})
    stats = llm.stats()
    assert stats["pages_used"] == 0
    # Every cached page is a block of the final context: earlier turns' pages were reused, not copied.
    assert stats["pages_cached"] == (len(previous) - 1) // bs

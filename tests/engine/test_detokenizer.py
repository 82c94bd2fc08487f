"""Streaming text from the real SmolLM2 tokenizer: whole characters only, stop strings cut cleanly."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rayapp.engine.detokenizer import IncrementalDetokenizer
from rayapp.models.loader import prepare_default_model
from rayapp.models.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(prepare_default_model())


@pytest.fixture(scope="module")
def prompt(tokenizer):
    return tokenizer.encode("Write something:", add_special_tokens=False)


def _stream(tokenizer, prompt, ids, stop=(), skip_special_tokens=True):
    """Feed ids until done or stopped; return (deltas, flushed, detokenizer)."""
    detok = IncrementalDetokenizer(tokenizer, prompt, stop=stop, skip_special_tokens=skip_special_tokens)
    deltas = []
    for token_id in ids:
        deltas.append(detok.add_token(token_id))
        if detok.stop_matched is not None:
            break
    flushed = detok.flush()
    assert "".join(deltas) + flushed == detok.text
    return deltas, flushed, detok


def _ids(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def test_ascii_streams_token_by_token(tokenizer, prompt):
    ids = _ids(tokenizer, " The quick brown fox jumps over the lazy dog.")
    deltas, flushed, detok = _stream(tokenizer, prompt, ids)
    assert detok.text == tokenizer.decode(ids) == " The quick brown fox jumps over the lazy dog."
    assert all(deltas) and flushed == ""  # nothing to hold back: every token shows at once
    assert detok.stop_matched is None


@pytest.mark.parametrize(
    "text", [" 你好，世界！今天天气很好。", " 😀👍🏽 family: 👨‍👩‍👧", " café naïve Ærøskøbing Ελληνικά"]
)
def test_multibyte_characters_never_show_replacement_chars(tokenizer, prompt, text):
    ids = _ids(tokenizer, text)
    assert len(ids) > len(text.split()) + 2  # some characters really span several tokens
    deltas, flushed, detok = _stream(tokenizer, prompt, ids)
    assert not any("\ufffd" in d for d in deltas)
    assert "" in deltas  # a token ending mid-character was held back
    assert detok.text == tokenizer.decode(ids) == text


def test_first_token_keeps_its_leading_space(tokenizer):
    prompt = _ids(tokenizer, "Hello")
    ids = _ids(tokenizer, " world")
    deltas, _, detok = _stream(tokenizer, prompt, ids)
    assert deltas[0] == " world" and detok.text == " world"


def test_generation_cut_mid_character_drops_the_partial_bytes(tokenizer, prompt):
    ids = _ids(tokenizer, " ok 😀")
    ids = ids[:-1]  # the emoji's last byte never arrives
    assert tokenizer.decode(ids).endswith("\ufffd")
    deltas, flushed, detok = _stream(tokenizer, prompt, ids)
    assert detok.text == " ok " and "\ufffd" not in "".join(deltas) + flushed


def test_stop_inside_one_token(tokenizer, prompt):
    ids = _ids(tokenizer, " alpha beta gamma delta")
    deltas, _, detok = _stream(tokenizer, prompt, ids, stop=("et",))
    assert detok.stop_matched == "et"
    assert detok.text == " alpha b"
    assert len(deltas) == 2  # generation ended on the token holding the stop string


def test_stop_across_tokens(tokenizer, prompt):
    ids = _ids(tokenizer, " one two three four five")
    deltas, flushed, detok = _stream(tokenizer, prompt, ids, stop=("two three",))
    assert detok.stop_matched == "two three"
    assert detok.text == " one "
    assert deltas[-1] == "" and flushed == ""  # " " was shown before "two" looked like a stop start


def test_stop_at_the_very_start(tokenizer, prompt):
    ids = _ids(tokenizer, "STOP and nothing else")
    deltas, flushed, detok = _stream(tokenizer, prompt, ids, stop=("STOP",))
    assert detok.text == "" and "".join(deltas) + flushed == ""
    assert detok.stop_matched == "STOP"


def test_partial_stop_is_held_back_then_flushed(tokenizer, prompt):
    ids = _ids(tokenizer, " wait for the end")
    deltas, flushed, detok = _stream(tokenizer, prompt, ids, stop=("the end is near",))
    assert detok.stop_matched is None
    assert "".join(deltas) == " wait for " and flushed == "the end"
    assert detok.text == tokenizer.decode(ids)


def test_partial_stop_that_breaks_off_is_released(tokenizer, prompt):
    ids = _ids(tokenizer, " the end was not near")
    deltas, flushed, detok = _stream(tokenizer, prompt, ids, stop=("the end is",))
    assert detok.stop_matched is None and flushed == ""
    assert "".join(deltas) == detok.text == tokenizer.decode(ids)


def test_earliest_of_several_stops_wins(tokenizer, prompt):
    ids = _ids(tokenizer, " red green blue")
    # "green blue" completes last but starts first in the text; "blue" alone would start later.
    _, _, detok = _stream(tokenizer, prompt, ids, stop=("blue", "green blue"))
    assert detok.stop_matched == "green blue" and detok.text == " red "
    _, _, detok = _stream(tokenizer, prompt, ids, stop=("blue", "green"))
    assert detok.stop_matched == "green" and detok.text == " red "


def test_stop_in_multibyte_text(tokenizer, prompt):
    ids = _ids(tokenizer, " 你好，世界")
    deltas, _, detok = _stream(tokenizer, prompt, ids, stop=("世",))
    assert detok.text == " 你好，" and detok.stop_matched == "世"
    assert not any("\ufffd" in d for d in deltas)


def test_special_tokens_skipped_or_kept(tokenizer, prompt):
    ids = _ids(tokenizer, " hi") + [tokenizer.convert_tokens_to_ids("<|im_end|>")] + _ids(tokenizer, " there")
    _, _, skipped = _stream(tokenizer, prompt, ids)
    assert skipped.text == tokenizer.decode(ids, skip_special_tokens=True) == " hi there"
    _, _, kept = _stream(tokenizer, prompt, ids, skip_special_tokens=False)
    assert kept.text == tokenizer.decode(ids, skip_special_tokens=False) == " hi<|im_end|> there"


def test_chat_prompt_ending_in_special_tokens(tokenizer):
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    ids = _ids(tokenizer, "Hello! How can I help?") + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    _, _, detok = _stream(tokenizer, list(prompt), ids)
    assert detok.text == "Hello! How can I help?"


def test_empty_prompt_and_no_tokens(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [])
    assert detok.flush() == "" and detok.text == ""


def test_add_token_after_stop_is_a_caller_bug(tokenizer, prompt):
    _, _, detok = _stream(tokenizer, prompt, _ids(tokenizer, " a b c"), stop=("b",))
    with pytest.raises(RuntimeError):
        detok.add_token(_ids(tokenizer, " d")[0])


def test_long_output_decodes_only_a_window(tokenizer, prompt):
    calls = []

    class Counting:
        def decode(self, ids, **kwargs):
            calls.append(len(ids))
            return tokenizer.decode(ids, **kwargs)

    ids = _ids(tokenizer, " word" * 400)
    detok = IncrementalDetokenizer(Counting(), prompt)
    for token_id in ids:
        detok.add_token(token_id)
    assert detok.text == " word" * 400
    assert max(calls) <= 8  # a short window per token, never the whole output


# Mixed scripts so that tokens often end mid-character and leading spaces matter.
_ALPHABET = st.sampled_from(list("ab Z.,\n é漢字😀👍ñ€ßя") + ["🏽", "\u200d", "你好", "ção"])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    text=st.lists(_ALPHABET, max_size=20).map("".join),
    stop=st.lists(st.lists(_ALPHABET, min_size=1, max_size=3).map("".join), max_size=3).map(tuple),
    cut=st.integers(0, 2),
)
def test_random_mixed_script_text_round_trips(tokenizer, prompt, text, stop, cut):
    ids = _ids(tokenizer, text)
    ids = ids[: len(ids) - cut]  # generation may end mid-character: those bytes are dropped
    full = tokenizer.decode(ids)
    if cut == 0:
        assert full == text
    deltas, flushed, detok = _stream(tokenizer, prompt, ids, stop=stop)
    assert "\ufffd" not in "".join(deltas) + flushed
    assert detok.text == _expected_text(tokenizer, ids, stop)


def _expected_text(tokenizer, ids, stop):
    """Slow oracle: decode every prefix; the first one holding a stop ends generation, cut at its earliest match."""
    for end in range(1, len(ids) + 1):
        seen = tokenizer.decode(ids[:end])
        if end < len(ids) and seen.endswith("\ufffd"):
            continue  # mid-character: the streamer has not seen this text yet
        seen = seen.rstrip("\ufffd")
        cuts = [seen.find(s) for s in stop if s in seen]
        if cuts:
            return seen[: min(cuts)]
    return tokenizer.decode(ids).rstrip("\ufffd")


@pytest.mark.parametrize("stop", [(), ("capital of",), (" Paris.", "xyz")])
def test_an_answer_resumed_at_any_cut_streams_the_rest_of_the_same_text(tokenizer, prompt, stop):
    """A moved answer: a second detokenizer, given the tokens the first one streamed, returns exactly the rest."""
    ids = _ids(tokenizer, "The capital of France is Paris. Très bien: 東京 is the capital of Japan 🙂.")
    whole_deltas, whole_flush, whole = _stream(tokenizer, prompt, ids, stop)
    whole_text = "".join(whole_deltas) + whole_flush
    consumed = len(whole_deltas)  # tokens the first detokenizer read before it finished or stopped
    for cut in range(1, consumed):
        first = IncrementalDetokenizer(tokenizer, prompt, stop=stop)
        sent = "".join(first.add_token(t) for t in ids[:cut])
        second = IncrementalDetokenizer(
            tokenizer, prompt, stop=stop, delivered_ids=ids[:cut], delivered_chars=len(sent)
        )
        rest = []
        for token_id in ids[cut:]:
            rest.append(second.add_token(token_id))
            if second.stop_matched is not None:
                break
        rest.append(second.flush())
        assert sent + "".join(rest) == whole_text, cut
        assert second.stop_matched == whole.stop_matched
        # The first held back more (say, a fixed stop-length margin, as vLLM does): the second owes it.
        held = max(0, len(sent) - 4)
        third = IncrementalDetokenizer(tokenizer, prompt, stop=stop, delivered_ids=ids[:cut], delivered_chars=held)
        rest = [third.add_token(t) for t in ids[cut:consumed]] + [third.flush()]
        assert sent[:held] + "".join(rest) == whole_text, cut


def test_a_stop_string_counts_only_after_min_tokens(tokenizer, prompt):
    ids = _ids(tokenizer, " end one. end two. end three.")
    whole = tokenizer.decode(ids)
    detok = IncrementalDetokenizer(tokenizer, prompt, stop=("end",), min_tokens=3)
    streamed = [detok.add_token(t) for t in ids[:4]]
    # " end" completes at token 1, within the first 3: it stays; the next one, token 4, stops.
    assert detok.stop_matched == "end"
    assert "".join(streamed) + detok.flush() == detok.text == whole[: whole.index("end", 2)]
    assert detok.text == " end one. "


def test_min_tokens_counts_after_the_delivered_tokens_of_a_moved_answer(tokenizer, prompt):
    ids = _ids(tokenizer, " end one. end two. end three.")
    # 2 tokens delivered; min_tokens is what is left of the answer's 3 (1 more), as the ingress asks.
    detok = IncrementalDetokenizer(tokenizer, prompt, stop=("end",), delivered_ids=ids[:2], min_tokens=1)
    detok.add_token(ids[2])
    assert detok.stop_matched is None
    detok.add_token(ids[3])
    assert detok.stop_matched == "end" and detok.text == " end one. "

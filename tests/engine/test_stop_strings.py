"""The stop-string automaton against the plain definition: the earliest-starting stop that a piece completes."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from rayapp.engine.stop_strings import StopMatcher

_ALPHABET = "abc"


def _naive(stops, pieces):
    """(piece number, start in that piece, stop index) of the first match, by the definition; and the held length."""
    text = ""
    for n, piece in enumerate(pieces):
        before = len(text)
        text += piece
        # Matches that end inside this piece: earliest start, then the first listed.
        hits = [
            (start - before, i)
            for i, s in enumerate(stops)
            for start in range(max(0, before - len(s) + 1), len(text) - len(s) + 1)
            if text.startswith(s, start)
        ]
        if hits:
            return n, min(hits)
    return None


def _partial(stops, text):
    return max((k for s in stops for k in range(len(s)) if k and text.endswith(s[:k])), default=0)


@settings(max_examples=400, deadline=None)
@given(
    stops=st.lists(st.text(_ALPHABET, min_size=1, max_size=5), min_size=1, max_size=8),
    pieces=st.lists(st.text(_ALPHABET, max_size=6), max_size=8),
)
def test_first_match_and_held_text_equal_the_definition(stops, pieces):
    matcher = StopMatcher(stops)
    expected = _naive(stops, pieces)
    text = ""
    for n, piece in enumerate(pieces):
        hit = matcher.feed(piece)
        text += piece
        if expected is not None and n == expected[0]:
            assert hit == expected[1]
            return
        assert hit is None
        assert matcher.partial_len == _partial(stops, text)
    assert expected is None


def test_thousands_of_stop_strings_are_one_automaton():
    stops = [f"stop-{i:04d}!" for i in range(4000)]
    matcher = StopMatcher(stops)
    assert matcher.feed("text with stop-12 and stop-0") is None
    assert matcher.partial_len == len("stop-0")
    assert matcher.feed("999! more") == (-len("stop-0"), 999)

"""Token ids to streamed text: multi-byte UTF-8 safe, with stop strings (vLLM / TGI offsets technique).

Each step decodes only a short window: the tokens from `prefix_offset` on. The text the window's
first part (`prefix_offset:read_offset`) already produced is known, so the new text is the diff.
Decoding a window rather than the single new token keeps merges that depend on the neighbour
(leading spaces, bytes of one character split over several tokens) right.

Both offsets advance only when the new text is complete: while it ends in U+FFFD, the last
character is still missing bytes and the window simply grows until they arrive.
"""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

from rayapp.engine.stop_strings import StopMatcher

# Prompt tokens decoded before the first output token, as in vLLM: enough context for the
# tokenizer to decide the first output token's leading space.
_PROMPT_CONTEXT = 5
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """One request's output text, built token by token.

    Invariants: `text` is all complete output text so far (cut right before a matched stop
    string); the deltas returned so far are a prefix of `text`, and they plus `flush()` are all
    of it (with `delivered_ids`, of what follows the `delivered_chars` an earlier detokenizer returned).
    `text == tokenizer.decode(output_ids, skip_special_tokens=...)`, cut at the stop string,
    with two documented exceptions:
    - a generation that ends in the middle of a character (say `max_tokens` hit between the bytes
      of one emoji) drops those bytes instead of showing U+FFFD for them;
    - tokenizers that strip the first token's leading space on a bare decode (SentencePiece
      "legacy" mode) keep it here, because the prompt context says it belongs there.
    Tokenizers with `clean_up_tokenization_spaces=True` can also differ, since cleanup looks across
    window edges; byte-level BPE models (Llama 3, Qwen2, SmolLM2) have it off. A prompt that itself
    ends mid-character is not supported (its tail decodes to U+FFFD and the diff goes wrong).

    Stop strings are checked as text arrives: generation ends at the first token whose text
    completes one; if several complete on that token, the one starting earliest wins (then the
    first listed). Invalid bytes at the end of the text are held like an incomplete character
    until a token with complete text arrives, so a model emitting garbage bytes grows the window.
    As vLLM's, a stop string ends generation only at a token after the first `min_tokens` (counted
    after `delivered_ids`); one completed earlier stays in the text.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: list[int],
        stop: tuple[str, ...] = (),
        skip_special_tokens: bool = True,
        delivered_ids: Sequence[int] = (),
        delivered_chars: int | None = None,
        min_tokens: int = 0,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = tuple(stop)
        self.stop_matched: str | None = None
        self._stops = StopMatcher(self.stop)
        # Only the window is kept: ids before prefix_offset are never decoded again.
        self._window: list[int] = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self._read = len(self._window)  # window index of read_offset; prefix_offset is always 0
        self._prefix_text = self._decode(self._window)
        # text == "".join(self._emitted) + self._pending; _pending is held back (a possible stop start).
        self._emitted: list[str] = []
        self._pending = ""
        self._finished = False
        # Tokens read, and how many must be read before a stop string counts: none does among the delivered ones
        # (had one counted there, the answer would have ended before it moved).
        self._num_tokens, self._min_tokens = 0, min_tokens + len(delivered_ids)
        # Output whose text an earlier detokenizer already returned, `delivered_chars` of it (an answer moved to
        # another engine): read again so that `text`, the held-back text and the stop matcher continue where
        # that one stopped. It may have held back more or less than this one does: what it held back and this
        # one did not is owed to the next delta; what it returned and this one holds back is not returned again.
        self._owed, self._skip = "", 0
        for token_id in delivered_ids:
            self.add_token(token_id)
        shown = len(self.text) - len(self._pending)
        delivered = shown if delivered_chars is None else delivered_chars
        self._owed, self._skip = self.text[delivered:shown], max(0, delivered - shown)

    @property
    def text(self) -> str:
        """All output text so far (after a stop string matched: cut right before it).

        Joined on access (O(length)); stream with the returned deltas rather than reading this per step.
        """
        if len(self._emitted) > 1:
            self._emitted = ["".join(self._emitted)]
        return (self._emitted[0] if self._emitted else "") + self._pending

    def add_token(self, token_id: int) -> str:
        """Feed one generated token; return the new text that is safe to show now.

        Returns '' while a multi-byte character is incomplete or the text's end might still be the
        start of a stop string. Calling it after a stop string matched or after `flush()` is a bug
        in the caller and raises.
        """
        if self._finished or self.stop_matched is not None:
            raise RuntimeError("add_token after the detokenizer finished (stop string matched or flush called)")
        self._num_tokens += 1
        self._window.append(token_id)
        new_text = self._decode(self._window)
        if new_text.endswith(_REPLACEMENT) or len(new_text) <= len(self._prefix_text):
            # An incomplete character, or a token with no text (a skipped special token).
            return ""
        delta = new_text[len(self._prefix_text) :]
        # Advance: prefix_offset = read_offset, read_offset = end of the window.
        self._window = self._window[self._read :]
        self._read = len(self._window)
        self._prefix_text = self._decode(self._window)
        return self._add_text(delta, final=False)

    def flush(self) -> str:
        """At the end of generation: return all text held back, completing `text`.

        A held-back partial stop string that never completed is ordinary text and is returned.
        Bytes of a character cut off by the end of generation are dropped, not shown as U+FFFD
        (any U+FFFD run at the very end of the held window goes, invalid bytes included).
        """
        if self._finished:
            return ""
        self._finished = True
        held = self._decode(self._window)[len(self._prefix_text) :].rstrip(_REPLACEMENT)
        self._window = []
        return self._add_text(held, final=True)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _add_text(self, delta: str, final: bool) -> str:
        """Append complete new text, cut at a stop string, and return what is now safe to show."""
        if self.stop_matched is not None:
            return ""
        pending = self._pending + delta
        # Earlier matches would already have ended generation, so any match here is new and ends inside `delta`.
        hit = self._stops.feed(delta)
        if self._num_tokens <= self._min_tokens:
            hit = None  # the matcher still reads the text: a stop string that ends after min_tokens counts
        if hit is not None:
            start, i = hit  # earliest match wins; at the same position, the first listed stop
            self.stop_matched = self.stop[i]
            # Emitted text never holds a stop's first chars (they were pending), so the cut falls inside `pending`.
            show = len(pending) - len(delta) + start
        elif final:
            show = len(pending)
        else:
            show = len(pending) - self._stops.partial_len
        out, self._pending = pending[:show], ("" if hit is not None else pending[show:])
        if out:
            self._emitted.append(out)
        if not (self._owed or self._skip):
            return out
        out, self._owed = self._owed + out, ""
        skipped = min(self._skip, len(out))
        self._skip -= skipped
        return out[skipped:]

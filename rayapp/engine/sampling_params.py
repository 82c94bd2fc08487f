"""Per-request sampling settings, named as in vLLM so users can switch."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

# Most alternatives per token `logprobs` may ask for (OpenAI's chat API allows 20).
MAX_LOGPROBS = 20


@dataclass(frozen=True)
class StructuredOutput:
    """Output constrained to JSON: a value matching `json_schema` (JSON Schema text), or any JSON object when
    it is None (OpenAI's `response_format` json_schema and json_object)."""

    json_schema: str | None = None


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    `temperature == 0` is greedy. `top_k <= 0` (or -1) disables top-k. `seed` makes a sampled
    request reproducible. `stop` strings end generation and are cut from the text;
    `stop_token_ids` end generation like EOS does (unless `ignore_eos`, which only affects EOS).
    `logprobs`: each generated token's log-probability, with that many of the most likely tokens at
    its position (0: the generated token's only; None: none), as vLLM's `logprobs`. `structured`:
    constrained decoding to JSON (`StructuredOutput`). `n`: that many answers to the prompt, which is
    computed once (greedy ones would all be the same: n > 1 needs a temperature, as in vLLM); with a
    `seed`, answer i samples with `seed + i`, as vLLM's do.

    Logits processing, with vLLM's definitions and in its order: while fewer than `min_tokens` tokens
    were generated, the stop tokens (EOS unless `ignore_eos`, and `stop_token_ids`) are forbidden and
    stop strings do not end the generation; `logit_bias` (token id, bias) pairs are added to the
    logits (given as a mapping or pairs, stored sorted by id); `repetition_penalty` divides the
    positive logits (multiplies the others) of tokens in the prompt or the output;
    `frequency_penalty` subtracts itself times each token's count in the output and
    `presence_penalty` itself once from each token in the output. `min_p` (after temperature)
    drops tokens less likely than `min_p` times the most likely one.
    """

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None
    structured: StructuredOutput | None = None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)
    min_tokens: int = 0

    def __post_init__(self) -> None:
        # Accept a single string or any sequence from users, store an immutable tuple.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens <= 0):
            raise ValueError(f"max_tokens={self.max_tokens!r} must be an integer >= 1 (None: up to max_model_len)")
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature={self.temperature} must be in [0, 100]")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k={self.top_k!r} must be -1 (disabled), 0 (disabled) or a positive integer")
        if self.seed is not None and (not isinstance(self.seed, int) or not -(2**63) <= self.seed < 2**64):
            raise ValueError(f"seed={self.seed!r} must be an integer in [-2**63, 2**64)")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop must hold non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must hold non-negative integers")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs={self.logprobs!r} must be an integer in [0, {MAX_LOGPROBS}] (None: none)")
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n={self.n!r} must be an integer >= 1")
        if self.n > 1 and self.temperature == 0.0:
            raise ValueError(f"n={self.n} needs sampling: greedy answers (temperature 0) are all the same")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name}={getattr(self, name)} must be in [-2, 2]")
        if not 0.0 < self.repetition_penalty < math.inf:
            raise ValueError(
                f"repetition_penalty={self.repetition_penalty} must be greater than zero and finite (1: none)"
            )
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p={self.min_p} must be in [0, 1]")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise ValueError(f"min_tokens={self.min_tokens!r} must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens={self.min_tokens} must be at most max_tokens={self.max_tokens}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Whether any of the presence, frequency or repetition penalties changes the logits."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0


def _bias_pairs(bias: Mapping[int, float] | Iterable[tuple[int, float]] | None) -> tuple[tuple[int, float], ...]:
    """`logit_bias` as (token id, bias) pairs sorted by id (of repeated ids, the last given wins)."""
    pairs = dict(bias.items() if isinstance(bias, Mapping) else bias or ())
    if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in pairs):
        raise ValueError("logit_bias keys must be token ids: non-negative integers")
    if any(isinstance(b, bool) or not isinstance(b, int | float) or math.isnan(b) for b in pairs.values()):
        raise ValueError("logit_bias values must be numbers (not NaN)")
    return tuple(sorted((t, float(b)) for t, b in pairs.items()))

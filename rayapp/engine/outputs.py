"""What the engine hands back, shaped like vLLM's outputs so user code carries over."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability (log-softmax of the model's logits at its position, before any
    temperature or filtering, as vLLM's default `raw_logprobs`), and the `top` most likely tokens there
    with theirs, most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    # "stop" (EOS, a stop token or a stop string), "length" (max_tokens or max_model_len), "abort";
    # None while running.
    finish_reason: str | None = None
    # The stop string or stop token id that ended generation, when one did.
    stop_reason: str | int | None = None
    # What this output adds to the previous one of the same request (for streaming).
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    # With SamplingParams.logprobs: one per token of `token_ids` and of `delta_token_ids`.
    logprobs: list[TokenLogprob] | None = None
    delta_logprobs: list[TokenLogprob] | None = None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    # The request's answers (SamplingParams.n): all of them from `LLM.generate`; from `LLMEngine.step`, the
    # one that progressed (a request with n > 1 gets an output per answer that progressed in the step).
    outputs: list[CompletionOutput]
    # Every answer is finished.
    finished: bool
    # Prompt tokens whose K/V came from the prefix cache instead of being computed.
    num_cached_tokens: int
    metrics: RequestMetrics

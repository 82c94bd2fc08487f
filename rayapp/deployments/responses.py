"""OpenAI response bodies and server-sent events, built from a request's deltas as the official clients read them."""

from __future__ import annotations

import json
import time
from itertools import accumulate
from typing import Any

from transformers import PreTrainedTokenizerBase

from rayapp.deployments.tools import ToolAnswer
from rayapp.drivers.backend import GenerateDelta, Usage
from rayapp.engine.outputs import TokenLogprob

# JSON has no -inf: a token the model rules out is sent with this logprob, as vLLM's server does.
_LOWEST_LOGPROB = -9999.0


def event(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def usage_body(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def full_response(
    items: list[GenerateDelta],
    kind: str,
    response_id: str,
    model: str,
    logprobs: list[dict[str, Any] | None],
    tools: list[ToolAnswer] | None = None,
) -> dict[str, Any]:
    """The whole answer (`kind`: chat.completion or text_completion) from all of its deltas, a choice for each
    of the request's answers (`logprobs`: each one's; `tools`: how each holds tool calls, for a chat request
    with tools)."""
    texts: list[list[str]] = [[] for _ in logprobs]
    reasons: list[str | None] = [None] * len(logprobs)
    for item in items:
        texts[item.index].append(item.text)
        reasons[item.index] = item.finish_reason or reasons[item.index]
    choices = []
    for index, (parts, reason, answer_logprobs) in enumerate(zip(texts, reasons, logprobs)):
        if kind == "chat.completion":
            message: dict[str, Any] = {"role": "assistant", "content": "".join(parts)}
            if tools is not None:
                message["content"], calls = tools[index].parse(message["content"])
                reason = tools[index].finish_reason(reason)
                if calls:
                    message["tool_calls"] = calls
            choice = {"index": index, "message": message, "finish_reason": reason, "logprobs": answer_logprobs}
        else:
            choice = {"index": index, "text": "".join(parts), "finish_reason": reason, "logprobs": answer_logprobs}
        choices.append(choice)
    return {
        "id": response_id,
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage_body(items[-1].usage),
    }


def stream_chunk(
    response_id: str,
    created: int,
    model: str,
    chat: bool,
    text: str | None,
    finish_reason: str | None,
    role: bool = False,
    logprobs: dict[str, Any] | None = None,
    index: int = 0,
    tool_calls: list[dict[str, Any]] | None = None,
) -> str:
    """One event of a streamed answer (the request's `index`-th): a chat delta (`role`: the first, naming the
    assistant) or a text piece."""
    if chat:
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
        if text:
            delta["content"] = text
        if tool_calls:
            delta["tool_calls"] = tool_calls
        choice: dict[str, Any] = {"index": index, "delta": delta, "finish_reason": finish_reason}
    else:
        choice = {"index": index, "text": text or "", "finish_reason": finish_reason}
    if logprobs is not None:
        choice["logprobs"] = logprobs
    obj = "chat.completion.chunk" if chat else "text_completion"
    return event({"id": response_id, "object": obj, "created": created, "model": model, "choices": [choice]})


class LogprobsFormat:
    """Token logprobs in OpenAI's shapes, with each token id's text decoded once."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def text(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self.tokenizer.decode([token_id])
        return text

    def text_length(self, logprobs: list[TokenLogprob]) -> int:
        return sum(len(self.text(lp.token_id)) for lp in logprobs)

    def render(self, logprobs: list[TokenLogprob], chat: bool, text_offset: int = 0) -> dict[str, Any]:
        """A choice's `logprobs`: chat's `content` list, or the legacy endpoint's columns (`text_offset`: the
        answer's characters before the first of these tokens)."""
        if chat:

            def entry(token_id: int, logprob: float) -> dict[str, Any]:
                text = self.text(token_id)
                return {"token": text, "logprob": max(logprob, _LOWEST_LOGPROB), "bytes": list(text.encode("utf-8"))}

            content = [
                {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in logprobs
            ]
            return {"content": content}
        tokens = [self.text(lp.token_id) for lp in logprobs]
        return {
            "tokens": tokens,
            "token_logprobs": [max(lp.logprob, _LOWEST_LOGPROB) for lp in logprobs],
            "top_logprobs": [{self.text(t): max(v, _LOWEST_LOGPROB) for t, v in lp.top} for lp in logprobs],
            "text_offset": list(accumulate((len(t) for t in tokens), initial=text_offset))[:-1],
        }

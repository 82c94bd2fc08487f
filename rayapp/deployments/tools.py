"""Tool calling: tools through the chat template, tool calls out of the answer's text, as OpenAI's shapes.

rayapp parses the Hermes format: each call is a JSON object `{"name": ..., "arguments": {...}}` between
`<tool_call>` and `</tool_call>`, as the chat templates of Qwen2.5 / Qwen3, Hermes 2 and 3, SmolLM3 and
other ChatML models write it. A template that renders `tools` and shows that format is one rayapp can
serve tools with; any other gets a 400 naming what is missing.

`tool_choice`:
- `auto` (the default with tools): the model decides; its text is parsed for calls.
- `required`: constrained decoding to a JSON array of one or more calls of the given tools.
- a named function: constrained decoding to that function's `parameters`, which become its arguments.
- `none`: the tools are shown to the template, and the answer is text.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from jinja2 import meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

from rayapp.engine.sampling_params import StructuredOutput

CALL_START, CALL_END = "<tool_call>", "</tool_call>"
_CALLS = re.compile(re.escape(CALL_START) + r"(.*?)(?:" + re.escape(CALL_END) + r"|\Z)", re.S)


def template_problem(template: str | None) -> str | None:
    """Why a chat template cannot serve tools (None: it can)."""
    if template is None:
        return "this model has no chat template"
    if "tools" not in meta.find_undeclared_variables(ImmutableSandboxedEnvironment().parse(template)):
        return "this model's chat template does not render tools"
    if CALL_START not in template:
        return f"this model's chat template does not write tool calls as {CALL_START} (Hermes), which rayapp parses"
    return None


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def function_call(name: str, arguments: str) -> dict[str, Any]:
    """One entry of a message's `tool_calls`."""
    return {"id": call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


def forced_output(
    tools: list[dict[str, Any]], choice: str | dict[str, Any], parallel: bool = True
) -> StructuredOutput | None:
    """The constrained decoding a `tool_choice` asks for (None: free text); `parallel`: more than one call."""
    if isinstance(choice, dict):
        (function,) = [t["function"] for t in tools if t["function"]["name"] == choice["function"]["name"]]
        return StructuredOutput(json.dumps(_parameters(function)))
    if choice != "required":
        return None
    calls = [
        {
            "type": "object",
            "properties": {"name": {"enum": [t["function"]["name"]]}, "parameters": _parameters(t["function"])},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    array = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        array["maxItems"] = 1
    return StructuredOutput(json.dumps(array))


def _parameters(function: dict[str, Any]) -> dict[str, Any]:
    return function.get("parameters") or {"type": "object", "properties": {}}


def _hermes_call(body: str) -> dict[str, Any] | None:
    """A call from the JSON between the tags; None when it is not one."""
    try:
        call = json.loads(body)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    return function_call(call["name"], arguments if isinstance(arguments, str) else json.dumps(arguments))


class ToolAnswer:
    """One answer's text as content and tool calls, for a request with tools, all at once (`parse`) or as it
    streams (`feed`, then `finish`): content is sent as it comes, and each call once it is complete (text
    that could be the start of a call is held back until it is known not to be). Not `parallel`: the first
    call only (OpenAI's parallel_tool_calls false)."""

    def __init__(self, choice: str | dict[str, Any], parallel: bool = True) -> None:
        self.choice, self.parallel = choice, parallel
        self.named = choice["function"]["name"] if isinstance(choice, dict) else None
        self.num_calls = 0
        self._text = ""
        self._in_call = False

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """(content, tool calls) of a whole answer."""
        if self.named is not None:
            self.num_calls = 1
            return None, [function_call(self.named, text)]
        if self.choice == "required":
            calls = self._required(text)
            self.num_calls = len(calls)
            return None, calls
        calls, content, last = [], [], 0
        for match in _CALLS.finditer(text):
            call = _hermes_call(match.group(1).strip())
            if call is not None:  # what is not a call stays in the text
                calls.append(call)
                content.append(text[last : match.start()])
                last = match.end()
        content.append(text[last:])
        calls = calls if self.parallel else calls[:1]
        self.num_calls = len(calls)
        joined = "".join(content)
        return (joined.strip() if calls else joined) or None, calls

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """(content, tool call deltas) to stream for the answer's next `text`."""
        if self.named is not None:
            first = self.num_calls == 0
            self.num_calls = 1
            delta: dict[str, Any] = {"index": 0, "function": {"arguments": text}}
            if first:
                delta = {**function_call(self.named, text), "index": 0}
            return "", [delta] if text or first else []
        self._text += text
        if self.choice == "required":
            return "", []
        content, deltas = [], []
        while True:
            if not self._in_call:
                start = self._text.find(CALL_START)
                if start < 0:
                    held = _partial_suffix(self._text, CALL_START)
                    content.append(self._text[: len(self._text) - held])
                    self._text = self._text[len(self._text) - held :]
                    break
                content.append(self._text[:start])
                self._text, self._in_call = self._text[start + len(CALL_START) :], True
            end = self._text.find(CALL_END)
            if end < 0:
                break
            body, self._text, self._in_call = self._text[:end], self._text[end + len(CALL_END) :], False
            call = _hermes_call(body.strip())
            if call is None:
                content.append(CALL_START + body + CALL_END)
            elif self.parallel or not self.num_calls:
                deltas.append(self._indexed(call))
        return "".join(content), deltas

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """What `feed` still held back, once the answer is finished."""
        text, self._text = self._text, ""
        if self.named is not None:
            return "", []
        if self.choice == "required":
            return "", [self._indexed(call) for call in self._required(text)]
        if not self._in_call:
            return text, []
        call = _hermes_call(text.strip())  # the answer ended inside a call (its closing tag never came)
        if call is None:
            return CALL_START + text, []
        return "", [self._indexed(call)] if self.parallel or not self.num_calls else []

    def finish_reason(self, reason: str | None) -> str | None:
        """The answer's finish reason: `tool_calls` when the model chose to call (not when a call was forced by
        name, as OpenAI's)."""
        return "tool_calls" if reason == "stop" and self.num_calls and self.named is None else reason

    def _indexed(self, call: dict[str, Any]) -> dict[str, Any]:
        self.num_calls += 1
        return {"index": self.num_calls - 1, **call}

    def _required(self, text: str) -> list[dict[str, Any]]:
        """The calls of the JSON array `required` constrains the answer to: those complete when max_tokens cut
        it short too."""
        calls, decoder, at = [], json.JSONDecoder(), text.find("[") + 1
        while at > 0:
            while at < len(text) and text[at] in " \t\r\n,":
                at += 1
            try:
                call, at = decoder.raw_decode(text, at)
            except ValueError:  # the closing bracket, or a call max_tokens cut off
                break
            calls.append(function_call(call["name"], json.dumps(call["parameters"])))
        return calls


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper start of `marker`."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0

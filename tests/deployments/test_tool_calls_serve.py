"""Tool calling through the real Serve app and the official `openai` client, on each engine.

The shipped model's own template renders no tools (the main app answers tools with a 400, see
test_serve_app); this app sets `chat_template` to a ChatML template with tools in the Hermes format.
A 135M model rarely decides to call on its own, so the round trip forces the call by name (constrained
to the function's parameters), then sends the tool's result back and gets a text answer.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import openai
import pytest

from rayapp.config import AppConfig

MODEL = "SmolLM2-135M-Instruct"
TEMPLATE = str(Path(__file__).parent / "templates" / "chatml_tools.jinja")
CONFIGS = {
    "rayapp": AppConfig(dtype="float32", kv_cache_memory_gb=0.25, chat_template=TEMPLATE),
    "vllm": AppConfig(
        engine="vllm", dtype="float32", kv_cache_memory_gb=0.5, chat_template=TEMPLATE,
        engine_kwargs={"enforce_eager": True},
    ),
}  # fmt: skip
ENGINES = [
    "rayapp",
    pytest.param(
        "vllm", marks=pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
    ),
]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {"type": "function", "function": {"name": "get_time", "description": "The time now."}}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module", params=ENGINES)
def client(request, serve_app):
    with serve_app(CONFIGS[request.param]) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)


def _named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


def test_a_tool_call_and_its_result_round_trip(client):
    first = client.chat.completions.create(
        model=MODEL, messages=QUESTION, tools=[WEATHER, CLOCK], tool_choice=_named("get_weather"), max_tokens=40
    )
    message = first.choices[0].message
    (call,) = message.tool_calls
    arguments = json.loads(call.function.arguments)
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    assert set(arguments) == {"city", "unit"} and arguments["unit"] in ("celsius", "fahrenheit")
    assert first.choices[0].finish_reason == "stop"
    # The assistant's call and the tool's result go back in the conversation, as agent frameworks send them.
    history = [
        *QUESTION,
        message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 14, "sky": "cloudy"})},
    ]
    second = client.chat.completions.create(
        model=MODEL, messages=history, tools=[WEATHER, CLOCK], tool_choice="none", max_tokens=24, temperature=0
    )
    assert second.choices[0].message.content and not second.choices[0].message.tool_calls
    # The tool's result reached the model: the prompt holds the first turn, the call and the result.
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + 20


def test_a_streamed_named_call_arrives_as_argument_deltas(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=QUESTION, tools=[WEATHER], tool_choice=_named("get_weather"), max_tokens=40,
        stream=True,
    )  # fmt: skip
    deltas = [c.choices[0].delta for c in stream if c.choices and c.choices[0].delta.tool_calls]
    assert deltas[0].tool_calls[0].function.name == "get_weather" and deltas[0].tool_calls[0].id
    arguments = "".join(d.tool_calls[0].function.arguments or "" for d in deltas)
    assert set(json.loads(arguments)) == {"city", "unit"}


def test_required_calls_one_of_the_tools(client):
    reply = client.chat.completions.create(
        model=MODEL, messages=QUESTION, tools=[WEATHER, CLOCK], tool_choice="required", max_tokens=60,
        parallel_tool_calls=False,
    )  # fmt: skip
    calls = reply.choices[0].message.tool_calls
    assert len(calls) == 1 and all(c.function.name in ("get_weather", "get_time") for c in calls)
    assert all(isinstance(json.loads(c.function.arguments), dict) for c in calls)
    assert reply.choices[0].finish_reason == "tool_calls"


def test_bad_tool_requests_are_400s(client):
    for body, param in [
        ({"tools": [WEATHER], "tool_choice": _named("nope")}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"messages": [{"role": "tool", "content": "14"}]}, "messages"),
    ]:
        with pytest.raises(openai.BadRequestError) as error:
            client.chat.completions.create(**{"model": MODEL, "messages": QUESTION, "max_tokens": 4, **body})
        assert param in str(error.value)

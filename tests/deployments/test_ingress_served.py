"""The ingress served over the scripted backend (`scripted.ScriptedBackend`): what it refuses and how (OpenAI's
error bodies, naming the field), keys, its admission queue, and streams under concurrency. What the engines
answer, served, is `test_serve_app.py`'s."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from scripted import ScriptedBackend
from served import ASK_WEATHER, KEY, MODEL, QUESTION, TEMPLATE, WEATHER, error_of, named, post, stream_chat

from rayapp.config import AppConfig

CONFIG = AppConfig(api_keys=[KEY], max_queued_requests=40, chat_template=TEMPLATE)


@pytest.fixture(scope="module")
def base_url(serve_app):
    with serve_app(CONFIG, backend_cls=ScriptedBackend) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=KEY, max_retries=0)


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ("{not json", 400, None),
        (
            json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "a"}]}).replace('"a"', '"a\\ud800"'),
            400,
            None,
        ),
        ({"model": MODEL}, 400, "messages"),
        ({"model": MODEL, "messages": []}, 400, "messages"),
        ({"model": MODEL, "messages": QUESTION, "top_p": 1.5}, 400, "top_p"),
        ({"model": MODEL, "messages": QUESTION, "max_tokens": 0}, 400, "max_tokens"),
        ({"model": MODEL, "messages": QUESTION, "temperature": -1}, 400, "temperature"),
        ({"model": MODEL, "messages": QUESTION, "n": 17}, 400, "n"),
        ({"model": MODEL, "messages": QUESTION, "n": 0}, 400, "n"),
        ({"model": MODEL, "messages": QUESTION, "n": 2, "temperature": 0}, 400, None),
        ({"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages.0.role"),
        ({"model": "gpt-4", "messages": QUESTION}, 404, "model"),
        # Known fields that would change the answer and are not implemented: refused, never silently dropped.
        ({"model": MODEL, "messages": QUESTION, "response_format": {"type": "json_schema"}}, 400, "response_format"),
        ({"model": MODEL, "messages": QUESTION, "response_format": {"type": "yaml"}}, 400, "response_format.type"),
        ({"model": MODEL, "messages": QUESTION, "functions": [{"name": "f"}]}, 400, "functions"),
        ({"model": MODEL, "messages": QUESTION, "top_logprobs": 2}, 400, "top_logprobs"),
        ({"model": MODEL, "messages": QUESTION, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ],
)
def test_bad_requests_get_openai_errors(base_url, body, status, param):
    error = error_of(post(base_url, body), status)
    assert error["param"] == param


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"min_p": 1.5}, "min_p"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"49152": 1}}, "logit_bias"),
        ({"logit_bias": {"-1": 1}}, "logit_bias"),
        ({"max_tokens": 4, "min_tokens": 5}, "min_tokens"),
        ({"max_completion_tokens": 4, "min_tokens": 5}, "min_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
    ],
)
def test_sampling_fields_out_of_vllms_ranges_are_400s_naming_the_field(base_url, fields, param):
    error = error_of(post(base_url, {"model": MODEL, "messages": QUESTION, **fields}), 400)
    assert error["param"] == param and error["code"] != "unsupported_parameter"


def test_bad_tool_requests_are_400s(client):
    for body, param in [
        ({"tools": [WEATHER], "tool_choice": named("nope")}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"messages": [{"role": "tool", "content": "14"}]}, "messages"),
    ]:
        with pytest.raises(openai.BadRequestError) as error:
            client.chat.completions.create(**{"model": MODEL, "messages": ASK_WEATHER, "max_tokens": 4, **body})
        assert param in str(error.value)


def test_context_too_long_says_the_limit(base_url):
    long = [{"role": "user", "content": "word " * 9000}]
    error = error_of(post(base_url, {"model": MODEL, "messages": long}), 400)
    assert "8192" in error["message"] and error["code"] == "context_length_exceeded"


def test_missing_or_wrong_api_key_is_401(base_url):
    for key in (None, "wrong", KEY[:-1], KEY + "x", KEY.upper()):  # near misses too
        assert (
            error_of(post(base_url, {"model": MODEL, "messages": QUESTION}, key=key), 401)["code"] == "invalid_api_key"
        )
    assert httpx.get(f"{base_url}/v1/models").status_code == 401


def test_32_concurrent_streams_all_complete(base_url):
    def body(i: int) -> dict:
        return {
            "model": MODEL,
            "temperature": 0,
            "max_tokens": 12,
            "ignore_eos": True,
            "messages": [{"role": "user", "content": f"Count from {i} upwards."}],
        }

    async def all_of_them():
        headers = {"Authorization": f"Bearer {KEY}"}
        async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=300) as http:
            return await asyncio.gather(*(stream_chat(http, body(i)) for i in range(32)))

    results = asyncio.run(all_of_them())
    assert all(text and finish == "length" and done for text, finish, done in results)


def test_a_full_admission_queue_answers_429_and_the_server_recovers(base_url, client):
    async def burst():
        headers = {"Authorization": f"Bearer {KEY}"}
        body = {"model": MODEL, "messages": QUESTION, "max_tokens": 48, "ignore_eos": True}
        async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=300) as http:
            return await asyncio.gather(*(http.post("/v1/chat/completions", json=body) for _ in range(60)))

    responses = asyncio.run(burst())
    statuses = [r.status_code for r in responses]
    assert set(statuses) == {200, 429} and statuses.count(429) >= 1
    assert all(r.headers.get("retry-after") == "1" for r in responses if r.status_code == 429)
    assert client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4).choices[0].message.content

"""What the served tests share: the API key and model they use, requests, streamed answers and errors, and the
replicas' numbers on `/metrics`."""

from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path

import httpx

KEY = "test-key"
MODEL = "SmolLM2-135M-Instruct"
# The shipped model's template, byte for byte, plus tools in the Hermes format: answers without tools are the
# offline references' (rendered with the model's own template).
TEMPLATE = str(Path(__file__).parent / "templates" / "chatml_tools.jinja")


def metric(base_url: str, name: str) -> float:
    """Sum of a replica series; waits for the replicas' first push (twice a second, once the hub actor runs)."""
    deadline = time.monotonic() + 60
    while True:
        text = httpx.get(f"{base_url}/metrics").text
        values = [float(v) for v in re.findall(rf"^{name}{{[^}}]*}} (\S+)$", text, re.M)]
        if values:
            return sum(values)
        assert time.monotonic() < deadline, f"{name} not in /metrics"
        time.sleep(0.1)


def post(base_url: str, body: object, key: str | None = KEY, path: str = "/v1/chat/completions") -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    content = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return httpx.post(f"{base_url}{path}", content=content, headers=headers, timeout=120)


async def stream_chat(
    http: httpx.AsyncClient, body: dict, started: asyncio.Event | None = None
) -> tuple[str, str | None, bool]:
    """A streamed chat answer (`started` set at its first delta): its text, its finish reason, and whether the
    stream ended with [DONE] (a stream with an error event fails the test)."""
    text, finish, done = "", None, False
    async with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                for choice in chunk["choices"]:
                    text += choice["delta"].get("content") or ""
                    finish = choice["finish_reason"] or finish
                if started is not None:
                    started.set()
    return text, finish, done


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and "type" in error
    return error


# Longer than two of vLLM's 128-token pages, so repeating it hits the prefix cache on either engine.
SYSTEM = {
    "role": "system",
    "content": "You are a geography tutor. "
    + " ".join(
        f"Rule {i}: answer briefly, name the country, and never guess a number you do not know." for i in range(20)
    ),
}
QUESTION = [SYSTEM, {"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


# Tools as clients send them.
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
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


def named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}

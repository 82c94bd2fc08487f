"""Bad input and faults against the real Serve app (over the scripted backend: what is judged is the ingress'):
limits before work, 400s for malformed bodies, bounded and guarded metrics, keys from a file and the environment,
and a MetricsHub that comes back after it is killed."""

from __future__ import annotations

import concurrent.futures
import json
import re
import time
import uuid
from collections import Counter

import httpx
import pytest
import ray
from fastapi import FastAPI
from fastapi.testclient import TestClient
from scripted import ScriptedBackend

from rayapp.config import AppConfig, LimitSettings
from rayapp.deployments.ingress import API_KEYS_ENV, _count, _internal_error

MODEL = "SmolLM2-135M-Instruct"
FILE_KEY, ENV_KEY = "key-from-a-mounted-file", "key-from-the-environment"
LIMITS = LimitSettings(
    max_request_bytes=16 << 20, max_messages=8, max_prompt_chars=8_000_000, max_stop_strings=4, max_stop_chars=16
)


@pytest.fixture(scope="module")
def base_url(serve_app, tmp_path_factory):
    keys = tmp_path_factory.mktemp("secret") / "api-keys"
    keys.write_text(f"# one key per line\n{FILE_KEY}\n\n")
    config = AppConfig(kv_cache_memory_gb=0.25, api_keys_file=str(keys), authenticate_metrics=True, limits=LIMITS)
    with pytest.MonkeyPatch.context() as env:
        env.setenv(API_KEYS_ENV, f"other-key, {ENV_KEY}")  # Ray's workers inherit the driver's environment
        with serve_app(config, backend_cls=ScriptedBackend) as url:
            yield url


def _post(base_url: str, content: bytes | str | dict, key: str = FILE_KEY, **kwargs) -> httpx.Response:
    content = json.dumps(content) if isinstance(content, dict) else content
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    return httpx.post(f"{base_url}/v1/chat/completions", content=content, headers=headers, timeout=120, **kwargs)


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    return response.json()["error"]


def _chat(content: str = "Hi", **fields) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 4, **fields}


def test_keys_come_from_the_file_and_the_environment(base_url):
    assert _post(base_url, _chat(), key=FILE_KEY).status_code == 200
    assert _post(base_url, _chat(), key=ENV_KEY).status_code == 200
    assert _error(_post(base_url, _chat(), key="not-a-key"), 401)["code"] == "invalid_api_key"


def test_a_body_over_the_limit_is_413_whether_declared_or_streamed(base_url):
    big = json.dumps(_chat("x" * (17 << 20)))
    assert _error(_post(base_url, big), 413)["code"] == "request_too_large"

    def chunks():  # no Content-Length: the limit is counted as the body arrives
        for i in range(0, len(big), 1 << 20):
            yield big[i : i + (1 << 20)].encode()

    assert _error(_post(base_url, chunks()), 413)["code"] == "request_too_large"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}] * 9}, "messages"),
        (_chat("y" * 8_000_001), "messages"),
        (_chat(stop=["a", "b", "c", "d", "e"]), "stop"),
        (_chat(stop="seventeen chars!!"), "stop"),
    ],
)
def test_limits_are_400s_naming_the_field(base_url, body, param):
    assert _error(_post(base_url, body), 400)["param"] == param


@pytest.mark.parametrize(
    "content",
    [
        "[" * 200_000 + "]" * 200_000,
        '{"model": "x", "max_tokens": ' + "9" * 5000 + "}",
        b'{"model": "\xff\xfe", "messages": []}',
        '{"model": 5, "messages": {"role": "user"}}',
    ],
)
def test_malformed_bodies_are_400s(base_url, content):
    assert _error(_post(base_url, content), 400)["type"] == "invalid_request_error"


def test_tools_on_a_template_that_renders_none_are_a_400_saying_so(base_url):
    tool = {"type": "function", "function": {"name": "get_time"}}
    error = _error(_post(base_url, _chat(tools=[tool])), 400)
    assert error["param"] == "tools" and "does not render tools" in error["message"]
    call = {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}
    history = [{"role": "assistant", "content": None, "tool_calls": [call]}, {"role": "tool", "tool_call_id": "c1",
               "content": "noon"}]  # fmt: skip
    assert _error(_post(base_url, {"model": MODEL, "messages": history}), 400)["param"] == "messages"


def test_health_answers_while_a_large_request_is_prepared(base_url):
    # ~5 MB of text: seconds of templating and tokenizing (then a 400: far past the context).
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        large = pool.submit(_post, base_url, _chat("word " * 1_000_000))
        time.sleep(0.5)  # the body is uploaded and being prepared
        assert httpx.get(f"{base_url}/health", timeout=60).status_code == 200
        assert not large.done()
        assert _error(large.result(), 400)["code"] == "context_length_exceeded"


def _metrics(base_url: str) -> str:
    response = httpx.get(f"{base_url}/metrics", headers={"Authorization": f"Bearer {FILE_KEY}"}, timeout=30)
    assert response.status_code == 200
    return response.text


def test_metrics_ask_for_a_key_and_unknown_paths_share_one_label(base_url):
    assert httpx.get(f"{base_url}/metrics").status_code == 401
    for _ in range(20):
        assert httpx.get(f"{base_url}/{uuid.uuid4().hex}").status_code == 404
    endpoints = set(re.findall(r'^rayapp_http_requests_total{endpoint="([^"]*)"', _metrics(base_url), re.M))
    assert "other" in endpoints
    assert endpoints <= {"/health", "/metrics", "/v1/models", "/v1/chat/completions", "/v1/completions", "other"}


def test_metrics_come_back_after_the_hub_is_killed(base_url):
    assert "rayapp_pages_total{" in _metrics(base_url)
    ray.kill(ray.get_actor("rayapp-metrics-rayapp", namespace="rayapp"))
    deadline = time.monotonic() + 60
    while "rayapp_pages_total{" not in _metrics(base_url):  # the ingress' own series answer meanwhile
        assert time.monotonic() < deadline, "the replicas' series did not come back after the MetricsHub died"
        time.sleep(0.5)


def test_a_500_is_counted_and_says_nothing_internal():
    app = FastAPI()
    app.state.http_requests = Counter()
    app.middleware("http")(_count)
    app.exception_handler(Exception)(_internal_error)

    @app.post("/v1/completions")
    async def broken():
        raise RuntimeError("database at 10.1.2.3:5432 password=hunter2")

    response = TestClient(app, raise_server_exceptions=False).post("/v1/completions")
    assert response.status_code == 500
    assert "hunter2" not in response.text and "10.1.2.3" not in response.text
    assert response.json()["error"]["type"] == "internal_error"
    assert app.state.http_requests == {("/v1/completions", "500"): 1}

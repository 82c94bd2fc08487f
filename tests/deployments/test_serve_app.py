"""The real Serve app on this machine, spoken to by the official `openai` client and raw HTTP.

One application per engine (`engine: rayapp`, then `engine: vllm` where vLLM is installed), each
started with `serve.run` of the same builder that `rayapp.config.yaml` names, with an API key
configured so authentication is exercised too. Each engine's answers are checked against a
reference we did not write for it: rayapp's offline `LLM` (itself checked token for token against
transformers), and `vllm.LLM` offline on the same token ids.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import re
import time

import httpx
import openai
import psutil
import pytest
import ray
from ray import serve
from served import ASK_WEATHER, CLOCK, KEY, MODEL, QUESTION, SYSTEM, TEMPLATE, WEATHER, error_of, metric, named, post

from rayapp import LLM, SamplingParams
from rayapp.config import AppConfig
from rayapp.models.tokenizer import chat_token_ids
from rayapp.prefix_router.actor import prefix_index

CONFIGS = {
    "rayapp": AppConfig(
        dtype="float32", api_keys=[KEY], max_queued_requests=40, kv_cache_memory_gb=0.5, chat_template=TEMPLATE
    ),
    "vllm": AppConfig(
        engine="vllm",
        dtype="float32",
        api_keys=[KEY],
        max_queued_requests=40,
        kv_cache_memory_gb=0.5,
        engine_kwargs={"enforce_eager": True},
        chat_template=TEMPLATE,
    ),
}
ENGINES = [
    "rayapp",
    pytest.param(
        "vllm", marks=pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
    ),
]


@pytest.fixture(scope="module", params=ENGINES)
def config(request) -> AppConfig:
    return CONFIGS[request.param]


@pytest.fixture(scope="module")
def base_url(serve_app, config):
    with serve_app(config) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def offline(config, model_dir, tokenizer):
    """`offline(messages, max_tokens)`: the reference greedy answer of the engine under test;
    `offline.logprobs(messages, max_tokens, k)`: its tokens' (logprob, top-k logprobs) per position."""
    if config.engine == "rayapp":
        llm = LLM(dtype="float32", kv_cache_memory_gb=0.5)

        def generate(messages, n, k=None):
            out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=n, logprobs=k))[0].outputs[0]
            lps = [(lp.logprob, [v for _, v in lp.top]) for lp in out.logprobs or ()]
            return out.text, lps

        yield _Reference(generate)
        return
    import vllm
    from vllm.inputs import TokensPrompt

    reference = vllm.LLM(
        model=str(model_dir),
        dtype="float32",
        enforce_eager=True,
        block_size=config.kv_block_size(),
        kv_cache_memory_bytes=1 << 29,
    )

    def generate(messages, n, k=None):
        prompt = TokensPrompt(prompt_token_ids=chat_token_ids(tokenizer, messages))
        params = vllm.SamplingParams(temperature=0, max_tokens=n, logprobs=k)
        out = reference.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        lps = []
        for token, position in zip(out.token_ids, out.logprobs or ()):
            ranked = sorted(position.items(), key=lambda item: item[1].rank)
            lps.append((position[token].logprob, [lp.logprob for _, lp in ranked if lp.rank <= k]))
        return out.text, lps

    yield _Reference(generate)
    reference.llm_engine.engine_core.shutdown()


class _Reference:
    def __init__(self, generate) -> None:
        self._generate = generate

    def __call__(self, messages, n):
        return self._generate(messages, n)[0]

    def logprobs(self, messages, n, k):
        return self._generate(messages, n, k)[1]


def test_health_models_and_metrics_answer(base_url, client):
    assert httpx.get(f"{base_url}/health").status_code == 200
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert metric(base_url, "rayapp_pages_total") > 0


def test_the_engines_kv_events_reach_the_routers_index(client, config):
    """The engine's own KV events (rayapp's, or vLLM's through `rayapp.vllm_ext.kv_events`) feed the PrefixIndex
    the router matches prompts against (the router itself is judged over the scripted backend). First of the
    module's generations: no block is evicted meanwhile, so every one of the prompt's full blocks adds one."""
    index = prefix_index("rayapp", config.router)
    before = ray.get(index.stats.remote())["blocks"]
    opening = " ".join(f"Fact {i}: the lighthouse keeper counted {i * 7} ships." for i in range(40))
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": opening}], max_tokens=2)
    stored = before + reply.usage.prompt_tokens // config.kv_block_size()
    deadline = time.monotonic() + 30
    while ray.get(index.stats.remote())["blocks"] < stored:
        assert time.monotonic() < deadline, "the prompt's blocks never reached the PrefixIndex"
        time.sleep(0.2)


@pytest.mark.parametrize(
    "messages",
    [
        QUESTION,
        [{"role": "user", "content": "Write a haiku about the sea."}],
        [{"role": "user", "content": "List three rivers of Africa, one per line."}],
    ],
)
def test_chat_answer_equals_the_engines_offline_greedy_answer(client, offline, messages):
    reply = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=32)
    assert reply.choices[0].message.content == offline(messages, 32)
    assert reply.usage.completion_tokens > 0 and reply.usage.prompt_tokens > 0


def test_streamed_chat_joins_to_the_same_answer_with_usage_last(client, offline):
    stream = client.chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        temperature=0,
        max_tokens=32,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == offline(QUESTION, 32)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0  # the question was asked before


def test_n_answers_to_one_prompt_streamed_or_not(client):
    sampled = dict(model=MODEL, messages=QUESTION, temperature=1.0, seed=3, max_tokens=16, n=3)
    reply = client.chat.completions.create(**sampled)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    texts = [c.message.content for c in reply.choices]
    assert len(set(texts)) > 1 and all(c.finish_reason in ("stop", "length") for c in reply.choices)
    single = client.chat.completions.create(**{**sampled, "n": 1})
    assert single.choices[0].message.content == texts[0]  # answer 0 samples with the request's seed
    assert reply.usage.prompt_tokens == single.usage.prompt_tokens
    chunks = list(client.chat.completions.create(**sampled, stream=True, stream_options={"include_usage": True}))
    streamed = ["".join(c.delta.content or "" for k in chunks for c in k.choices if c.index == i) for i in range(3)]
    assert streamed == texts
    assert chunks[-1].usage.completion_tokens == reply.usage.completion_tokens > single.usage.completion_tokens


def test_logprobs_are_the_engines_own_streamed_or_not(base_url, client, offline):
    expected = offline.logprobs(QUESTION, 12, 3)
    reply = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=12, temperature=0, logprobs=True, top_logprobs=3
    )
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens == len(expected)
    for got, (logprob, top) in zip(content, expected):
        assert abs(got.logprob - logprob) < 1e-4 and [t.logprob for t in got.top_logprobs] == pytest.approx(
            top, abs=1e-4
        )
        assert bytes(got.bytes).decode("utf-8", "replace") == got.token
    # Every generated token has its entry, the end-of-turn token too (whose text the answer leaves out).
    assert "".join(t.token for t in content).startswith(reply.choices[0].message.content)
    stream = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=12, temperature=0, logprobs=True, top_logprobs=3, stream=True
    )
    streamed = [t for chunk in stream for c in chunk.choices if c.logprobs for t in c.logprobs.content]
    assert [t.logprob for t in streamed] == [t.logprob for t in content]
    legacy = post(
        base_url,
        {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 4, "logprobs": 2, "ignore_eos": True},
        path="/v1/completions",
    ).json()["choices"][0]["logprobs"]
    assert len(legacy["tokens"]) == len(legacy["token_logprobs"]) == len(legacy["top_logprobs"]) == 4
    assert legacy["text_offset"][0] == 0 and all(len(top) == 2 for top in legacy["top_logprobs"])


def _schema(properties: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": properties, "required": required or list(properties),
            "additionalProperties": False}  # fmt: skip


NAME = {"type": "string", "minLength": 1, "maxLength": 24}
SCHEMAS = [
    _schema({"city": NAME, "country": NAME}),
    _schema({"answer": {"type": "string", "enum": ["yes", "no", "unsure"]}}),
    _schema({"colors": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 3}}),
    _schema({"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 150}}),
    _schema({"planet": NAME, "moons": {"type": "integer", "minimum": 0, "maximum": 200}}),
    _schema({"book": _schema({"title": NAME, "year": {"type": "integer", "minimum": 1000, "maximum": 2100}})}),
    _schema({"steps": {"type": "array", "items": _schema({"n": {"type": "integer"}, "do": NAME}), "maxItems": 3}}),
    _schema({"sentiment": {"enum": ["positive", "negative", "neutral"]}, "score": {"type": "number"}}),
    _schema({"ok": {"type": "boolean"}}),
    _schema({"primes": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 4}}),
]
PROMPTS = [
    "Where is the Eiffel Tower?", "Is the sky green?", "Name some colors of a rainbow.", "Invent a person.",
    "Describe Mars.", "Name a famous novel.", "How do I boil an egg?", "I love this movie!", "Is water wet?",
    "List small prime numbers.",
]  # fmt: skip


def test_structured_output_parses_and_validates_against_its_schema(base_url):
    import jsonschema

    async def one(http: httpx.AsyncClient, schema: dict | None, prompt: str) -> tuple[dict | None, dict]:
        if schema is None:
            response_format = {"type": "json_object"}
        else:
            response_format = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
        hint = "Answer in JSON." if schema else 'Reply with a JSON object whose only key is "answer", in a few words.'
        messages = [{"role": "user", "content": f"{prompt} {hint}"}]
        body = {
            "model": MODEL,
            "messages": messages,
            "max_tokens": 400,
            "temperature": 0,
            "response_format": response_format,
        }
        response = await http.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        return schema, response.json()["choices"][0]

    async def all_of_them():
        cases = [(schema, prompt) for schema, prompt in zip(SCHEMAS, PROMPTS)] + [(None, p) for p in PROMPTS]
        cases += [(SCHEMAS[i], PROMPTS[(i + 3) % 10]) for i in range(10)]
        async with httpx.AsyncClient(
            base_url=base_url, headers={"Authorization": f"Bearer {KEY}"}, timeout=600
        ) as http:
            return await asyncio.gather(*(one(http, schema, prompt) for schema, prompt in cases))

    finished_objects = 0
    for schema, choice in asyncio.run(all_of_them()):
        if schema is None and choice["finish_reason"] == "length":
            continue  # a free object's string can run on (the 135M model loops in some): the grammar cannot end it
        assert choice["finish_reason"] == "stop", choice
        text = choice["message"]["content"]
        value = json.loads(text)
        if schema is not None:  # compact on both engines (xgrammar's free objects keep a space after commas)
            assert text == json.dumps(value, ensure_ascii=False, separators=(",", ":")), text
        assert "\n" not in text, text
        if schema is None:
            assert isinstance(value, dict)
            finished_objects += 1
        else:
            jsonschema.validate(value, schema)
    assert finished_objects >= 3
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": 5}}}
    error = error_of(post(base_url, {"model": MODEL, "messages": QUESTION, "response_format": bad}), 400)
    assert "properties" in error["message"]


def test_second_turn_reuses_the_first_turns_pages(client, offline, config):
    messages = [SYSTEM, {"role": "user", "content": "Name a large river in Europe."}]
    first = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=24)
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "How long is it?"},
    ]
    second = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=24)
    # Every full page of the first turn's prompt (a block size short of all of it, at most) is reused.
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - config.kv_block_size()
    assert second.choices[0].message.content == offline(messages, 24)


def test_completions_endpoint(base_url, client):
    reply = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=5, temperature=0)
    assert reply.choices[0].text and reply.usage.completion_tokens == 5


def test_every_vllm_sampling_field_is_served(base_url, client, tokenizer):
    (cat,) = tokenizer.encode(" cat")
    # A +100 bias makes " cat" every token; what the penalties take off never makes up for it.
    fields = {
        "presence_penalty": 0.5, "frequency_penalty": 0.3, "repetition_penalty": 1.2, "min_p": 0.05, "min_tokens": 4,
        "logit_bias": {str(cat): 100},
    }  # fmt: skip
    chat = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=6, temperature=0, extra_body=fields
    )
    assert chat.choices[0].message.content == " cat" * 6
    body = {"model": MODEL, "prompt": "Pets:", "max_tokens": 5, "temperature": 0.7, "seed": 1, **fields}
    completion = post(base_url, body, path="/v1/completions")
    assert completion.status_code == 200, completion.text
    assert completion.json()["choices"][0]["text"] == " cat" * 5


# Tool calling. A 135M model rarely decides to call on its own, so the round trip forces the call by name
# (constrained to the function's parameters), then sends the tool's result back and gets a text answer.
def test_a_tool_call_and_its_result_round_trip(client):
    first = client.chat.completions.create(
        model=MODEL, messages=ASK_WEATHER, tools=[WEATHER, CLOCK], tool_choice=named("get_weather"), max_tokens=40
    )
    message = first.choices[0].message
    (call,) = message.tool_calls
    arguments = json.loads(call.function.arguments)
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    assert set(arguments) == {"city", "unit"} and arguments["unit"] in ("celsius", "fahrenheit")
    assert first.choices[0].finish_reason == "stop"
    # The assistant's call and the tool's result go back in the conversation, as agent frameworks send them.
    history = [
        *ASK_WEATHER,
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
        model=MODEL, messages=ASK_WEATHER, tools=[WEATHER], tool_choice=named("get_weather"), max_tokens=40,
        stream=True,
    )  # fmt: skip
    deltas = [c.choices[0].delta for c in stream if c.choices and c.choices[0].delta.tool_calls]
    assert deltas[0].tool_calls[0].function.name == "get_weather" and deltas[0].tool_calls[0].id
    arguments = "".join(d.tool_calls[0].function.arguments or "" for d in deltas)
    assert set(json.loads(arguments)) == {"city", "unit"}


def test_required_calls_one_of_the_tools(client):
    reply = client.chat.completions.create(
        model=MODEL, messages=ASK_WEATHER, tools=[WEATHER, CLOCK], tool_choice="required", max_tokens=60,
        parallel_tool_calls=False,
    )  # fmt: skip
    calls = reply.choices[0].message.tool_calls
    assert len(calls) == 1 and all(c.function.name in ("get_weather", "get_time") for c in calls)
    assert all(isinstance(json.loads(c.function.arguments), dict) for c in calls)
    assert reply.choices[0].finish_reason == "tool_calls"


def test_client_that_disconnects_mid_stream_frees_its_pages(base_url):
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 2000, "ignore_eos": True, "stream": True}
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body, headers=headers, timeout=60) as response:
        for i, _ in enumerate(response.iter_lines()):
            if i == 6:
                break  # leave mid-stream: the connection closes here
    # The replica publishes its page counts twice a second; give it a bounded while.
    deadline = time.monotonic() + 30
    while (
        metric(base_url, "rayapp_pages_free") != metric(base_url, "rayapp_pages_total")
        or metric(base_url, "rayapp_num_running") != 0
    ):
        assert time.monotonic() < deadline, "the request was not aborted and its pages freed after the client left"
        time.sleep(0.25)
    assert metric(base_url, "rayapp_requests_total") > 0


def test_metrics_cover_the_required_series(base_url):
    text = httpx.get(f"{base_url}/metrics").text
    for name in (
        "rayapp_prompt_tokens_total",
        "rayapp_cached_prompt_tokens_total",
        "rayapp_generation_tokens_total",
        "rayapp_pages_free",
        "rayapp_pages_total",
        "rayapp_num_waiting",
        "rayapp_http_requests_total",
        "rayapp_time_to_first_token_seconds_bucket",
        "rayapp_inter_token_latency_seconds_bucket",
    ):
        assert re.search(rf"^{name}{{.*replica=|^{name}{{.*status=", text, re.M), name
    assert metric(base_url, "rayapp_cached_prompt_tokens_total") > 0


def _the_engine_process() -> psutil.Process:
    """The replica's engine process (vLLM's engine core, or rayapp's engine process), by the PID the replica holds."""
    pid = serve.get_deployment_handle("LLMReplica", app_name="rayapp").engine_pid.remote().result()
    assert pid is not None, "the replica's engine steps in the replica's own process"
    return psutil.Process(pid)


def test_a_vllm_replica_on_cpu_steps_its_model_in_its_engine_core(base_url, config):
    """No worker process of vLLM's beside the engine core, spinning between steps (cpu_binding.one_process_engine)."""
    if config.engine != "vllm":
        pytest.skip("vLLM replicas only")
    children = _the_engine_process().children(recursive=True)
    assert [p.name() for p in children if "Worker" in p.name() or "Worker" in " ".join(p.cmdline())] == []


def test_a_dead_engine_process_fails_the_health_check_and_the_replica_is_replaced(base_url, client, config):
    core = _the_engine_process()
    core.kill()
    # Until Serve replaces the replica, requests fail fast (5xx), never hang; then they are answered again.
    deadline = time.monotonic() + 300
    while True:
        response = post(base_url, {"model": MODEL, "messages": QUESTION, "max_tokens": 4})
        if response.status_code == 200:
            break
        assert response.status_code >= 500, response.text
        assert time.monotonic() < deadline, "the replica with a dead engine process was never replaced"
        time.sleep(2)
    assert _the_engine_process().pid != core.pid

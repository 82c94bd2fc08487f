"""The router's renderer turns Ray Serve LLM's OpenAI requests into the token ids the replica's vLLM computes: the
model's chat template (as its tokenizer applies it), the tenant's `cache_salt`; a batch of prompts is no one prompt."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("vllm")
pytest.importorskip("ray.serve.llm")

from ray.serve.llm.openai_api_models import ChatCompletionRequest, CompletionRequest  # noqa: E402

from rayapp.integrations.ray_serve_llm import (
    parse_section,  # noqa: E402
    with_rayapp,  # noqa: E402
)
from rayapp.vllm_ext.renderer import PromptRenderer  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"


def test_requests_render_as_the_replica_renders_them(serve_llm_args, tokenizer):
    from ray.serve.llm import LLMServingArgs

    (config,) = LLMServingArgs.model_validate(serve_llm_args()).llm_configs
    routed = with_rayapp(config, parse_section(None))
    renderer = PromptRenderer(routed.deployment_config["request_router_config"]["request_router_kwargs"]["llm_config"])
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a river."}]
    chat = ChatCompletionRequest(model=MODEL, messages=messages, cache_salt="tenant-a")
    text = "Once upon a time"

    async def render():
        return await asyncio.gather(
            renderer.render(chat),
            renderer.render(CompletionRequest(model=MODEL, prompt=text)),
            renderer.render(CompletionRequest(model=MODEL, prompt=[text, text])),
        )

    chat_prompt, completion_prompt, batch = asyncio.run(render())
    expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert chat_prompt.token_ids == tuple(expected) and chat_prompt.cache_salt == "tenant-a"
    assert completion_prompt.token_ids == tuple(tokenizer(text)["input_ids"]) and completion_prompt.cache_salt == ""
    assert batch is None

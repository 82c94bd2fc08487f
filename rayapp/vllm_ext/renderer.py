"""A request's prompt token ids in the router's process, rendered by vLLM's own code exactly as the replica will.

Ray Serve LLM's ingress hands the replicas the OpenAI request (`ChatCompletionRequest`, `CompletionRequest`), not
token ids; the replica's vLLM templates and tokenizes it with its `OnlineRenderer`. `PromptRenderer` builds that
same renderer here, from the same `VllmConfig` and frontend arguments Ray Serve LLM's `VLLMEngine` starts vLLM
with (vLLM's CPU-only render-server bootstrap, `init_render_app_state`, as Ray's own KV-aware router does on the
CPU), so the chat template, its content format, default template kwargs and tokenizer are the replica's, and the
token ids (and `cache_salt`) the router hashes are the ones vLLM's KV events will carry for the same request.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import logging
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

# The first requests wait this long for the renderer (loading the tokenizer, ~2 s); later ones never wait. Past
# it they are routed by load until the renderer is ready.
READY_WAIT_S = 10.0


@dataclass(frozen=True)
class Prompt:
    """What the replica's vLLM will compute for a request: its prompt token ids and tenant salt."""

    token_ids: tuple[int, ...]
    cache_salt: str


@dataclass(frozen=True)
class _Renderer:
    online: Any  # vllm.renderers.online_renderer.OnlineRenderer
    model_config: Any  # vllm.config.ModelConfig


def _build(llm_config: dict[str, Any]) -> _Renderer:
    """vLLM's renderer for the deployment `llm_config` (a dumped `LLMConfig`), built on this thread."""
    from ray.llm._internal.serve.engines.vllm.vllm_engine import _get_vllm_engine_config
    from ray.serve.llm import LLMConfig
    from starlette.datastructures import State
    from vllm.entrypoints.launchers.cli_args import FrontendArgs
    from vllm.entrypoints.launchers.render.app_state import init_render_app_state

    config = LLMConfig.model_validate(llm_config)
    # What VLLMEngine.start() builds on the replica, made for the CPU (this process has no accelerator to ask).
    engine_args, vllm_config = _get_vllm_engine_config(config, device_type="cpu")
    frontend = FrontendArgs(**config.get_engine_config().frontend_kwargs)
    state = State()
    # The renderer keeps no event loop: built under this thread's own, it renders under the router's.
    asyncio.run(init_render_app_state(vllm_config, state, argparse.Namespace(**(vars(frontend) | vars(engine_args)))))
    return _Renderer(state.online_renderer, vllm_config.model_config)


class PromptRenderer:
    """Renders requests as the replica's vLLM will; built in the background from the time it is made."""

    def __init__(self, llm_config: dict[str, Any]) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rayapp-renderer")
        self._building = self._pool.submit(_build, llm_config)
        self._building.add_done_callback(lambda _: self._pool.shutdown(wait=False))
        self._renderer: _Renderer | None = None
        self._failed = False

    async def render(self, request: Any) -> Prompt | None:
        """The request's prompt, or None: not one prompt (a batch, embeddings), not renderable (the replica
        answers the error itself), or no renderer (yet)."""
        renderer = self._renderer or await self._ready()
        if renderer is None:
            return None
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse
        from vllm.renderers.inputs.preprocess import extract_prompt_components

        # A copy: the renderer may rewrite a request in place (Mistral's tool calls), and this one is sent on as is.
        request = request.model_copy(deep=True)
        try:
            if isinstance(request, ChatCompletionRequest):
                rendered = await renderer.online.render_chat(request, skip_mm_cache=True)
                if isinstance(rendered, ErrorResponse):
                    return None
                inputs = rendered[1]
            elif isinstance(request, CompletionRequest) and isinstance(request.prompt, str):
                inputs = await renderer.online.preprocess_completion(
                    request, prompt_input=request.prompt, prompt_embeds=None, skip_mm_cache=True
                )
            else:
                return None
        except Exception:  # a request vLLM refuses: the replica says why
            return None
        if len(inputs) != 1:
            return None
        token_ids = extract_prompt_components(renderer.model_config, inputs[0]).token_ids
        if token_ids is None:
            return None
        salt = inputs[0].get("cache_salt") or getattr(request, "cache_salt", None) or ""
        return Prompt(tuple(token_ids), salt)

    async def _ready(self) -> _Renderer | None:
        if self._failed:
            return None
        try:
            self._renderer = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(self._building)), READY_WAIT_S)
        except asyncio.TimeoutError:
            return None
        except Exception as error:
            logger.error("rayapp's router cannot render prompts as vLLM does (%s); it routes by load only", error)
            self._failed = True
            return None
        return self._renderer

"""`ServeLLMPrefixRouter`: rayapp's prefix router behind Ray Serve LLM's own OpenAI ingress.

rayapp's ingress puts each prompt's block hashes on the request; Ray Serve LLM's hands the replicas the OpenAI
request itself. So this router renders the request with the replica's vLLM renderer (`PromptRenderer`) and hashes
the token ids with rayapp's chain (`hash_blocks`), keyed as `VLLMKVEvents` keys vLLM's stored blocks on the
replicas: the deployment's model id, the request's `cache_salt`, the engine's block size. The rest is
`PrefixAwareRouter`: the PrefixIndex actor's overlaps, Serve's queue lengths, `policy.rank`.
"""

from __future__ import annotations

from typing import Any

from ray.serve.request_router import PendingRequest

from rayapp.blocks import BlockHash, hash_blocks
from rayapp.prefix_router.router import PrefixAwareRouter
from rayapp.vllm_ext.renderer import PromptRenderer


class ServeLLMPrefixRouter(PrefixAwareRouter):
    """Set up by `rayapp.integrations.ray_serve_llm:build_openai_app` as the LLMServer deployment's request router."""

    def initialize_state(
        self, block_size: int = 16, model_id: str = "", llm_config: dict[str, Any] | None = None, **router_config: Any
    ) -> None:
        """`request_router_kwargs`: the engine's block size, the model id its KV events are keyed by, the
        deployment's `LLMConfig` (for the renderer), and the `RouterConfig` fields."""
        super().initialize_state(block_size, **router_config)
        self.model_id = model_id
        self.renderer = PromptRenderer(llm_config) if llm_config is not None else None

    async def prompt_blocks(self, pending_request: PendingRequest | None) -> tuple[list[BlockHash], int]:
        request = pending_request.args[0] if pending_request is not None and pending_request.args else None
        if request is None or self.renderer is None:
            return [], 0
        prompt = await self.renderer.render(request)
        if prompt is None:
            return [], 0
        return hash_blocks(prompt.token_ids, self.block_size, (self.model_id, prompt.cache_salt)), len(prompt.token_ids)

    async def _push_metrics(self) -> None:
        """Nothing reads rayapp's metrics hub in a Ray Serve LLM app: the decisions go to Ray's metrics only."""

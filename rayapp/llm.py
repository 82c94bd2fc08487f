"""The offline API, shaped like vLLM's `LLM` so users can switch with an import change."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence as Seq
from typing import Any

from transformers import PreTrainedTokenizerBase

from rayapp.engine.llm_engine import LLMEngine
from rayapp.engine.outputs import CompletionOutput, RequestOutput
from rayapp.engine.request import EngineRequest
from rayapp.engine.sampling_params import SamplingParams
from rayapp.kvtier import log_unavailable
from rayapp.models.tokenizer import Message, chat_token_ids


class LLM:
    """Run a model in this process: `LLM().generate(["Hello"], SamplingParams(max_tokens=32))`.

    `model=None` is the shipped SmolLM2-135M-Instruct; any other value is a Hugging Face
    safetensors directory of the Llama / Qwen2 family. Further keyword options are engine
    settings (`block_size`, `num_pages`, `kv_cache_memory_gb`, `enable_prefix_caching`,
    `max_num_seqs`, `max_num_batched_tokens`, `max_model_len`); `sparse={...}` with the fields
    of `rayapp.config.SparseConfig` for sparse retrieval attention on long prompts, e.g.
    `LLM(sparse={"enabled": True, "dense_boundary": 4096, "local_tokens": 1024})`; and `kvtier`: a
    dict of `KVTierConfig` fields. With `kvtier={"enabled": True}` full KV blocks are shared through
    the cluster tier (Ray is initialized here if it is not; with no `dsn` an embedded PostgreSQL is
    started), so several `LLM`s, in this program or others on the cluster, reuse each other's prefixes.
    `layerwise={...}` with the fields of `rayapp.config.LayerwiseConfig` compresses the KV cache of the
    upper layers after each prompt, e.g. `LLM(layerwise={"enabled": True, "compression_ratio": 4})`.
    """

    def __init__(self, model: str | None = None, dtype: str = "auto", device: str = "cpu", **options: Any) -> None:
        self.engine = LLMEngine.from_options(model=model, dtype=dtype, device=device, **options)
        self._ids = itertools.count()
        self.tier: Any = None
        if self.engine.config.kvtier.enabled:
            self.tier = connect_tier(self.engine)

    def close(self) -> None:
        """Finish writing blocks to the cluster tier and disconnect from it (no-op without a tier)."""
        if self.tier is not None:
            self.tier.close()
            self.tier = None

    def get_tokenizer(self) -> PreTrainedTokenizerBase:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | Seq[str] | None = None,
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        prompt_token_ids: Seq[int] | Seq[Seq[int]] | None = None,
    ) -> list[RequestOutput]:
        """Complete each prompt (text or token ids); outputs come back in input order."""
        if prompts is not None and prompt_token_ids is not None:
            raise ValueError("give prompts or prompt_token_ids, not both")
        if prompts is not None:
            texts = [prompts] if isinstance(prompts, str) else list(prompts)
            return self._run([self.engine.request("", p) for p in texts], sampling_params)
        if prompt_token_ids is None:
            raise ValueError("give prompts or prompt_token_ids")
        ids = list(prompt_token_ids)
        batch = [ids] if ids and isinstance(ids[0], int) else ids
        return self._run([EngineRequest("", list(p)) for p in batch], sampling_params)

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Answer one conversation or a list of them, rendered with the model's chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.engine.tokenizer
        return self._run([EngineRequest("", chat_token_ids(tok, c)) for c in conversations], sampling_params)

    def stats(self) -> dict[str, int]:
        """Counters since start (prompt, cached prompt and generated tokens) and the page pool now;
        with layer-wise compression on, the `layerwise_*` ones (compacted sequences, pages given back);
        with sparse attention on, also the `sparse_*` counters (sequences per mode, selected blocks,
        device block cache hits and misses, blocks copied in the last step, host pages held)."""
        return self.engine.stats()

    def _run(self, inputs: list[EngineRequest], sampling_params: Any) -> list[RequestOutput]:
        """Generate for `inputs` (their ids and sampling replaced here), in order."""
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(inputs)
        else:
            params = list(sampling_params)
            if len(params) != len(inputs):
                raise ValueError(f"got {len(params)} sampling_params for {len(inputs)} prompts")
        # Validate everything before queueing anything, so a bad prompt leaves no work behind.
        requests = [
            self.engine.prepare_request(dataclasses.replace(x, request_id=f"offline-{next(self._ids)}", sampling=p))
            for x, p in zip(inputs, params)
        ]
        for request in requests:
            self.engine.enqueue(request)
        order = {r.seq.seq_id: i for i, r in enumerate(requests)}
        results: list[RequestOutput | None] = [None] * len(requests)
        # Each step's output holds the answers that progressed: the latest of each, by index, make the result.
        answers: list[dict[int, CompletionOutput]] = [{} for _ in requests]
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                i = order[out.request_id]
                answers[i].update((c.index, c) for c in out.outputs)
                if out.finished:
                    results[i] = dataclasses.replace(out, outputs=[c for _, c in sorted(answers[i].items())])
        return [r for r in results if r is not None]


def connect_tier(engine: LLMEngine) -> Any:
    """A `KVTierClient` attached to `engine`; initializes Ray in this process when needed."""
    import ray

    from rayapp.kvtier.client import attach_tier

    if not ray.is_initialized():
        ray.init(include_dashboard=False)
    try:
        return attach_tier(engine)
    except Exception as error:  # no database, no store: generate without the tier rather than not at all
        log_unavailable(error)
        return None

"""`engine: vllm`: a replica backend over vLLM's `AsyncLLM`, fed token ids by rayapp's ingress.

The ingress templates and tokenizes once; this backend hands vLLM the token ids (never the text)
with the tenant's salt as `cache_salt`, streams vLLM's deltas, and reports vLLM's own counts:
cached prompt tokens per request, running and waiting requests and KV usage from vLLM's stat
logger interface. The prefix router is fed from vLLM's ZMQ KV events (`VLLMKVEvents`), published
on an IPC endpoint of this replica's own, so replicas on one node never collide. With `kvtier.enabled`
vLLM's engine gets the cluster tier as its KV connector (`RayappKVTierConnector`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import tempfile
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from vllm import SamplingParams as VLLMSamplingParams
from vllm.config import KVEventsConfig, StructuredOutputsConfig
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.exceptions import VLLMClientError
from vllm.inputs import TokensPrompt
from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.exceptions import EngineDeadError as VLLMEngineDeadError
from vllm.v1.metrics.loggers import StatLoggerBase

from rayapp.blocks import BlockHash, KVEvent
from rayapp.config import DTYPE_OPTIONS, AppConfig
from rayapp.config.app import VLLM_SHARED_KWARGS
from rayapp.drivers.backend import EngineDeadError, GenerateDelta, Usage, UsageTally
from rayapp.engine.detokenizer import IncrementalDetokenizer
from rayapp.engine.llm_engine import METRICS as ENGINE_METRICS
from rayapp.engine.outputs import TokenLogprob
from rayapp.engine.request import EngineRequest
from rayapp.engine.sampling_params import SamplingParams, StructuredOutput
from rayapp.engine.structured import ANY_OBJECT
from rayapp.kernels.cpu import cpu_plan
from rayapp.kvtier import log_unavailable
from rayapp.kvtier.client import METRICS as CLIENT_METRICS
from rayapp.kvtier.connector import METRICS as TIER_METRICS
from rayapp.models.loader import model_id, resolve_model
from rayapp.models.tokenizer import load_tokenizer
from rayapp.observability import Metric, counters
from rayapp.vllm_ext.connector import kv_transfer_config
from rayapp.vllm_ext.cpu_binding import bind_cpu_slot, keep_frontend_core, one_process_engine
from rayapp.vllm_ext.kv_events import VLLMKVEvents
from rayapp.vllm_ext.retrieval import RetrievalStats, register, settings_env
from rayapp.vllm_ext.tier_protocol import LOADED_TOKENS_PARAM, MISSED_TOKENS_PARAM
from rayapp.vllm_ext.worker_extension import REPLICA_EXTENSION

METRICS = counters(
    {"kv_events_lost_batches": "vLLM KV event batches the router's feed missed (the replica's entries were dropped)"}
)
# Of the tier connector's counters, the ones a vLLM replica reports (`_usage`): vLLM's connector does not tell a
# preempted request's reload from a first load.
LOADED_TOKENS = tuple(metric for metric in TIER_METRICS if metric.name == "tier_loaded_tokens")

# AppConfig fields that map onto AsyncEngineArgs as they are, when the user set them (else vLLM's defaults hold);
# the page size and the KV cache size are placed below.
_PLAIN_FIELDS = {k: f for k, f in VLLM_SHARED_KWARGS.items() if k not in ("block_size", "kv_cache_memory_bytes")}
# Batches vLLM keeps for a subscriber that missed some (one batch per engine step with cache changes).
REPLAY_BUFFER_STEPS = 10_000


def engine_kwargs(config: AppConfig) -> dict[str, Any]:
    """AsyncEngineArgs fields of `config` (the model and KV events aside): `engine_kwargs` plus the
    AppConfig fields the user set, with the page size the ingress hashes with."""
    kwargs = dict(config.engine_kwargs)
    kwargs["block_size"] = config.kv_block_size()
    for key, field in _PLAIN_FIELDS.items():
        if field in config.model_fields_set:
            kwargs[key] = getattr(config, field)
    on_cpu = config.device.split(":")[0] == "cpu"
    if on_cpu and kwargs.get("dtype", config.dtype) in DTYPE_OPTIONS:
        # The dtype rayapp's engine would run on this CPU: vLLM's `auto` takes bf16 even where oneDNN has no bf16
        # path (AVX2-only CPUs), which runs several times slower than float32 there.
        kwargs["dtype"] = cpu_plan(kwargs.get("dtype", config.dtype)).dtype_name
    sized = {"kv_cache_memory_bytes", "num_gpu_blocks_override", "gpu_memory_utilization"} & kwargs.keys()
    if not sized and (on_cpu or "kv_cache_memory_gb" in config.model_fields_set):
        # On CPU vLLM would otherwise size the cache from the free memory of the whole host. On an accelerator
        # vLLM's own sizing (gpu_memory_utilization of the device, less weights and activations) holds unless
        # the user asked for a size.
        kwargs["kv_cache_memory_bytes"] = int(config.kv_cache_memory_gb * 2**30)
    if config.devices_per_replica() > 1:
        # vLLM's Ray executor starts one worker per device in the bundles of the replica's placement group (vLLM
        # finds it when its engine config is made in the replica's actor and hands it to its engine core).
        kwargs["distributed_executor_backend"] = "ray"
    sparse_on_cuda = config.sparse.sparse_config().enabled and config.device.split(":")[0] == "cuda"
    if sparse_on_cuda and "attention_backend" not in kwargs:
        # The retrieval plugin's CUDA backend is vLLM's CUSTOM one (`rayapp.vllm_ext.retrieval_cuda`); a backend the
        # user named stays theirs.
        kwargs["attention_config"] = {"backend": "CUSTOM", **(kwargs.get("attention_config") or {})}
    if config.sparse.sparse_config().enabled or config.kvtier.enabled:
        # The retrieval plugin's and the tier writer's stats live in vLLM's worker: read for /metrics.
        kwargs["worker_extension_cls"] = REPLICA_EXTENSION
    # rayapp's stat logger below feeds /metrics; vLLM's own periodic log lines stay off unless asked for.
    kwargs.setdefault("disable_log_stats", True)
    structured = kwargs.get("structured_outputs_config") or {}
    if isinstance(structured, dict):
        # xgrammar, as rayapp's engine, and compact JSON as there (vLLM reads that per engine, not per request;
        # it has the option for xgrammar and guidance only).
        structured = {"backend": "xgrammar", **structured}
        if structured["backend"] in ("xgrammar", "guidance"):
            structured.setdefault("disable_any_whitespace", True)
        kwargs["structured_outputs_config"] = StructuredOutputsConfig(**structured)
    return kwargs


def check_config(config: AppConfig) -> None:
    """Fail early (when the application is built) on engine_kwargs that AsyncEngineArgs does not have."""
    known = {field.name for field in dataclasses.fields(AsyncEngineArgs)}
    unknown = sorted(set(config.engine_kwargs) - known)
    if unknown:
        raise ValueError(
            f"engine_kwargs: {', '.join(unknown)} {'is not a field' if len(unknown) == 1 else 'are not fields'} "
            "of vLLM's AsyncEngineArgs; see `vllm serve --help` for the engine arguments"
        )


class _EngineStats:
    """vLLM's numbers under rayapp's metric names."""

    def __init__(self) -> None:
        self.counters = {
            "prompt_tokens": 0, "cached_prompt_tokens": 0, "tier_loaded_tokens": 0, "generation_tokens": 0,
            "num_preemptions": 0,
        }  # fmt: skip
        self.num_running = self.num_waiting = 0
        self.kv_usage = 0.0


class _StatLogger(StatLoggerBase):
    """vLLM's stat logger interface, called on AsyncLLM's output loop: copies its numbers into `_EngineStats`."""

    def __init__(self, vllm_config: Any, engine_index: int = 0, *, stats: _EngineStats) -> None:
        self.stats = stats

    def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None, engine_idx: int = 0):
        if scheduler_stats is not None:
            self.stats.num_running = scheduler_stats.num_running_reqs
            self.stats.num_waiting = scheduler_stats.num_waiting_reqs + scheduler_stats.num_skipped_waiting_reqs
            self.stats.kv_usage = scheduler_stats.kv_cache_usage
        if iteration_stats is not None:
            self.stats.counters["generation_tokens"] += iteration_stats.num_generation_tokens
            self.stats.counters["num_preemptions"] += iteration_stats.num_preempted_reqs

    def log_engine_initialized(self) -> None:
        pass


def _sampling(params: SamplingParams, own_text: bool = False) -> VLLMSamplingParams:
    """vLLM's sampling parameters; `own_text`: token ids only, rayapp's detokenizer makes the text (and stops: it
    must be given `min_tokens` too). vLLM keeps EOS and stop_token_ids back until `min_tokens` either way."""
    return VLLMSamplingParams(
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        seed=params.seed,
        stop=[] if own_text else list(params.stop),
        stop_token_ids=list(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
        detokenize=not own_text,
        logprobs=params.logprobs,
        structured_outputs=None if params.structured is None else _structured(params.structured),
        n=params.n,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty,
        min_p=params.min_p,
        logit_bias=dict(params.logit_bias) or None,
        min_tokens=params.min_tokens,
        output_kind=RequestOutputKind.DELTA,
    )


def _structured(spec: StructuredOutput) -> StructuredOutputsParams:
    """vLLM's structured outputs for rayapp's (compact JSON: `engine_kwargs` turns vLLM's whitespace off)."""
    schema = spec.json_schema if spec.json_schema is not None else ANY_OBJECT
    return StructuredOutputsParams(json=schema)


def _logprobs(positions: list[dict[int, Any]], token_ids: list[int], top: int) -> list[TokenLogprob]:
    """vLLM's per-position logprobs (token id -> Logprob, the sampled token and the `top` most likely) as rayapp's."""
    out = []
    for token_id, position in zip(token_ids, positions):
        ranked = sorted(position.items(), key=lambda item: item[1].rank)
        best = tuple((t, lp.logprob) for t, lp in ranked if lp.rank <= top)
        out.append(TokenLogprob(token_id, position[token_id].logprob, best))
    return out


def _own_text(detok: IncrementalDetokenizer, token_ids: list[int], finished: bool) -> tuple[str, list[int]]:
    """The text of `token_ids` by rayapp's detokenizer, and the ids it read (up to a stop string's end)."""
    parts, read = [], []
    for token_id in token_ids:
        parts.append(detok.add_token(token_id))
        read.append(token_id)
        if detok.stop_matched is not None:
            return "".join(parts), read
    if finished:
        parts.append(detok.flush())
    return "".join(parts), read


class VLLMBackend:
    """One vLLM engine (`AsyncLLM`, its engine core in a child process) behind rayapp's backend interface."""

    def __init__(
        self,
        engine: AsyncLLM,
        events: VLLMKVEvents,
        stats: _EngineStats,
        block_size: int,
        cpu_slot: Any = None,
        tokenizer: Any = None,
        sparse: bool = False,
        tier: bool = False,
    ) -> None:
        self.engine, self.events, self._stats, self.block_size = engine, events, stats, block_size
        self._sparse, self._tier = sparse, tier
        self._cpu_slot = cpu_slot
        # rayapp's detokenizer reads moved answers with it (vLLM's cannot start from delivered output).
        self.tokenizer = tokenizer

    @classmethod
    def from_app_config(cls, config: AppConfig) -> VLLMBackend:
        # An IPC endpoint per replica: unique on the node without picking ports.
        base = Path(tempfile.gettempdir()) / f"rayapp-kv-{uuid.uuid4().hex[:12]}"
        kv_events = KVEventsConfig(
            enable_kv_cache_events=True,
            publisher="zmq",
            endpoint=f"ipc://{base}.pub",
            replay_endpoint=f"ipc://{base}.replay",
            buffer_steps=REPLAY_BUFFER_STEPS,
        )
        check_config(config)
        identity = model_id(config.model, config.revision)
        kwargs = engine_kwargs(config)
        if config.kvtier.enabled:
            try:
                kwargs["kv_transfer_config"] = kv_transfer_config(config.kvtier, identity)
            except Exception as error:  # no database: serve without the tier rather than not at all
                log_unavailable(error)
        sparse = config.sparse.sparse_config()
        if sparse.enabled:  # the retrieval plugin, in this process and the engine core it starts
            os.environ.update(settings_env(sparse))
            register()
        model_dir = resolve_model(config.model, config.revision)
        args = AsyncEngineArgs(model=str(model_dir), kv_events_config=kv_events, **kwargs)
        stats = _EngineStats()
        cpu_slot = None
        if config.device.split(":")[0] == "cpu" and not one_process_engine(kwargs):
            keep_frontend_core(kwargs)  # first: the binding keeps clear of the cores it reserves
            cpu_slot = bind_cpu_slot(config.num_cpus, kwargs)
        engine = AsyncLLM.from_engine_args(args, stat_loggers=[functools.partial(_StatLogger, stats=stats)])
        block_size = config.kv_block_size()
        events = VLLMKVEvents(kv_events.endpoint, kv_events.replay_endpoint, identity, block_size)
        tier = "kv_transfer_config" in kwargs and config.kvtier.enabled
        return cls(engine, events, stats, block_size, cpu_slot, load_tokenizer(model_dir), sparse.enabled, tier)

    async def generate(self, request: EngineRequest) -> AsyncIterator[GenerateDelta]:
        prompt = TokensPrompt(prompt_token_ids=request.prompt_token_ids)
        if request.cache_salt:
            prompt["cache_salt"] = request.cache_salt
        ids = request.prompt_token_ids
        tally = UsageTally(len(ids))
        detok = None
        if request.delivered_tokens:
            # A moved answer: rayapp's detokenizer reads the delivered output again, so the text held back at
            # the cut and stop strings spanning it come out as if the answer had not moved.
            cut = len(ids) - request.delivered_tokens
            detok = IncrementalDetokenizer(
                self.tokenizer, ids[:cut], request.sampling.stop, delivered_ids=ids[cut:],
                delivered_chars=request.delivered_chars, min_tokens=request.sampling.min_tokens,
            )  # fmt: skip
        try:
            stream = self.engine.generate(prompt, _sampling(request.sampling, detok is not None), request.request_id)
            # Closing the stream (the client left, or rayapp's detokenizer met a stop string) makes vLLM abort
            # the request and free its pages.
            async with contextlib.aclosing(stream):
                async for out in stream:
                    # With n > 1, vLLM's outputs are the answers that progressed (none: a repeat of a finished one).
                    if not out.outputs and out.finished:
                        yield GenerateDelta("", [], None, self._usage(out, tally))
                        return
                    for k, completion in enumerate(out.outputs):
                        text, token_ids, reason = completion.text, list(completion.token_ids), completion.finish_reason
                        logprobs = None
                        if request.sampling.logprobs is not None:
                            logprobs = _logprobs(completion.logprobs or [], token_ids, request.sampling.logprobs)
                        last = out.finished and k == len(out.outputs) - 1
                        if detok is not None:  # a moved answer (one of a request's)
                            text, token_ids = _own_text(detok, token_ids, out.finished)
                            logprobs = None if logprobs is None else logprobs[: len(token_ids)]
                            if detok.stop_matched is not None:
                                last, reason = True, "stop"
                        tally.add(token_ids)
                        usage = self._usage(out, tally) if last else None
                        yield GenerateDelta(text, token_ids, reason, usage, logprobs, completion.index)
                        if last:
                            return
        except VLLMEngineDeadError as error:
            raise EngineDeadError(f"vLLM's engine core died: {error}") from None
        except VLLMClientError as error:  # vLLM refused the request (not a ValueError in vLLM): the client's 400
            raise ValueError(str(error)) from None

    def _usage(self, out: Any, tally: UsageTally) -> Usage:
        """A finished request's usage, counted into this replica's stats."""
        tier = out.kv_transfer_params or {}
        # vLLM counts what the tier offered as cached, delivered or not.
        usage = tally.usage((out.num_cached_tokens or 0) - tier.get(MISSED_TOKENS_PARAM, 0))
        self._stats.counters["prompt_tokens"] += usage.prompt_tokens
        self._stats.counters["cached_prompt_tokens"] += usage.cached_tokens
        self._stats.counters["tier_loaded_tokens"] += tier.get(LOADED_TOKENS_PARAM, 0)
        return usage

    async def abort(self, request_id: str) -> None:
        await self.engine.abort(request_id)

    async def metrics(self) -> tuple[Metric, ...]:
        """rayapp's engine metrics vLLM's stats give (the others it does not report), the KV event feed's, and the
        retrieval plugin's when it is on."""
        metrics = ENGINE_METRICS + LOADED_TOKENS + METRICS
        return metrics + (RetrievalStats.METRICS if self._sparse else ()) + (CLIENT_METRICS if self._tier else ())

    async def stats(self) -> dict[str, float]:
        total = self.engine.vllm_config.cache_config.num_gpu_blocks or 0
        return {
            **self._stats.counters,
            "num_running": self._stats.num_running,
            "num_waiting": self._stats.num_waiting,
            "pages_total": total,
            "pages_free": total - round(self._stats.kv_usage * total),
            "page_size": self.block_size,
            "kv_events_lost_batches": self.events.lost_batches,
            # The retrieval plugin and the tier's writer count in vLLM's worker (one with this engine's single worker).
            **(await self._worker_stats()),
        }

    async def _worker_stats(self) -> dict[str, int]:
        if not (self._sparse or self._tier):
            return {}
        return (await self.engine.collective_rpc("worker_stats", args=(self._sparse, self._tier)))[0]

    async def take_kv_events(self) -> list[KVEvent]:
        return self.events.take()

    async def kv_snapshot(self) -> list[KVEvent]:
        return self.events.snapshot()

    async def cached_blocks(self) -> list[BlockHash]:
        """The blocks vLLM reported holding (its own events' mirror: vLLM has no cache listing to ask)."""
        return self.events.cached_blocks()

    async def check_health(self) -> None:
        try:
            await self.engine.check_health()
        except VLLMEngineDeadError as error:
            raise EngineDeadError(f"vLLM's engine core died: {error}") from None

    async def flush_tier(self) -> None:
        """Nothing to wait on here: the tier's writes are queued in vLLM's worker process, which this
        process cannot reach; the catalog shows when they landed."""

    def engine_pid(self) -> int | None:
        """The engine core's process (None where vLLM runs its core in this process)."""
        manager = self.engine.engine_core.resources.engine_manager
        return manager.processes[0].pid if manager is not None and manager.processes else None

    def shutdown(self) -> None:
        self.events.close()
        self.engine.shutdown()
        if self._cpu_slot is not None:
            self._cpu_slot.close()

"""The vLLM backend's mapping of rayapp's request and settings onto vLLM, without starting an engine.

vLLM's own pieces are real here (its engine args, sampling params, output and error types); only
`AsyncLLM` is replaced by a stand-in that streams what vLLM's would, so the mapping is checked in
seconds. The served path with a real engine is in tests/deployments/test_serve_app.py.
"""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("vllm")

from vllm.config import StructuredOutputsConfig  # noqa: E402
from vllm.exceptions import VLLMValidationError  # noqa: E402
from vllm.outputs import CompletionOutput, RequestOutput  # noqa: E402
from vllm.v1.engine.exceptions import EngineDeadError as VLLMEngineDeadError  # noqa: E402

from rayapp.config import AppConfig  # noqa: E402
from rayapp.deployments.engines import backend_class  # noqa: E402
from rayapp.drivers.backend import EngineDeadError, EngineRequest, GenerateDelta, Usage  # noqa: E402
from rayapp.engine.sampling_params import SamplingParams  # noqa: E402
from rayapp.kernels import cpu  # noqa: E402
from rayapp.kernels.cpu import CPUFeatures, detect, plan_for  # noqa: E402
from rayapp.vllm_ext.engine import VLLMBackend, _EngineStats, engine_kwargs  # noqa: E402
from rayapp.vllm_ext.tier_protocol import LOADED_TOKENS_PARAM, MISSED_TOKENS_PARAM  # noqa: E402

pytestmark = pytest.mark.slow  # vLLM engines


class FakeAsyncLLM:
    """Streams two DELTA outputs (3 tokens, then 2 and the finish), recording what it was asked."""

    def __init__(self, fail: BaseException | None = None, kv_transfer_params: dict | None = None) -> None:
        self.fail, self.calls, self.closed = fail, [], False
        self.kv_transfer_params = kv_transfer_params

    async def generate(self, prompt, params, request_id):
        self.calls.append((prompt, params, request_id))
        if self.fail is not None:
            raise self.fail
        try:
            for ids, finished in (([1, 2, 3], False), ([4, 5], True)):
                out = CompletionOutput(0, "x" * len(ids), ids, None, None, finish_reason="length" if finished else None)
                yield RequestOutput(
                    request_id,
                    None,
                    prompt["prompt_token_ids"],
                    None,
                    [out],
                    finished,
                    num_cached_tokens=128,
                    kv_transfer_params=self.kv_transfer_params if finished else None,
                )
        finally:
            self.closed = True


def _request(salt: str = "", **sampling) -> EngineRequest:
    return EngineRequest("r1", list(range(300)), [], salt, SamplingParams(**sampling), "hi")


def _deltas(backend: VLLMBackend, request: EngineRequest, take: int | None = None) -> list[GenerateDelta]:
    async def run():
        out = []
        stream = backend.generate(request)
        async for delta in stream:
            out.append(delta)
            if take is not None and len(out) == take:
                await stream.aclose()
                break
        return out

    return asyncio.run(run())


def _backend(engine: FakeAsyncLLM) -> VLLMBackend:
    return VLLMBackend(engine, events=None, stats=_EngineStats(), block_size=128)


def test_token_ids_salt_and_sampling_reach_vllm_and_usage_is_vllms_count():
    engine = FakeAsyncLLM()
    deltas = _deltas(_backend(engine), _request("tenant-salt", temperature=0, max_tokens=5, stop=["\n"], top_k=0))
    prompt, params, request_id = engine.calls[0]
    assert prompt == {"prompt_token_ids": list(range(300)), "cache_salt": "tenant-salt"} and request_id == "r1"
    assert (params.temperature, params.max_tokens, params.stop, params.top_k) == (0, 5, ["\n"], 0)
    assert [d.token_ids for d in deltas] == [[1, 2, 3], [4, 5]]
    assert deltas[0].finish_reason is None and deltas[0].usage is None
    assert deltas[1].finish_reason == "length" and deltas[1].usage == Usage(300, 5, 128)


def test_tier_loads_count_as_cached_and_what_the_tier_failed_to_deliver_does_not():
    # vLLM reports 128 cached: the connector offered 128 from the tier but only 64 loaded (the rest recomputed).
    stats = _EngineStats()
    engine = FakeAsyncLLM(kv_transfer_params={LOADED_TOKENS_PARAM: 64, MISSED_TOKENS_PARAM: 64})
    deltas = _deltas(VLLMBackend(engine, events=None, stats=stats, block_size=128), _request())
    assert deltas[-1].usage == Usage(300, 5, 64)
    assert (stats.counters["cached_prompt_tokens"], stats.counters["tier_loaded_tokens"]) == (64, 64)


def test_no_tenant_sends_no_salt():
    engine = FakeAsyncLLM()
    _deltas(_backend(engine), _request())
    assert "cache_salt" not in engine.calls[0][0]


def test_a_client_that_leaves_closes_vllms_stream():
    engine = FakeAsyncLLM()
    _deltas(_backend(engine), _request(), take=1)
    assert engine.closed  # vLLM aborts the request when its stream is closed


def test_vllms_rejection_is_a_value_error_and_a_dead_core_an_engine_dead_error():
    # VLLMValidationError is not a ValueError in vLLM: mapped, the ingress answers it with a 400.
    with pytest.raises(ValueError, match="too long"):
        _deltas(_backend(FakeAsyncLLM(VLLMValidationError("the prompt is too long"))), _request())
    with pytest.raises(EngineDeadError):
        _deltas(_backend(FakeAsyncLLM(VLLMEngineDeadError())), _request())


def test_settings_map_onto_vllms_engine_args():
    unset = engine_kwargs(AppConfig(engine="vllm"))
    # Unset batching limits keep vLLM's defaults; the page size the ingress hashes with is always passed.
    # Structured output is compact JSON, as on rayapp's engine.
    compact = StructuredOutputsConfig(backend="xgrammar", disable_any_whitespace=True)
    # On CPU the dtype is the one rayapp's engine resolves here (bfloat16 only where oneDNN runs it).
    dtype = plan_for("auto", detect()).dtype_name
    assert unset == {
        "block_size": 128, "kv_cache_memory_bytes": 2 << 30, "disable_log_stats": True,
        "structured_outputs_config": compact, "dtype": dtype,
    }  # fmt: skip
    set_ = engine_kwargs(AppConfig(engine="vllm", max_num_seqs=8, num_pages=100, engine_kwargs={"enforce_eager": True}))
    assert set_ == {
        "block_size": 128,
        "max_num_seqs": 8,
        "num_gpu_blocks_override": 100,
        "enforce_eager": True,
        "disable_log_stats": True,
        "structured_outputs_config": compact,
        "dtype": dtype,
    }
    own = engine_kwargs(AppConfig(engine="vllm", engine_kwargs={"structured_outputs_config": {"backend": "guidance"}}))
    assert own["structured_outputs_config"] == StructuredOutputsConfig(backend="guidance", disable_any_whitespace=True)
    on_gpu = engine_kwargs(AppConfig(engine="vllm", device="cuda"))
    assert on_gpu["block_size"] == 16 and "dtype" not in on_gpu  # vLLM's own auto on accelerators


def test_a_vllm_replica_on_an_avx2_only_cpu_runs_float32_and_refuses_bfloat16(monkeypatch):
    monkeypatch.setattr(cpu, "detect", lambda: CPUFeatures("AMD EPYC 7763", "AVX2", frozenset({"avx2", "fma"})))
    assert engine_kwargs(AppConfig(engine="vllm"))["dtype"] == "float32"
    assert engine_kwargs(AppConfig(engine="vllm", engine_kwargs={"dtype": "half"}))["dtype"] == "half"
    with pytest.raises(ValueError, match="set dtype: auto"):
        engine_kwargs(AppConfig(engine="vllm", dtype="bfloat16"))


def test_bad_engine_settings_are_refused_naming_the_field():
    with pytest.raises(ValueError, match="enforce_eagre"):
        backend_class(AppConfig(engine="vllm", engine_kwargs={"enforce_eagre": True}))
    with pytest.raises(ValueError, match="block_size"):
        AppConfig(engine="vllm", block_size=32, engine_kwargs={"block_size": 64})
    with pytest.raises(ValueError, match="engine_kwargs.model"):
        AppConfig(engine="vllm", engine_kwargs={"model": "other"})
    with pytest.raises(ValueError, match="kv_transfer_config is set by rayapp when kvtier.enabled"):
        AppConfig(engine="vllm", kvtier={"enabled": True}, engine_kwargs={"kv_transfer_config": {}})
    # Sparse retrieval runs on vLLM replicas (the retrieval plugin); what the plugin cannot do is refused.
    with pytest.raises(ValueError, match="retrieval_stride=2 needs rayapp's engine"):
        AppConfig(engine="vllm", sparse={"enabled": True, "retrieval_stride": 2})
    with pytest.raises(ValueError, match="worker_extension_cls is set by rayapp when sparse.enabled"):
        AppConfig(engine="vllm", sparse={"enabled": True}, engine_kwargs={"worker_extension_cls": "my.Ext"})
    with pytest.raises(ValueError, match="engine: vllm only"):
        AppConfig(engine_kwargs={"enforce_eager": True})

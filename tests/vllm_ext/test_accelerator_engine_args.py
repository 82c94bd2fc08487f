"""The vLLM engine arguments a replica on a GPU or NPU gets: vLLM's own KV cache sizing, and tensor
parallelism through Ray workers in the replica's placement group. Checked against vLLM's real
`AsyncEngineArgs`, without starting an engine (no accelerator here)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from vllm.engine.arg_utils import AsyncEngineArgs  # noqa: E402

from rayapp.config import AppConfig  # noqa: E402
from rayapp.vllm_ext.engine import engine_kwargs  # noqa: E402


def _as_vllm_args(config: AppConfig) -> AsyncEngineArgs:
    return AsyncEngineArgs(model="Qwen/Qwen2.5-7B-Instruct", **engine_kwargs(config))


def test_gpu_replica_sizes_its_kv_cache_by_gpu_memory_utilization():
    args = _as_vllm_args(AppConfig(engine="vllm", device="cuda", gpu_memory_utilization=0.85))
    assert args.gpu_memory_utilization == 0.85
    assert args.kv_cache_memory_bytes is None
    # Unset, vLLM's default share holds: no fixed size from kv_cache_memory_gb's default...
    default = AsyncEngineArgs.__dataclass_fields__["gpu_memory_utilization"].default
    unset = _as_vllm_args(AppConfig(engine="vllm", device="npu", engine_kwargs={"gpu_memory_utilization": 0.8}))
    assert unset.kv_cache_memory_bytes is None and unset.gpu_memory_utilization == 0.8
    unset = _as_vllm_args(AppConfig(engine="vllm", device="npu"))
    assert unset.kv_cache_memory_bytes is None and unset.gpu_memory_utilization == default
    # ...and kv_cache_memory_gb, set, fixes the size instead (on CPU its default does).
    fixed = _as_vllm_args(AppConfig(engine="vllm", device="cuda", kv_cache_memory_gb=4.0))
    assert fixed.kv_cache_memory_bytes == 4 << 30
    assert engine_kwargs(AppConfig(engine="vllm"))["kv_cache_memory_bytes"] == 2 << 30


@pytest.mark.parametrize(
    "args",
    [
        {"engine": "vllm", "device": "cuda", "tensor_parallel_size": 2},
        {"engine": "vllm", "device": "npu", "engine_kwargs": {"tensor_parallel_size": 2}},
    ],
)
def test_tensor_parallel_replica_runs_vllms_ray_workers(args):
    vllm_args = _as_vllm_args(AppConfig(**args))
    assert vllm_args.tensor_parallel_size == 2
    assert vllm_args.distributed_executor_backend == "ray"
    # One device per replica keeps vLLM's own executor choice.
    one = engine_kwargs(AppConfig(engine="vllm", device="cuda", tensor_parallel_size=1))
    assert one["tensor_parallel_size"] == 1 and "distributed_executor_backend" not in one

"""What the application asks Ray Serve for on GPUs and NPUs: a placement group per tensor-parallel replica,
autoscaling instead of a fixed count, and the settings refused before anything starts.

The bound deployments are read from `build()`'s Application without starting Serve (the PrefixIndex actor
and the model check are stubbed; they have tests of their own), except where a real Ray cluster is the point.
"""

from __future__ import annotations

import pytest
import ray

from rayapp.config import AppConfig
from rayapp.deployments import builder


class FakeBackend:
    """Never started: the deployments are only bound."""


@pytest.fixture
def replica_of(monkeypatch):
    """`replica_of(config)`: the LLMReplica deployment `build(config)` binds."""
    monkeypatch.setattr(builder.IndexShards, "connect", lambda app_name, router: None)
    monkeypatch.setattr(builder, "pin_model", lambda config: config)

    def replica_of(config: AppConfig):
        ingress = builder.build(config, backend_cls=FakeBackend)._bound_deployment
        (replica,) = [arg._bound_deployment for arg in ingress.init_args if hasattr(arg, "_bound_deployment")]
        assert replica.name == "LLMReplica"
        return replica

    return replica_of


def test_a_tensor_parallel_replica_on_gpus_gets_one_bundle_per_gpu_on_one_node(replica_of):
    replica = replica_of(AppConfig(engine="vllm", device="cuda", tensor_parallel_size=2))
    # The replica's actor takes the first bundle's CPU; each of vLLM's two workers one GPU bundle.
    assert replica._replica_config.placement_group_bundles == [{"CPU": 1.0, "GPU": 1}, {"GPU": 1}]
    assert replica._replica_config.placement_group_strategy == "STRICT_PACK"
    assert replica.ray_actor_options == {"num_cpus": 1.0}  # the GPUs are the workers', not the actor's


def test_a_tensor_parallel_replica_on_npus_asks_for_rays_npu_resource(replica_of):
    replica = replica_of(AppConfig(engine="vllm", device="npu", num_cpus=2, engine_kwargs={"tensor_parallel_size": 4}))
    assert replica._replica_config.placement_group_bundles == [
        {"CPU": 2.0, "NPU": 1}, {"NPU": 1}, {"NPU": 1}, {"NPU": 1},
    ]  # fmt: skip
    assert replica._replica_config.placement_group_strategy == "STRICT_PACK"
    assert replica.ray_actor_options == {"num_cpus": 2.0}


def test_one_device_per_replica_needs_no_placement_group(replica_of):
    gpu = replica_of(AppConfig(engine="vllm", device="cuda"))
    assert gpu._replica_config.placement_group_bundles is None
    assert gpu.ray_actor_options == {"num_cpus": 1.0, "num_gpus": 1}
    npu = replica_of(AppConfig(engine="vllm", device="npu", tensor_parallel_size=1))
    assert npu._replica_config.placement_group_bundles is None
    assert npu.ray_actor_options == {"num_cpus": 1.0, "resources": {"NPU": 1}}


def test_autoscaling_config_reaches_the_replicas_deployment(replica_of):
    scaling = {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 16}
    replica = replica_of(AppConfig(engine="vllm", device="cuda", autoscaling_config=scaling))
    serve_scaling = replica._deployment_config.autoscaling_config
    assert (serve_scaling.min_replicas, serve_scaling.max_replicas) == (1, 4)
    assert serve_scaling.target_ongoing_requests == 16
    assert serve_scaling.downscale_delay_s == 600.0
    fixed = replica_of(AppConfig(replicas=3))
    assert fixed._deployment_config.autoscaling_config is None and fixed.num_replicas == 3


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"device": "cuda", "tensor_parallel_size": 2}, "tensor_parallel_size=2 needs engine: vllm"),
        ({"engine": "vllm", "tensor_parallel_size": 2}, "it needs device: cuda or npu, not cpu"),
        (
            {
                "engine": "vllm",
                "device": "cuda",
                "tensor_parallel_size": 2,
                "engine_kwargs": {"tensor_parallel_size": 2},
            },
            "engine_kwargs.tensor_parallel_size and tensor_parallel_size are the same setting",
        ),
        (
            {
                "engine": "vllm",
                "device": "cuda",
                "tensor_parallel_size": 2,
                "engine_kwargs": {"distributed_executor_backend": "mp"},
            },
            "needs 'ray'",
        ),
        ({"replicas": 2, "autoscaling_config": {"max_replicas": 4}}, "remove replicas"),
        ({"autoscaling_config": {"min_replicas": 3, "max_replicas": 2}}, "min_replicas=3 is above max_replicas=2"),
        ({"autoscaling_config": {"max_replicas": 2, "target_ongoing_requests": 500}}, "above max_queued_requests=256"),
        ({"engine": "vllm", "gpu_memory_utilization": 0.9}, "on device: cpu set kv_cache_memory_gb"),
        (
            {"engine": "vllm", "engine_kwargs": {"gpu_memory_utilization": 0.9}},
            "on device: cpu set kv_cache_memory_gb",
        ),
        ({"device": "cuda", "gpu_memory_utilization": 0.9}, "rayapp's engine sizes its cache from kv_cache_memory_gb"),
        (
            {"engine": "vllm", "device": "npu", "gpu_memory_utilization": 0.9, "kv_cache_memory_gb": 4},
            "both size the KV cache",
        ),
        ({"engine": "vllm", "device": "cuda", "gpu_memory_utilization": 1.5}, "less than or equal to 1"),
    ],
)
def test_settings_that_cannot_deploy_are_refused_saying_what_to_change(args, message):
    with pytest.raises(ValueError, match=message):
        AppConfig(**args)


def _nodes(*gpus: float, dead: float = 0) -> list[dict]:
    """`ray.nodes()` entries: alive nodes with these GPU counts, and a dead one with `dead` GPUs."""
    alive = [{"Alive": True, "Resources": {"CPU": 8.0, "GPU": n} if n else {"CPU": 8.0}} for n in gpus]
    return alive + ([{"Alive": False, "Resources": {"CPU": 8.0, "GPU": dead}}] if dead else [])


def test_tensor_parallel_wider_than_every_node_fails_the_deploy_naming_both(monkeypatch, replica_of):
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    config = AppConfig(engine="vllm", device="cuda", tensor_parallel_size=4)
    monkeypatch.setattr(ray, "nodes", lambda: _nodes(0, 2, 2, dead=8))  # the 8-GPU node is gone
    with pytest.raises(ValueError, match="tensor_parallel_size=4 needs 4 GPUs on one node.*the most has 2"):
        replica_of(config)
    monkeypatch.setattr(ray, "nodes", lambda: _nodes(0, 2, 4))
    assert replica_of(config)._replica_config.placement_group_bundles
    # An autoscaling cluster with no GPU worker yet: Ray's scheduler waits for one, the deploy goes on.
    monkeypatch.setattr(ray, "nodes", lambda: _nodes(0))
    assert replica_of(config)._replica_config.placement_group_bundles


def test_tensor_parallel_wider_than_a_real_clusters_npus_fails_the_deploy(replica_of):
    ray.init(address="local", num_cpus=1, resources={"NPU": 2}, include_dashboard=False)
    try:
        with pytest.raises(ValueError, match="tensor_parallel_size=8 needs 8 NPUs on one node.*the most has 2"):
            replica_of(AppConfig(engine="vllm", device="npu", tensor_parallel_size=8))
        replica_of(AppConfig(engine="vllm", device="npu", tensor_parallel_size=2))
    finally:
        ray.shutdown()

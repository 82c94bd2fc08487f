"""The `retrieval` general plugin: RetrievalKV sparse decode attention in stock vLLM.

`pip install rayapp[vllm]` registers it under vLLM's `vllm.general_plugins` entry points; vLLM calls
`register` in every process it starts. It acts only when `VLLM_PLUGINS` names `retrieval` (vLLM loads
every installed plugin when `VLLM_PLUGINS` is unset, and then vLLM must stay stock), e.g.
`VLLM_PLUGINS=retrieval vllm serve ...`, or on NPU, where vllm-ascend's own plugins must be named too,
`VLLM_PLUGINS=ascend,ascend_model,ascend_kv_connector,ascend_model_loader,ascend_service_profiling,retrieval`.

Settings are the seed plugin's environment (`VLLM_RETRIEVAL_INIT_TOKENS_NUM`, `..._LOCAL_TOKENS_NUM`,
`..._TOPK_PERCENT`, `..._DENSE_BOUNDARY`, `..._OFFLOAD_BOUNDARY`), validated as rayapp's `SparseConfig`,
plus `RAYAPP_RETRIEVAL_SETTINGS` (a JSON object of any `SparseConfig` field, which wins; rayapp's own
vLLM replicas pass their `sparse:` section this way).

Backends, each built on the platform's own attention (prefill and dense rows stay its kernels), sharing the row
planning of `rayapp.vllm_ext.retrieval_plan`:
- CPU: `RetrievalCPUBackend` (`retrieval_backend`) takes the place of vLLM's CPU attention (`CPU_ATTN`).
- CUDA: `RetrievalTritonBackend` (`retrieval_cuda`, on vLLM's TRITON_ATTN, rayapp's Triton kernels for sparse
  rows) is registered as vLLM's `CUSTOM` backend, which vLLM runs when selected:
  `attention_config={"backend": "CUSTOM"}` (`--attention-backend CUSTOM`; rayapp's replicas set it).
- Ascend NPU (vllm-ascend 0.23): vllm-ascend picks its attention classes itself, so `NPUPlatform.get_attn_backend_cls`
  is wrapped to return `RetrievalAscendBackend` (`retrieval_ascend`, rayapp's kernels through triton-ascend)
  in place of vllm-ascend's `AscendAttentionBackend`.
Other platforms (ROCm, another NPU or release) have no sparse backend: there the plugin says so once and vLLM
runs its own attention. DDR offload (`offload_boundary`) is a rayapp-engine feature on every platform: vLLM's
pages cannot move to host memory, so longer contexts run sparse on the device (logged). Stats live in the
worker process (`stats()`); through vLLM's engine they are read with `collective_rpc("retrieval_stats")` when
the engine was built with `worker_extension_cls=WORKER_EXTENSION`.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import threading
from collections.abc import Mapping
from dataclasses import asdict
from importlib.metadata import PackageNotFoundError, distributions, version

import torch
from torch import Tensor

from rayapp.config import SparseConfig
from rayapp.sparse.metrics import PLUGIN_METRICS

logger = logging.getLogger("rayapp.retrieval")

PLUGIN_NAME = "retrieval"
SETTINGS_ENV = "RAYAPP_RETRIEVAL_SETTINGS"
WORKER_EXTENSION = "rayapp.vllm_ext.retrieval.RetrievalWorkerExtension"
BACKEND_PATH = "rayapp.vllm_ext.retrieval_backend.RetrievalCPUBackend"
CUDA_BACKEND_PATH = "rayapp.vllm_ext.retrieval_cuda.RetrievalTritonBackend"
ASCEND_BACKEND_PATH = "rayapp.vllm_ext.retrieval_ascend.RetrievalAscendBackend"
# vllm-ascend's backend for plain decoder models, which the Ascend backend subclasses, and the releases it follows.
ASCEND_STOCK_PATH = "vllm_ascend.attention.attention_v1.AscendAttentionBackend"
ASCEND_RELEASES = ("0.23.",)
# Loaded only when VLLM_PLUGINS names them, so never added to the list on a user's behalf.
ENDPOINTS = "vllm.endpoint_plugins"


def plugin_named(environ: Mapping[str, str] | None = None) -> bool:
    """Whether `VLLM_PLUGINS` names this plugin (unset: vLLM loads every plugin, and this one stays off)."""
    env = os.environ if environ is None else environ
    return PLUGIN_NAME in [p.strip() for p in env.get("VLLM_PLUGINS", "").split(",")]


def retrieval_config(environ: Mapping[str, str] | None = None) -> SparseConfig:
    """The plugin's settings: defaults, then the `VLLM_RETRIEVAL_*` environment, then `RAYAPP_RETRIEVAL_SETTINGS`."""
    env = os.environ if environ is None else environ
    try:
        overrides = json.loads(env.get(SETTINGS_ENV) or "{}")
    except json.JSONDecodeError as error:
        raise ValueError(f"{SETTINGS_ENV} is not a JSON object: {error}") from None
    if not isinstance(overrides, dict):
        raise ValueError(f"{SETTINGS_ENV} must be a JSON object of sparse settings, got {type(overrides).__name__}")
    overrides["enabled"] = True
    config = SparseConfig.from_env(env, **overrides)
    errors = config.vllm_plugin_errors()
    if errors:
        raise ValueError("invalid retrieval plugin settings: " + "; ".join(errors))
    return config


def settings_env(config: SparseConfig) -> dict[str, str]:
    """The environment that turns the plugin on with `config` in the vLLM processes this one starts. An unset
    `VLLM_PLUGINS` (vLLM loads every installed plugin but endpoint ones) becomes that list, named."""
    named = os.environ.get("VLLM_PLUGINS")
    if named is None:
        # Each distribution's own entry points: `entry_points()` with no group is a dict of groups on Python < 3.12.
        plugins = (p for dist in distributions() for p in dist.entry_points)
        named = ",".join(sorted({p.name for p in plugins if p.group.startswith("vllm.") and p.group != ENDPOINTS}))
    if not plugin_named({"VLLM_PLUGINS": named}):
        named = ",".join(p for p in (named, PLUGIN_NAME) if p)
    values = {k: v for k, v in asdict(config).items() if k != "enabled"}
    return {"VLLM_PLUGINS": named, SETTINGS_ENV: json.dumps(values)}


def register() -> None:
    """vLLM's entry point: put the platform's retrieval backend in place of its attention (module docstring)."""
    if not plugin_named():
        return
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    config = retrieval_config()  # a bad setting fails the engine's start here, saying which
    if current_platform.is_cpu():
        register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND_PATH)
        where = "in place of vLLM's CPU attention"
    elif current_platform.is_cuda():
        register_backend(AttentionBackendEnum.CUSTOM, CUDA_BACKEND_PATH)
        where = 'as vLLM\'s CUSTOM attention backend, run where selected (attention_config={"backend": "CUSTOM"})'
    else:
        refused = install_ascend() if getattr(current_platform, "device_type", None) == "npu" else "no backend for it"
        if refused is not None:
            _log_once(f"retrieval plugin: no sparse attention on {current_platform.device_name} ({refused}); vLLM "
                      "runs its own attention")  # fmt: skip
            return
        where = "in place of vllm-ascend's AscendAttentionBackend"
    shown = {name: "scaled to the model's context" if value is None else value for name, value in (
        ("dense", config.dense_boundary), ("init", config.init_tokens), ("window", config.local_tokens),
        ("offload", config.offload_boundary))}  # fmt: skip
    logger.info(
        "retrieval plugin: sparse decode %s above %s tokens (init %s, window %s, top %.0f%% of %d-token blocks); "
        "vLLM cannot hand its pages to host memory, so sequences above offload_boundary=%s also run sparse on "
        "the device",
        where, shown["dense"], shown["init"], shown["window"], 100 * config.topk_percent,
        config.retrieval_block_size, shown["offload"],
    )  # fmt: skip


_LOGGED: set[str] = set()


def _log_once(message: str) -> None:
    """A warning this process gives once (vLLM and rayapp's replica may both call `register`)."""
    if message not in _LOGGED:
        _LOGGED.add(message)
        logger.warning(message)


def install_ascend() -> str | None:
    """Wrap vllm-ascend's `NPUPlatform.get_attn_backend_cls` so that where it returns its plain attention backend,
    vLLM gets the retrieval one. None when in place; else why not (vllm-ascend missing, or a release the Ascend
    backend was not written against)."""
    try:
        release = version("vllm-ascend")
        from vllm_ascend.platform import NPUPlatform
    except (ImportError, PackageNotFoundError) as error:
        return f"vllm-ascend is not importable: {error}"
    if not release.startswith(ASCEND_RELEASES):
        return f"vllm-ascend {release}; the Ascend backend follows {', '.join(r + 'x' for r in ASCEND_RELEASES)}"
    stock = NPUPlatform.get_attn_backend_cls
    if getattr(stock, "rayapp_retrieval", False):
        return None

    def get_attn_backend_cls(cls, *args, **kwargs):
        path = stock.__func__(cls, *args, **kwargs)
        return ASCEND_BACKEND_PATH if path == ASCEND_STOCK_PATH and _ascend_backend_imports() else path

    get_attn_backend_cls.rayapp_retrieval = True
    NPUPlatform.get_attn_backend_cls = classmethod(get_attn_backend_cls)
    return None


def _ascend_backend_imports() -> bool:
    """Whether the Ascend backend imports against this vLLM and vllm-ascend (their class names are its guard)."""
    try:
        importlib.import_module(ASCEND_BACKEND_PATH.rsplit(".", 1)[0])
    except ImportError as error:
        _log_once(f"retrieval plugin: its Ascend backend does not import here ({error}); vllm-ascend runs its own "
                  "attention")  # fmt: skip
        return False
    return True


class RetrievalStats:
    """What the backend did in this process: counters since start, gauges of the last step."""

    METRICS = PLUGIN_METRICS

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values = dict.fromkeys((m.name for m in self.METRICS), 0)

    def record_step(self, dense_rows: int, sparse_rows: int, selected: int, represented: int) -> None:
        with self._lock:
            v = self._values
            v["sparse_decode_steps_dense"] += dense_rows
            v["sparse_decode_steps_sparse"] += sparse_rows
            v["sparse_selected_blocks"] += selected
            v["sparse_blocks_represented"] += represented
            v["sparse_running_dense"], v["sparse_running_sparse"] = dense_rows, sparse_rows
            v["sparse_selected_blocks_last_step"] = selected

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._values)


class PageEpochs:
    """Which of vLLM's pages changed since their block representation was computed.

    vLLM reuses a page for other tokens without telling the attention backend, so each page carries
    the step it was last written in (from the step's slot mapping, or `note_written` for pages a KV
    connector fills outside the forward) and the step its block's representation was computed in.
    A representation is current when it is at least as new as the last write of every page of its
    block: a prefix-cached history keeps its representations, a reused page gets a new one.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.step = 0
        self.written = torch.zeros(0, dtype=torch.int64)
        self.represented = torch.zeros(0, dtype=torch.int64)

    def _grow(self, num_pages: int) -> None:
        old = self.written.shape[0]
        if num_pages > old:
            self.written = torch.cat([self.written, self.written.new_zeros(num_pages - old)])
            self.represented = torch.cat([self.represented, self.represented.new_full((num_pages - old,), -1)])

    def begin_step(self, written_pages: Tensor, num_pages: int) -> int:
        """A new step whose forward writes `written_pages`; returns its number."""
        with self._lock:
            self._grow(num_pages)
            self.step += 1
            self.written[written_pages] = self.step
            return self.step

    def note_written(self, pages: list[int]) -> None:
        """Pages filled outside the forward (a KV connector's load): their representations are stale."""
        if not pages:
            return
        with self._lock:
            self._grow(max(pages) + 1)
            self.written[torch.tensor(pages)] = self.step + 1

    def take_stale(self, blocks: Tensor, valid: Tensor) -> Tensor:
        """The valid blocks (`blocks`: [n, pages per block], keyed by their last page) whose representation
        is older than one of their pages, once per key; marks them represented now (every layer computes
        them in this step's forward). Returns their rows of `blocks`."""
        with self._lock:
            keys = blocks[:, -1]
            stale = valid & (self.represented[keys] < self.written[blocks].amax(dim=1))
            first: dict[int, int] = {}
            for row, key in zip(stale.nonzero().squeeze(1).tolist(), keys[stale].tolist()):
                first.setdefault(key, row)
            rows = torch.tensor(list(first.values()), dtype=torch.int64)
            self.represented[keys[rows]] = self.step
            return rows


STATS = RetrievalStats()
EPOCHS = PageEpochs()


def note_pages_written(pages: list[int]) -> None:
    """Called by KV connectors after writing pages outside the forward (rayapp's tier worker does)."""
    EPOCHS.note_written(pages)


def stats() -> dict[str, int]:
    """This process's retrieval stats (the worker's, where vLLM runs the model)."""
    return STATS.snapshot()


class RetrievalWorkerExtension:
    """Mixed into vLLM's worker by `worker_extension_cls=WORKER_EXTENSION`, for `collective_rpc`."""

    def retrieval_stats(self) -> dict[str, int]:
        return stats()

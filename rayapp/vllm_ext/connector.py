"""`RayappKVTierConnector`: rayapp's cluster KV tier as a vLLM KV connector (`KVConnectorBase_V1`).

vLLM runs one instance per role: in the engine core's scheduler (`TierScheduler`: asks the catalog
how far the tier continues a prompt beyond vLLM's own prefix hit, plans loads and saves) and in
each worker (`TierWorker`: loads blocks from the node stores into the pages vLLM allocated, and
hands newly full pages to the tier's writer). The two halves speak only through the per-step
`TierMetadata`, which carries page ids, hashes and token ids, never KV.

Loads are asynchronous (vLLM's `WAITING_FOR_REMOTE_KVS`): a request waits for its blocks while the
others keep decoding. A block that is missing or fails verification ends its chain: vLLM recomputes
from there (`kv_load_failure_policy: recompute`). Blocks are named by rayapp's hash chain with the
tenant's `cache_salt`, so the prefix router, rayapp replicas and vLLM replicas name a block alike.

Turn it on with `kv_transfer_config(...)` (rayapp's vLLM replicas do when `kvtier.enabled`), or by
hand: `KVTransferConfig(kv_connector="RayappKVTierConnector", kv_connector_module_path=
"rayapp.vllm_ext.connector", kv_role="kv_both", kv_connector_extra_config={"rayapp": {...}})`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import ray
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from rayapp.blocks import BlockHash
from rayapp.config import KVTierConfig
from rayapp.kvtier.embedded import start_embedded_database
from rayapp.kvtier.records import BlockLocation

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent, KVConnectorKVEvents
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

CONNECTOR_NAME = "RayappKVTierConnector"
# The `medium` of the KV events this connector adds to vLLM's stream: blocks now in (or gone from) the
# cluster tier, named by rayapp's hashes, which the replica's subscriber hands the router as cluster blocks.
TIER_MEDIUM = "rayapp-cluster-tier"
# `kv_transfer_params` keys of a finished request's output: prompt tokens loaded from the tier, and tokens the
# tier offered but did not deliver (missing or refused blocks, recomputed), which vLLM still counts as cached.
LOADED_TOKENS_PARAM = "rayapp_tier_loaded_tokens"
MISSED_TOKENS_PARAM = "rayapp_tier_missed_tokens"
# The scheduler waits at most this long for the catalog, once per request; a slower answer is a miss, and
# until that lookup returns, later requests miss without asking (a frozen database costs one deadline).
LOOKUP_DEADLINE_S = 0.1


@dataclass(frozen=True)
class TierSettings:
    """What both halves need, carried in `kv_connector_extra_config["rayapp"]` (plain JSON values)."""

    dsn: str
    model_id: str
    capacity_bytes: int = KVTierConfig.capacity_bytes
    min_load_tokens: int = KVTierConfig.min_load_tokens
    # The Ray cluster the worker joins to reach the node stores; None: the worker's own `ray.init()` default.
    ray_address: str | None = None
    lookup_deadline_s: float = LOOKUP_DEADLINE_S

    @classmethod
    def from_vllm_config(cls, vllm_config: VllmConfig) -> TierSettings:
        extra = vllm_config.kv_transfer_config.get_from_extra_config("rayapp", None)
        if not isinstance(extra, dict):
            raise ValueError(f'{CONNECTOR_NAME} needs kv_connector_extra_config={{"rayapp": {{"dsn": ..., ...}}}}')
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(f"kv_connector_extra_config.rayapp: unknown field(s) {unknown}; known: {sorted(known)}")
        return cls(**extra)

    def tier_config(self) -> KVTierConfig:
        return KVTierConfig(
            enabled=True, dsn=self.dsn, capacity_bytes=self.capacity_bytes, min_load_tokens=self.min_load_tokens
        )


def kv_transfer_config(tier: KVTierConfig, model_id: str, **settings: Any) -> KVTransferConfig:
    """vLLM's `kv_transfer_config` for the cluster tier `tier` (its embedded database started here when
    `tier.dsn` is unset, so Ray must be initialized). `model_id` must be the name the ingress hashes with."""
    if not ray.is_initialized():
        raise RuntimeError("the cluster KV tier needs Ray: call ray.init() before building vLLM's engine")
    resolved = TierSettings(
        dsn=tier.dsn or start_embedded_database(tier.data_dir),
        model_id=model_id,
        capacity_bytes=tier.capacity_bytes,
        min_load_tokens=tier.min_load_tokens,
        ray_address=ray.get_runtime_context().gcs_address,
        **settings,
    )
    return KVTransferConfig(
        kv_connector=CONNECTOR_NAME,
        kv_connector_module_path=__name__,
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={"rayapp": dataclasses.asdict(resolved)},
    )


@dataclass(frozen=True)
class BlockRun:
    """Consecutive full blocks of one request: the pages that hold them and their names in the tier."""

    block_ids: tuple[int, ...]
    block_hashes: tuple[BlockHash, ...]
    parent: BlockHash | None
    token_ids: tuple[int, ...]  # block_size per block
    cache_salt: str


@dataclass(frozen=True)
class Load:
    """The tier blocks at `locations` (a run of a prompt's chain, after the block `parent`) go into the pages
    `block_ids`. Where the catalog said they are travels with the load, so the worker asks only the stores."""

    request_id: str
    parent: BlockHash | None
    token_ids: tuple[int, ...]  # block_size per block
    locations: tuple[BlockLocation, ...]
    block_ids: tuple[int, ...]
    cache_salt: str


@dataclass
class TierMetadata(KVConnectorMetadata):
    loads: list[Load] = field(default_factory=list)
    saves: list[BlockRun] = field(default_factory=list)


class RayappKVTierConnector(KVConnectorBase_V1):
    """vLLM's connector interface over `TierScheduler` (scheduler role) or `TierWorker` (worker role)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        settings = TierSettings.from_vllm_config(vllm_config)
        if role is KVConnectorRole.SCHEDULER:
            from rayapp.vllm_ext.tier_scheduler import TierScheduler

            self.scheduler = TierScheduler(settings, vllm_config)
        else:
            from rayapp.vllm_ext.tier_worker import TierWorker

            self.worker = TierWorker(settings, vllm_config)

    def requires_kv_delivery(self) -> bool:
        return False  # a save that is dropped is a later miss, never a wrong answer

    # --- scheduler side -------------------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        tokens = self.scheduler.matched_tokens(request, num_computed_tokens)
        return tokens, tokens > 0

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        if num_external_tokens > 0:
            self.scheduler.plan_load(request, blocks.get_block_ids()[0], num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self.scheduler.build_metadata(scheduler_output, self._kv_cache_manager)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.scheduler.update(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        loaded, missed = self.scheduler.finish(request.request_id)
        params = {k: v for k, v in ((LOADED_TOKENS_PARAM, loaded), (MISSED_TOKENS_PARAM, missed)) if v}
        return False, params or None

    def take_events(self) -> Iterable[KVCacheEvent]:
        return self.scheduler.take_events()

    # --- worker side ----------------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self.worker.register(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, TierMetadata)
        self.worker.start_loads(metadata.loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads are whole requests between steps (asynchronous): no layer ever waits."""

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        """Pages are saved whole after the forward (`wait_for_save`), once every layer wrote them."""

    def wait_for_save(self) -> None:
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, TierMetadata)
        self.worker.save(metadata.saves)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, self.worker.finished_loads() or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_failed_blocks()

    def get_kv_connector_kv_cache_events(self) -> KVConnectorKVEvents | None:
        return self.worker.take_events()

    def shutdown(self) -> None:
        if self.role is KVConnectorRole.WORKER:
            self.worker.close()
        else:
            self.scheduler.close()

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
from typing import TYPE_CHECKING, Any

import ray
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from rayapp.config import KVTierConfig
from rayapp.kvtier.embedded import start_embedded_database
from rayapp.vllm_ext.tier_protocol import (
    CONNECTOR_NAME,
    LOADED_TOKENS_PARAM,
    MISSED_TOKENS_PARAM,
    TierMetadata,
    TierSettings,
)
from rayapp.vllm_ext.tier_scheduler import TierScheduler
from rayapp.vllm_ext.tier_worker import TierWorker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent, KVConnectorKVEvents
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


def kv_transfer_config(tier: KVTierConfig, model_id: str, **settings: Any) -> KVTransferConfig:
    """vLLM's `kv_transfer_config` for the cluster tier `tier` (its embedded database started here when
    `tier.dsn` is unset, so Ray must be initialized), for a vLLM engine on this process's node, whose blocks go to
    this node's store. `model_id` must be the name the ingress hashes with."""
    if not ray.is_initialized():
        raise RuntimeError("the cluster KV tier needs Ray: call ray.init() before building vLLM's engine")
    resolved = TierSettings(
        dsn=tier.dsn or start_embedded_database(tier.data_dir),
        model_id=model_id,
        capacity_bytes=tier.capacity_bytes,
        min_load_tokens=tier.min_load_tokens,
        ray_address=ray.get_runtime_context().gcs_address,
        node_id=ray.get_runtime_context().get_node_id(),
        **settings,
    )
    return KVTransferConfig(
        kv_connector=CONNECTOR_NAME,
        kv_connector_module_path=__name__,
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={"rayapp": dataclasses.asdict(resolved)},
    )


class RayappKVTierConnector(KVConnectorBase_V1):
    """vLLM's connector interface over `TierScheduler` (scheduler role) or `TierWorker` (worker role)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        settings = TierSettings.from_vllm_config(vllm_config)
        if role is KVConnectorRole.SCHEDULER:
            self.scheduler = TierScheduler(settings, vllm_config)
        else:
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

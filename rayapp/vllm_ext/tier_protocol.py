"""What the two halves of `RayappKVTierConnector` share (`tier_scheduler` in vLLM's scheduler, `tier_worker` in
each worker): the settings both read, the per-step `TierMetadata` the scheduler sends the workers, and the
names rayapp's connector uses in vLLM's streams."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from rayapp.blocks import BlockHash
from rayapp.config import KVTierConfig
from rayapp.kvtier.records import BlockLocation

if TYPE_CHECKING:
    from vllm.config import VllmConfig

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
    # The node whose store the worker writes to; None: the node its Ray driver joined through.
    node_id: str | None = None
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

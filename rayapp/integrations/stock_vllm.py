"""rayapp's cluster KV tier and `retrieval` plugin in a vLLM rayapp does not start: `vllm serve`, `vllm.LLM`, Ray
Serve LLM's `engine_kwargs`.

The tier is vLLM's KV connector `RayappKVTierConnector` (`rayapp.vllm_ext.connector`), loaded by module path from
vLLM's `kv_transfer_config`; `kv_transfer_config_json` is that setting as plain JSON (what `rayapp
kv-transfer-config` prints). What it needs at run time:

- the catalog: a PostgreSQL / openGauss DSN, reachable from the engine core (the connector's scheduler half asks
  it per request) and from vLLM's workers (they record what they wrote);
- a Ray node to hold the blocks: each vLLM worker joins Ray (`ray_address`) and keeps its blocks in its node's
  `KVTierStore` actor, in that node's object store. With `ray_address` unset, the worker's `ray.init()` finds
  the cluster the usual way (`RAY_ADDRESS`, else one started on this machine by `ray start`). Without any Ray
  cluster, `ray_address: "local"` makes each worker start a private one-node Ray: the tier then serves that
  engine alone, for as long as it runs (blocks of its earlier runs are catalogued but gone: misses, recomputed).

The `retrieval` plugin needs no setting of vLLM's: it is a `vllm.general_plugins` entry point of the installed
rayapp, acting when `VLLM_PLUGINS` names it (`plugin_env`).
"""

from __future__ import annotations

from typing import Any

from rayapp.config import KVTierConfig, SparseConfig

# Mirrors of `rayapp.vllm_ext.connector`'s names, so this module (and the CLI) works without vLLM installed;
# tests/integrations checks that vLLM builds the connector from the JSON.
CONNECTOR_NAME = "RayappKVTierConnector"
CONNECTOR_MODULE = "rayapp.vllm_ext.connector"


def kv_transfer_config_json(
    dsn: str,
    model_id: str,
    *,
    ray_address: str | None = None,
    capacity_bytes: int = KVTierConfig.capacity_bytes,
    min_load_tokens: int = KVTierConfig.min_load_tokens,
) -> dict[str, Any]:
    """vLLM's `kv_transfer_config` for the cluster tier, as JSON values (`vllm serve --kv-transfer-config '<json>'`,
    or `engine_kwargs: {kv_transfer_config: ...}`).

    `model_id` names the model in the blocks' hashes: every engine sharing the tier (and rayapp's router, if one
    routes them) must give the same one. `ray_address`: the Ray cluster the workers join to reach the node stores
    (None: their `ray.init()` default; "local": a private one-node Ray each).
    """
    tier = KVTierConfig(enabled=True, dsn=dsn, capacity_bytes=capacity_bytes, min_load_tokens=min_load_tokens)
    if not model_id.strip():
        raise ValueError("model_id is empty; give the model's name, the same on every engine sharing the tier")
    settings: dict[str, Any] = {
        "dsn": tier.dsn, "model_id": model_id, "capacity_bytes": tier.capacity_bytes,
        "min_load_tokens": tier.min_load_tokens,
    }  # fmt: skip
    if ray_address is not None:
        settings["ray_address"] = ray_address
    return {
        "kv_connector": CONNECTOR_NAME,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_both",
        # A block the tier cannot deliver is recomputed, never an error.
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"rayapp": settings},
    }


def cluster_kv_transfer_config_json(tier: KVTierConfig, model_id: str) -> dict[str, Any]:
    """`kv_transfer_config_json` for engines of the Ray cluster this process is connected to: `tier.dsn`, or the
    cluster's embedded database (started now if it is not running), with the cluster's address."""
    import ray

    if not ray.is_initialized():
        raise RuntimeError("the cluster KV tier needs Ray: connect to the cluster (ray.init) before building")
    from rayapp.kvtier.embedded import start_embedded_database

    dsn = tier.dsn or start_embedded_database(tier.data_dir)
    return kv_transfer_config_json(
        dsn, model_id, ray_address=ray.get_runtime_context().gcs_address, capacity_bytes=tier.capacity_bytes,
        min_load_tokens=tier.min_load_tokens,
    )  # fmt: skip


def plugin_env(sparse: SparseConfig) -> dict[str, str]:
    """The environment that turns the `retrieval` plugin on with `sparse` in the vLLM processes started under it
    (`VLLM_PLUGINS` naming it, and its settings as `RAYAPP_RETRIEVAL_SETTINGS`)."""
    from rayapp.vllm_ext.retrieval import settings_env

    return settings_env(sparse)

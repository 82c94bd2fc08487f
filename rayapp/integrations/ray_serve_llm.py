"""`build_openai_app`: Ray Serve LLM's app builder with rayapp's prefix router, KV events, cluster tier and plugin.

A Ray Serve LLM user switches by changing one line of their Serve config, the arguments staying as they are:

    import_path: rayapp.integrations.ray_serve_llm:build_openai_app   # was ray.serve.llm:build_openai_app

`args` are Ray Serve LLM's (`LLMServingArgs`: `llm_configs`, `ingress_deployment_config`, `ingress_cls_config`),
validated by Ray's own models, plus an optional `rayapp:` section (`RayappSection`: `router`, `kvtier`, `sparse`,
rayapp's own settings classes). Each `LLMConfig` is then rewritten and handed to Ray's `build_openai_app`, so
the app is Ray's (its OpenAI ingress, its `LLMServer` on vLLM) with, per model deployment:

- the request router `ServeLLMPrefixRouter` (`request_router_config`), which renders each request with vLLM's
  renderer and routes it by the blocks rayapp's PrefixIndex knows the replicas hold;
- the server `RayappLLMServer` (`server_cls`), which turns on vLLM's KV events per replica and feeds them to
  the PrefixIndex;
- `engine_kwargs.block_size` pinned (vLLM's own default for the hardware where unset), as the router hashes with it;
- with `rayapp.kvtier.enabled`, the cluster tier as vLLM's KV connector (`kv_transfer_config`);
- with `rayapp.sparse.enabled`, the `retrieval` plugin's environment in the deployment's `runtime_env`.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from ray.serve import Application

from rayapp.config import KVTierSettings, RouterConfig, SparseSettings
from rayapp.integrations.stock_vllm import cluster_kv_transfer_config_json, plugin_env

ROUTER_CLASS = "rayapp.integrations.router:ServeLLMPrefixRouter"
# vLLM's page size where the user set none: vLLM's own default on that hardware.
DEFAULT_BLOCK_SIZES = {"cpu": 128, "gpu": 16}
# What the router's renderer needs of an LLMConfig to build the replica's vLLM renderer.
_RENDER_FIELDS = {"model_loading_config", "llm_engine", "engine_kwargs", "accelerator_type", "accelerator_config"}
# engine_kwargs that concern the replica's engine only, not how it renders prompts.
_ENGINE_ONLY = ("kv_transfer_config", "kv_events_config")


class RayappSection(BaseModel):
    """`rayapp:` in the builder's args; every section optional."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    router: RouterConfig = Field(
        default_factory=RouterConfig, description="Routing weights, PrefixIndex and event settings (router: of rayapp)"
    )
    kvtier: KVTierSettings = Field(
        default_factory=KVTierSettings, description="The cluster KV tier as vLLM's KV connector (kvtier: of rayapp)"
    )
    sparse: SparseSettings = Field(
        default_factory=SparseSettings, description="Sparse retrieval decode, vLLM's `retrieval` plugin (sparse:)"
    )

    @field_validator("router")
    @classmethod
    def _router_is_rayapps(cls, router: RouterConfig) -> RouterConfig:
        if "request_router_class" in router.model_fields_set:
            raise ValueError(
                "request_router_class is set by this builder (rayapp's router); remove it, or deploy with "
                "ray.serve.llm:build_openai_app and your router in deployment_config.request_router_config"
            )
        return router


def build_openai_app(args: dict[str, Any]) -> Application:
    """The `import_path` target: `args` as for `ray.serve.llm:build_openai_app`, plus an optional `rayapp:` section."""
    from ray.serve.llm import LLMServingArgs
    from ray.serve.llm import build_openai_app as ray_build_openai_app

    args = dict(args or {})
    section = parse_section(args.pop("rayapp", None))
    serving = LLMServingArgs.model_validate(args)  # Ray's own validation and messages
    return ray_build_openai_app({**args, "llm_configs": [with_rayapp(c, section) for c in serving.llm_configs]})


def parse_section(section: Any) -> RayappSection:
    """The `rayapp:` section, or an error that names each bad field and what is accepted."""
    if section is None:
        return RayappSection()
    if not isinstance(section, dict):
        raise ValueError(f"rayapp: must be a mapping with router, kvtier and sparse; got {type(section).__name__}")
    try:
        parsed = RayappSection.model_validate(section)
    except ValidationError as error:
        problems = "; ".join(
            f"rayapp.{'.'.join(str(part) for part in e['loc'])}: {e['msg']}" for e in error.errors(include_url=False)
        )
        raise ValueError(f"invalid rayapp: section ({problems})") from None
    # The engine-side settings check their fields together (and read the environment): fail here, not per replica.
    for name, build in (("sparse", parsed.sparse.sparse_config), ("kvtier", parsed.kvtier.to_config)):
        try:
            build()
        except ValueError as error:
            raise ValueError(f"invalid rayapp: section (rayapp.{name}: {error})") from None
    return parsed


def with_rayapp(llm_config: Any, section: RayappSection) -> Any:
    """A copy of `llm_config` (a validated `LLMConfig`) served with rayapp's router, KV events, tier and plugin."""
    from rayapp.integrations.server import RayappLLMServer

    _check(llm_config)
    config = llm_config.model_copy(deep=True)
    kwargs = dict(config.engine_kwargs)
    kind = getattr(config.accelerator_config, "kind", "gpu")
    if "block_size" not in kwargs:
        if kind not in DEFAULT_BLOCK_SIZES:
            raise ValueError(
                f"llm_config {config.model_id!r}: set engine_kwargs.block_size for {kind} replicas (rayapp's router "
                "hashes prompts with the engine's page size)"
            )
        kwargs["block_size"] = DEFAULT_BLOCK_SIZES[kind]
    block_size = int(kwargs["block_size"])
    sparse = section.sparse.sparse_config()
    if sparse.enabled:
        errors = sparse.vllm_plugin_errors(block_size)
        if errors:
            raise ValueError(f"rayapp.sparse ({config.model_id!r}): " + "; ".join(errors))
        runtime_env = dict(config.runtime_env or {})
        runtime_env["env_vars"] = {**(runtime_env.get("env_vars") or {}), **plugin_env(sparse)}
        config.runtime_env = runtime_env
    if section.kvtier.enabled:
        if "kv_transfer_config" in kwargs:
            raise ValueError(
                f"llm_config {config.model_id!r}: engine_kwargs.kv_transfer_config is already set; vLLM takes one KV "
                "connector: remove it, or turn rayapp.kvtier off"
            )
        kwargs["kv_transfer_config"] = cluster_kv_transfer_config_json(section.kvtier.to_config(), config.model_id)
    config.engine_kwargs = kwargs
    render = config.model_dump(mode="json", include=_RENDER_FIELDS)
    render["engine_kwargs"] = {k: v for k, v in render["engine_kwargs"].items() if k not in _ENGINE_ONLY}
    router_kwargs = {
        "block_size": block_size, "model_id": config.model_id, "llm_config": render,
        **section.router.model_dump(exclude={"request_router_class"}),
    }  # fmt: skip
    config.deployment_config = {
        **config.deployment_config,
        "request_router_config": {"request_router_class": ROUTER_CLASS, "request_router_kwargs": router_kwargs},
    }
    config.server_cls = RayappLLMServer
    return config


def _check(llm_config: Any) -> None:
    """Refuse what rayapp's pieces cannot serve, saying what to change."""
    from ray.llm._internal.serve.constants import RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING

    name = f"llm_config {llm_config.model_id!r}"
    kwargs = llm_config.engine_kwargs
    if RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING:
        raise ValueError(
            "RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING=1 routes with Ray's own LLMRouter, not rayapp's; unset it"
        )
    if str(getattr(llm_config.llm_engine, "value", llm_config.llm_engine)) != "vLLM":
        raise ValueError(f"{name}: llm_engine {llm_config.llm_engine!r}: rayapp's KV events need llm_engine: vLLM")
    if llm_config.server_cls is not None:
        raise ValueError(f"{name}: server_cls is set by this builder (rayapp's LLMServer subclass); remove it")
    if "request_router_config" in llm_config.deployment_config:
        raise ValueError(
            f"{name}: deployment_config.request_router_config is set by this builder (rayapp's router); remove it, "
            "and tune it in the rayapp.router section"
        )
    if llm_config.lora_config is not None:
        raise ValueError(
            f"{name}: lora_config is not served with rayapp's router (vLLM's KV events do not name adapters in "
            "rayapp's hashes); deploy it with ray.serve.llm:build_openai_app"
        )
    if "kv_events_config" in kwargs:
        raise ValueError(f"{name}: engine_kwargs.kv_events_config is set per replica by rayapp's server; remove it")
    if kwargs.get("enable_prefix_caching") is False:
        raise ValueError(f"{name}: engine_kwargs.enable_prefix_caching: false leaves rayapp's router nothing to use")

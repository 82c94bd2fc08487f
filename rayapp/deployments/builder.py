"""`build_app`: the application `rayapp.config.yaml` (and the KubeRay RayService) deploys."""

from __future__ import annotations

import importlib
from typing import Any

import ray
from ray import serve
from ray.serve import Application

from rayapp.config import AppConfig
from rayapp.deployments.engines import backend_class, pin_model
from rayapp.deployments.ingress import OpenAIIngress
from rayapp.deployments.replica import LLMReplica
from rayapp.kvtier.embedded import HEAD_NODE_RESOURCE
from rayapp.prefix_router.router import PrefixAwareRouter
from rayapp.prefix_router.shards import IndexShards

# How long a replaced ingress (a rolling upgrade) keeps the streams it holds open: Serve stops it as soon as they end.
INGRESS_DRAIN_TIMEOUT_S = 3600


def build_app(args: dict[str, Any]) -> Application:
    """The `import_path` of `rayapp.config.yaml`: `args` is validated by `AppConfig`."""
    return build(AppConfig(**(args or {})))


def build(config: AppConfig, backend_cls: type | None = None, app_name: str = "rayapp") -> Application:
    """Bind the ingress to `replicas` LLMReplica replicas, each with one engine and device, routed by
    `config.router`, and start the application's PrefixIndex actor (named after `app_name`, the
    name the application is deployed under).

    `backend_cls` (an `EngineBackend` with `from_app_config`) lets tests run the real Serve path over
    a fake engine; None: the backend of `config.engine`, checked here (vLLM installed, `engine_kwargs`
    valid) so a bad setting fails the deploy, not each replica.
    """
    config = pin_model(config)
    backend_cls = backend_cls or backend_class(config)
    check_devices_fit(config)
    IndexShards.connect(app_name, config.router)
    router = config.router
    kwargs = {}
    if issubclass(_import(router.request_router_class), PrefixAwareRouter):
        kwargs = {"block_size": config.kv_block_size(), **router.model_dump(exclude={"request_router_class"})}
    # Serve refuses a fixed num_replicas beside an autoscaling_config.
    scaling: dict[str, Any] = {"num_replicas": config.replicas}
    if config.autoscaling_config is not None:
        scaling = {"autoscaling_config": config.autoscaling_config.model_dump(exclude_none=True)}
    replica = serve.deployment(
        LLMReplica,
        name="LLMReplica",
        **scaling,
        ray_actor_options=config.ray_actor_options(),
        **config.placement_group_options(),
        # Replicas batch continuously: let Serve hand each one as many requests as it can queue.
        max_ongoing_requests=config.max_queued_requests,
        graceful_shutdown_timeout_s=config.graceful_shutdown_timeout_s,
        request_router_config={"request_router_class": router.request_router_class, "request_router_kwargs": kwargs},
    ).bind(config.model_dump(exclude_unset=True), backend_cls)
    ingress = serve.deployment(
        OpenAIIngress,
        name="OpenAIIngress",
        # The ingress holds its clients' streams and what a moved answer continues from: on the head, whose loss
        # is the cluster's, a worker node's loss takes only replicas (their answers move) and that node's store;
        # replaced, it drains longer than the replicas do, since their answers move and go on.
        ray_actor_options={"num_cpus": 0, "resources": {HEAD_NODE_RESOURCE: 0.001}},
        max_ongoing_requests=config.max_queued_requests + 64,
        graceful_shutdown_timeout_s=INGRESS_DRAIN_TIMEOUT_S,
    )
    return ingress.bind(replica, config.model_dump(exclude_unset=True))


def check_devices_fit(config: AppConfig) -> None:
    """Fail the deploy when no node of the running cluster has the devices one replica packs onto a node
    (tensor_parallel_size of them): Serve would otherwise wait for that placement group forever."""
    devices, resource = config.devices_per_replica(), config.ray_device_resource()
    if devices == 1 or resource is None or not ray.is_initialized():
        return
    most = max((node["Resources"].get(resource, 0) for node in ray.nodes() if node["Alive"]), default=0)
    if most == 0:
        # No node with this device has joined yet: an autoscaling KubeRay cluster starts its worker groups at zero
        # pods and adds them for the placement groups Serve asks for. Ray's scheduler is left to judge.
        return
    if most < devices:
        raise ValueError(
            f"tensor_parallel_size={config.tensor_parallel()} needs {devices} {resource}s on one node for each "
            f"replica, but the alive node with the most has {most:g}; lower tensor_parallel_size to {most:g} or "
            f"less, or give each worker node (pod) {devices} {resource}s"
        )


def _import(path: str) -> type:
    """The class named by `module:Class` (or `module.Class`), with an error that names the setting."""
    module, _, name = path.partition(":") if ":" in path else path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as error:
        raise ValueError(f"router.request_router_class={path!r} cannot be imported: {error}") from None
    if not isinstance(cls, type):
        raise ValueError(f"router.request_router_class={path!r} is not a class")
    return cls

"""`build_app`: the application `rayapp.config.yaml` (and the KubeRay RayService) deploys."""

from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve import Application

from rayapp.config import AppConfig
from rayapp.deployments.ingress import OpenAIIngress
from rayapp.deployments.replica import LLMReplica
from rayapp.engine.async_engine import AsyncLLMEngine


def build_app(args: dict[str, Any]) -> Application:
    """The `import_path` of `rayapp.config.yaml`: `args` is validated by `AppConfig`."""
    return build(AppConfig(**(args or {})))


def build(config: AppConfig, engine_cls: type = AsyncLLMEngine) -> Application:
    """Bind the ingress to `replicas` LLMReplica replicas, each with one engine and device.

    `engine_cls` lets tests run the real Serve path over a fake engine.
    """
    replica = serve.deployment(
        LLMReplica,
        name="LLMReplica",
        num_replicas=config.replicas,
        ray_actor_options=config.ray_actor_options(),
        # Replicas batch continuously: let Serve hand each one as many requests as it can queue.
        max_ongoing_requests=config.max_queued_requests,
        graceful_shutdown_timeout_s=30,
    ).bind(config.model_dump(), engine_cls)
    ingress = serve.deployment(
        OpenAIIngress,
        name="OpenAIIngress",
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=config.max_queued_requests + 64,
    )
    return ingress.bind(replica, config.model_dump())

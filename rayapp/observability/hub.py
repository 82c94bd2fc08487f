"""The per-application `MetricsHub` actor: replicas and request routers push snapshots to it every
`PUSH_PERIOD_S`, the ingress reads them for `/metrics`."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import ray
from ray.exceptions import RayActorError

from rayapp.observability import STALE_AFTER_S

# Seconds a call on the MetricsHub may take before its caller goes on without it.
HUB_TIMEOUT_S = 2.0


@ray.remote(num_cpus=0)
class MetricsHub:
    """Latest snapshot of every replica and request router of one application."""

    def __init__(self) -> None:
        self._snapshots: dict[str, tuple[float, dict[str, Any]]] = {}
        self._routers: dict[str, tuple[float, dict[str, Any]]] = {}

    def push(self, replica: str, snapshot: dict[str, Any]) -> None:
        self._snapshots[replica] = (time.monotonic(), snapshot)

    def push_router(self, router: str, snapshot: dict[str, Any]) -> None:
        self._routers[router] = (time.monotonic(), snapshot)

    def remove(self, replica: str) -> None:
        self._snapshots.pop(replica, None)

    def snapshots(self) -> dict[str, dict[str, Any]]:
        self._snapshots = _fresh(self._snapshots)
        return {r: s for r, (_, s) in self._snapshots.items()}

    def routers(self) -> dict[str, dict[str, Any]]:
        self._routers = _fresh(self._routers)
        return {r: s for r, (_, s) in self._routers.items()}


def _fresh(snapshots: dict[str, tuple[float, dict[str, Any]]]) -> dict[str, tuple[float, dict[str, Any]]]:
    now = time.monotonic()
    return {k: (t, s) for k, (t, s) in snapshots.items() if now - t < STALE_AFTER_S}


def metrics_hub(app_name: str) -> ray.actor.ActorHandle:
    """The application's hub, created by whichever replica or ingress asks first.

    Refuses to run without Ray rather than start one (a router thread outliving `ray.shutdown` would)."""
    if not ray.is_initialized():
        raise RuntimeError("Ray is not running: the metrics hub cannot be reached")
    return MetricsHub.options(
        name=f"rayapp-metrics-{app_name}", namespace="rayapp", get_if_exists=True, lifetime="detached", max_restarts=-1
    ).remote()


class HubClient:
    """The application's MetricsHub, as replicas, routers and the ingress call it, surviving the hub's death.

    A hub that crashes is restarted by Ray (the handle stays good); one that was killed, or lost with its
    node, is created again: the call that finds it dead drops the handle and the next call gets or makes a
    new hub by name. Replicas and routers push every `PUSH_PERIOD_S`, so a new hub is full again within one.
    """

    def __init__(self, app_name: str) -> None:
        self.app_name = app_name
        self._hub: ray.actor.ActorHandle | None = None

    async def call(self, method: str, *args: Any, timeout_s: float = HUB_TIMEOUT_S) -> Any:
        """`await hub.<method>(*args)`; raises what the call raised, TimeoutError past `timeout_s`."""
        if self._hub is None:
            self._hub = await asyncio.to_thread(metrics_hub, self.app_name)
        hub = self._hub
        try:
            return await asyncio.wait_for(getattr(hub, method).remote(*args), timeout_s)
        except RayActorError:
            if self._hub is hub:
                self._hub = None
            raise

    def send(self, method: str, *args: Any) -> None:
        """Fire and forget (from synchronous code, e.g. a replica going away); nothing when no hub was reached."""
        if self._hub is not None:
            getattr(self._hub, method).remote(*args)

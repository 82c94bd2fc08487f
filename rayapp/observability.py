"""Metrics plumbing every layer may use: the latency histogram, the push period, and the per-application
`MetricsHub` actor that replicas and request routers push snapshots to and the ingress reads for `/metrics`.

It sits below the packages that measure (`engine`'s users, `prefix_router`, `deployments`), so none of them
imports another for it; what each measures, and how `/metrics` renders it, stays with that package.
"""

from __future__ import annotations

import asyncio
import bisect
import time
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import RayActorError

PUSH_PERIOD_S = 0.5
# Seconds a call on the MetricsHub may take before its caller goes on without it.
HUB_TIMEOUT_S = 2.0
# A replica silent for this long is gone (dead or scaled down): its numbers leave /metrics.
STALE_AFTER_S = 10.0
LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclass
class Histogram:
    """Cumulative-bucket histogram in Prometheus' shape, cheap to snapshot and ship."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS_S) + 1))
    total: float = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(LATENCY_BUCKETS_S, value)] += 1
        self.total += value

    def buckets(self) -> list[tuple[str, int]]:
        running, out = 0, []
        for bound, count in zip((*LATENCY_BUCKETS_S, float("inf")), self.counts):
            running += count
            out.append(("+Inf" if bound == float("inf") else repr(bound), running))
        return out


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

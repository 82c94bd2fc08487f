"""Metrics plumbing every layer may use: what a component declares it counts (`Metric`), the latency histogram
and the push period; the per-application `MetricsHub` actor, which replicas and request routers push snapshots
to and the ingress reads for `/metrics`, is in `rayapp.observability.hub` (the only part that needs Ray).

It sits below the packages that measure (the engine, `kvtier`, `prefix_router`, `vllm_ext`, `deployments`), so
none of them imports another for it. Each component declares its metrics next to where it counts them; the
ingress renders whatever the replicas declare, so a new counter needs no edit where `/metrics` is rendered.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

PUSH_PERIOD_S = 0.5
# A replica silent for this long is gone (dead or scaled down): its numbers leave /metrics.
STALE_AFTER_S = 10.0
LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclass(frozen=True)
class Metric:
    """One number a component reports in its stats under `name`, shown on `/metrics` as `rayapp_<name>`."""

    name: str
    help: str
    kind: Literal["counter", "gauge"] = "counter"


def counters(helps: Mapping[str, str]) -> tuple[Metric, ...]:
    """Counters (cumulative since start), by name, with their help text."""
    return tuple(Metric(name, text, "counter") for name, text in helps.items())


def gauges(helps: Mapping[str, str]) -> tuple[Metric, ...]:
    """Gauges (a current value), by name, with their help text."""
    return tuple(Metric(name, text, "gauge") for name, text in helps.items())


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

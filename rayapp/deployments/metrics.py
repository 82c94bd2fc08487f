"""Metrics: each replica and each request router measures its own; the ingress renders all on `/metrics`.

Serve offers no way to call every replica of a deployment, so each replica (and each handle's
request router, `rayapp.prefix_router.metrics`) pushes a snapshot twice a second to one `MetricsHub`
actor per application (`rayapp.observability.hub`), and the ingress renders the hub's snapshots as
Prometheus text, labelled by replica. They also record the same numbers through `ray.util.metrics`,
which Ray's own metrics agent exports for a cluster Prometheus.

A replica's engine numbers are whatever its engine declares (`EngineBackend.metrics()`: the engine's,
its extensions', the tier client's, each declared where it is counted); a snapshot carries their
declarations, so nothing here names them.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from ray.util import metrics as ray_metrics

from rayapp.observability import LATENCY_BUCKETS_S, Histogram, Metric


class ReplicaMetrics:
    """One replica's request metrics, mirrored into Ray's metrics as they are recorded."""

    def __init__(self, replica: str) -> None:
        self.replica = replica
        self.requests: dict[str, int] = {}
        self.ttft = Histogram()
        self.itl = Histogram()
        tags = {"replica": replica}
        self._ray_requests = ray_metrics.Counter(
            "rayapp_replica_requests", "Requests finished, by finish reason", tag_keys=("replica", "finish_reason")
        )
        self._ray_ttft = ray_metrics.Histogram(
            "rayapp_time_to_first_token_seconds", "Time to first token", list(LATENCY_BUCKETS_S), ("replica",)
        )
        self._ray_itl = ray_metrics.Histogram(
            "rayapp_inter_token_latency_seconds", "Time between tokens", list(LATENCY_BUCKETS_S), ("replica",)
        )
        for metric in (self._ray_ttft, self._ray_itl):
            metric.set_default_tags(tags)
        # What the engine declares it reports (`declare`), and their Ray gauges.
        self.declared: dict[str, Metric] = {}
        self._ray_engine: dict[str, ray_metrics.Gauge] = {}

    def declare(self, metrics: tuple[Metric, ...]) -> None:
        """The engine's metrics (its backend's `metrics()`): `snapshot` reports exactly these of its stats."""
        self.declared = {m.name: m for m in metrics}
        for m in metrics:
            if m.name not in self._ray_engine:
                gauge = ray_metrics.Gauge(f"rayapp_{m.name}", m.help, tag_keys=("replica",))
                gauge.set_default_tags({"replica": self.replica})
                self._ray_engine[m.name] = gauge

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)
        self._ray_ttft.observe(seconds)

    def next_token(self, seconds: float) -> None:
        self.itl.observe(seconds)
        self._ray_itl.observe(seconds)

    def finished(self, reason: str) -> None:
        self.requests[reason] = self.requests.get(reason, 0) + 1
        self._ray_requests.inc(tags={"replica": self.replica, "finish_reason": reason})

    def snapshot(self, engine_stats: dict[str, int]) -> dict[str, Any]:
        engine = {k: v for k, v in engine_stats.items() if k in self.declared}
        for name, value in engine.items():
            self._ray_engine[name].set(value)
        return {
            "engine": engine,
            "declared": [self.declared[name] for name in engine],
            "requests": dict(self.requests),
            "ttft": (list(self.ttft.counts), self.ttft.total),
            "itl": (list(self.itl.counts), self.itl.total),
        }


class _Collector:
    def __init__(
        self,
        replicas: dict[str, dict[str, Any]],
        routers: dict[str, dict[str, Any]],
        index: dict[str, int] | None,
        http: dict[tuple[str, str], int],
        inflight: int,
        moved: int,
    ) -> None:
        self.replicas, self.routers, self.index = replicas, routers, index
        self.http, self.inflight, self.moved = http, inflight, moved

    def collect(self):
        http = CounterMetricFamily(
            "rayapp_http_requests", "HTTP requests by endpoint and status", labels=["endpoint", "status"]
        )
        for (endpoint, status), n in sorted(self.http.items()):
            http.add_metric([endpoint, status], n)
        yield http
        yield GaugeMetricFamily("rayapp_ingress_inflight_requests", "Requests admitted and not finished", self.inflight)
        yield CounterMetricFamily(
            "rayapp_ingress_moved_requests", "Requests continued on another replica after theirs died", self.moved
        )
        yield from self._replica_families()
        yield from self._router_families()

    def _replica_families(self):
        requests = CounterMetricFamily(
            "rayapp_requests", "Requests finished by a replica, by finish reason", labels=["replica", "finish_reason"]
        )
        declared = {m.name: m for snap in self.replicas.values() for m in snap["declared"]}
        kinds = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily}
        families = {n: kinds[m.kind](f"rayapp_{n}", m.help, labels=["replica"]) for n, m in sorted(declared.items())}
        ttft = HistogramMetricFamily("rayapp_time_to_first_token_seconds", "Time to first token", labels=["replica"])
        itl = HistogramMetricFamily("rayapp_inter_token_latency_seconds", "Time between tokens", labels=["replica"])
        for replica, snap in sorted(self.replicas.items()):
            for name, value in snap["engine"].items():
                families[name].add_metric([replica], value)
            for reason, n in sorted(snap["requests"].items()):
                requests.add_metric([replica, reason], n)
            for family, (counts, total) in ((ttft, snap["ttft"]), (itl, snap["itl"])):
                family.add_metric([replica], Histogram(counts, total).buckets(), total)
        yield requests
        yield from families.values()
        yield ttft
        yield itl

    def _router_families(self):
        """Summed over the application's routers (one per deployment handle)."""
        decisions: dict[str, int] = {}
        latency = Histogram()
        for snap in self.routers.values():
            for reason, n in snap["decisions"].items():
                decisions[reason] = decisions.get(reason, 0) + n
            counts, total = snap["latency"]
            latency = Histogram([a + b for a, b in zip(latency.counts, counts)], latency.total + total)
        yield CounterMetricFamily(
            "rayapp_router_predicted_cached_tokens",
            "Prompt tokens the router expected the chosen replica to serve from its cache",
            sum(s["predicted_cached_tokens"] for s in self.routers.values()),
        )
        by_reason = CounterMetricFamily(
            "rayapp_router_decisions", "Routing decisions by reason (overlap, load, fallback)", labels=["reason"]
        )
        for reason, n in sorted(decisions.items()):
            by_reason.add_metric([reason], n)
        yield by_reason
        yield HistogramMetricFamily(
            "rayapp_router_decision_latency_seconds", "Time to choose a replica", latency.buckets(), latency.total
        )
        if self.index is not None:
            yield GaugeMetricFamily("rayapp_prefix_index_blocks", "Blocks in the PrefixIndex", self.index["blocks"])
            yield GaugeMetricFamily(
                "rayapp_prefix_index_replicas", "Replicas reporting to the PrefixIndex", self.index["replicas"]
            )


def render_prometheus(
    replicas: dict[str, dict[str, Any]],
    routers: dict[str, dict[str, Any]],
    index: dict[str, int] | None,
    http_requests: dict[tuple[str, str], int],
    inflight: int,
    moved: int,
) -> bytes:
    """Prometheus text exposition of the ingress' counters (`moved`: requests continued elsewhere after
    their replica died), every replica's and router's snapshot, and the PrefixIndex's size (`index`
    None: it did not answer)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(replicas, routers, index, http_requests, inflight, moved))
    return generate_latest(registry)

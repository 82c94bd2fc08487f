"""Metrics: each replica and each request router measures its own; the ingress renders all on `/metrics`.

Serve offers no way to call every replica of a deployment, so each replica (and each handle's
request router, `rayapp.prefix_router.metrics`) pushes a snapshot twice a second to one `MetricsHub`
actor per application (`rayapp.observability`), and the ingress renders the hub's snapshots as
Prometheus text, labelled by replica. They also record the same numbers through `ray.util.metrics`,
which Ray's own metrics agent exports for a cluster Prometheus.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from ray.util import metrics as ray_metrics

from rayapp.observability import LATENCY_BUCKETS_S, Histogram

ENGINE_COUNTERS = {
    "prompt_tokens": "Prompt tokens received",
    "cached_prompt_tokens": "Prompt tokens served from the prefix cache instead of computed",
    "tier_loaded_tokens": "Of the cached prompt tokens, those loaded from the cluster KV tier",
    "tier_reloaded_tokens": "Tokens preempted sequences loaded back from the cluster KV tier instead of recomputing",
    "generation_tokens": "Tokens generated",
    "num_preemptions": "Sequences preempted (recomputed later) because KV pages ran out",
    "kv_events_lost_batches": "vLLM KV event batches the router's feed missed (the replica's entries were dropped)",
    # rayapp's engine only (its step loop, in the replica's engine process).
    "engine_steps": "Steps rayapp's engine ran",
    "engine_step_seconds": "Wall time inside rayapp's engine steps",
    "engine_step_cpu_seconds": "CPU time of the engine's step thread inside its steps (torch's intra-op threads not "
    "counted); below engine_step_seconds by the time the step waited for the GIL or for a core",
}
# Only with sparse attention on (`sparse.enabled`): its engine reports these too.
SPARSE_COUNTERS = {
    "sparse_seqs_dense": "Sequences whose prompt put them in dense attention mode",
    "sparse_seqs_sparse": "Sequences in sparse retrieval mode, all pages on device",
    "sparse_seqs_offload": "Sequences in sparse retrieval mode with their middle offloaded to host memory",
    "sparse_selected_blocks": "Middle retrieval blocks selected for attention, summed over steps and layers",
    "sparse_blocks_offloaded": "Retrieval blocks moved to the host pool",
    "sparse_cache_hits": "Selected offloaded blocks already in the device block cache",
    "sparse_cache_misses": "Selected offloaded blocks copied in from the host pool",
    # vLLM replicas (the retrieval plugin decides per decode step, by context length).
    "sparse_decode_steps_dense": "Decode steps of sequences attending densely, summed over sequences",
    "sparse_decode_steps_sparse": "Decode steps of sequences attending sparsely, summed over sequences",
    "sparse_blocks_represented": "Retrieval blocks whose representation was computed (prefix-cached ones are kept)",
}
SPARSE_GAUGES = {
    "sparse_running_sparse": "Running sequences in sparse retrieval mode",
    "sparse_running_dense": "Sequences that decoded densely in the last step (vLLM replicas)",
    "sparse_running_offload": "Running sequences in sparse retrieval mode with offload",
    "sparse_selected_blocks_last_step": "Retrieval blocks selected in the last step",
    "sparse_blocks_copied_last_step": "Blocks copied host-to-device in the last step",
    "sparse_host_pages_held": "KV pages held in the host pool",
    "sparse_device_cache_pages": "KV pages of the device block cache",
}
LAYERWISE_COUNTERS = {
    "layerwise_compacted_seqs": "Sequences whose KV was compressed layer-wise after their prompt",
    "layerwise_compaction_skipped": "Prompts left dense because the pool had no pages for their compacted KV",
    "layerwise_pages_saved": "KV pages given back to the pool by layer-wise compaction",
}
LAYERWISE_GAUGES = {
    "layerwise_running_compacted": "Running sequences holding layer-wise compressed KV",
    "layerwise_slots_held": "Per-layer page slots the compressed sequences hold (a pool page has one per layer)",
}
ENGINE_GAUGES = {
    "pages_free": "KV pages no sequence holds (cached ones included)",
    "pages_total": "KV pages in the pool",
    "pages_cached": "Free KV pages still holding a reusable prefix block",
    "num_running": "Sequences in the running batch",
    "num_waiting": "Sequences queued for admission",
}

COUNTERS = {**ENGINE_COUNTERS, **SPARSE_COUNTERS, **LAYERWISE_COUNTERS}
GAUGES = {**ENGINE_GAUGES, **SPARSE_GAUGES, **LAYERWISE_GAUGES}


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
        self._ray_engine = {
            name: ray_metrics.Gauge(f"rayapp_{name}", text, tag_keys=("replica",))
            for name, text in {**COUNTERS, **GAUGES}.items()
        }
        for metric in (self._ray_ttft, self._ray_itl, *self._ray_engine.values()):
            metric.set_default_tags(tags)

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
        engine = {k: v for k, v in engine_stats.items() if k in COUNTERS or k in GAUGES}
        for name, value in engine.items():
            self._ray_engine[name].set(value)
        return {
            "engine": engine,
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
        families = {
            **{n: CounterMetricFamily(f"rayapp_{n}", t, labels=["replica"]) for n, t in COUNTERS.items()},
            **{n: GaugeMetricFamily(f"rayapp_{n}", t, labels=["replica"]) for n, t in GAUGES.items()},
        }
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

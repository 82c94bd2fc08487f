"""Metrics: each replica and each request router measures its own; the ingress renders all on `/metrics`.

Serve offers no way to call every replica of a deployment, so each replica (and each handle's
request router) pushes a snapshot twice a second to one `MetricsHub` actor per application, and
the ingress renders the hub's snapshots as Prometheus text, labelled by replica. They also record
the same numbers through `ray.util.metrics`, which Ray's own metrics agent exports for a cluster
Prometheus.
"""

from __future__ import annotations

import asyncio
import bisect
import time
from dataclasses import dataclass, field
from typing import Any

import ray
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from ray.exceptions import RayActorError
from ray.util import metrics as ray_metrics

PUSH_PERIOD_S = 0.5
# Seconds a call on the MetricsHub may take before its caller goes on without it.
HUB_TIMEOUT_S = 2.0
# A replica silent for this long is gone (dead or scaled down): its numbers leave /metrics.
STALE_AFTER_S = 10.0
LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
ENGINE_COUNTERS = {
    "prompt_tokens": "Prompt tokens received",
    "cached_prompt_tokens": "Prompt tokens served from the prefix cache instead of computed",
    "tier_loaded_tokens": "Of the cached prompt tokens, those loaded from the cluster KV tier",
    "tier_reloaded_tokens": "Tokens preempted sequences loaded back from the cluster KV tier instead of recomputing",
    "generation_tokens": "Tokens generated",
    "num_preemptions": "Sequences preempted (recomputed later) because KV pages ran out",
    "kv_events_lost_batches": "vLLM KV event batches the router's feed missed (the replica's entries were dropped)",
    # rayapp's engine only (its step loop runs in the replica's process).
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


class RouterMetrics:
    """One request router's decisions: why each replica was chosen, and the cache hit it expected."""

    def __init__(self) -> None:
        self.decisions: dict[str, int] = {}
        self.predicted_cached_tokens = 0
        self.latency = Histogram()
        self._ray_decisions = ray_metrics.Counter(
            "rayapp_router_decisions", "Routing decisions by reason", tag_keys=("reason",)
        )
        self._ray_predicted = ray_metrics.Counter(
            "rayapp_router_predicted_cached_tokens", "Prompt tokens the router expected the chosen replica to have"
        )
        self._ray_latency = ray_metrics.Histogram(
            "rayapp_router_decision_latency_seconds", "Time to choose a replica", list(LATENCY_BUCKETS_S)
        )

    def decided(self, reason: str, predicted_cached_tokens: int, seconds: float) -> None:
        self.decisions[reason] = self.decisions.get(reason, 0) + 1
        self.predicted_cached_tokens += predicted_cached_tokens
        self.latency.observe(seconds)
        self._ray_decisions.inc(tags={"reason": reason})
        if predicted_cached_tokens:
            self._ray_predicted.inc(predicted_cached_tokens)
        self._ray_latency.observe(seconds)

    def snapshot(self) -> dict[str, Any]:
        return {
            "decisions": dict(self.decisions),
            "predicted_cached_tokens": self.predicted_cached_tokens,
            "latency": (list(self.latency.counts), self.latency.total),
        }


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

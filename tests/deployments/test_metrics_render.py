"""/metrics rendering: sparse-attention series appear for replicas that report them; routers are summed."""

from __future__ import annotations

import re

from rayapp.deployments.metrics import render_prometheus
from rayapp.engine.llm_engine import METRICS as ENGINE_METRICS
from rayapp.observability import LATENCY_BUCKETS_S
from rayapp.sparse.metrics import ENGINE_METRICS as SPARSE_METRICS

EMPTY = ([0] * (len(LATENCY_BUCKETS_S) + 1), 0.0)


def replica(engine: dict[str, int]) -> dict:
    declared = {m.name: m for m in ENGINE_METRICS + SPARSE_METRICS}
    return {
        "engine": engine,
        "declared": [declared[name] for name in engine],
        "requests": {"stop": 1},
        "ttft": EMPTY,
        "itl": EMPTY,
    }


def series(text: str, name: str) -> dict[str, float]:
    return {labels: float(v) for labels, v in re.findall(rf"^{name}(\{{[^}}]*\}}|) (\S+)$", text, re.M)}


def test_sparse_series_only_for_replicas_with_sparse_attention_and_routers_summed():
    dense = replica({"pages_total": 10, "cached_prompt_tokens": 5})
    sparse = replica({"pages_total": 10, "cached_prompt_tokens": 0, "sparse_seqs_offload": 2, "sparse_cache_hits": 7})
    routers = {
        "r1": {"decisions": {"overlap": 3}, "predicted_cached_tokens": 48, "latency": EMPTY},
        "r2": {"decisions": {"overlap": 1, "fallback": 2}, "predicted_cached_tokens": 16, "latency": EMPTY},
    }
    text = render_prometheus({"a": dense, "b": sparse}, routers, {"blocks": 9, "replicas": 2}, {}, 0, 1).decode()
    assert series(text, "rayapp_pages_total") == {'{replica="a"}': 10, '{replica="b"}': 10}
    assert series(text, "rayapp_sparse_seqs_offload_total") == {'{replica="b"}': 2}
    assert series(text, "rayapp_sparse_cache_hits_total") == {'{replica="b"}': 7}
    assert series(text, "rayapp_router_decisions_total") == {'{reason="fallback"}': 2, '{reason="overlap"}': 4}
    assert series(text, "rayapp_router_predicted_cached_tokens_total") == {"": 64}
    assert series(text, "rayapp_prefix_index_blocks") == {"": 9}
    assert series(text, "rayapp_ingress_moved_requests_total") == {"": 1}


def test_every_metric_an_engine_declares_reaches_metrics_without_a_table_in_deployments():
    from rayapp.deployments.metrics import ReplicaMetrics
    from rayapp.observability import Metric

    declared = (*ENGINE_METRICS, *SPARSE_METRICS, Metric("made_up_extension_counter", "Declared by a new extension"))
    metrics = ReplicaMetrics("r")
    metrics.declare(declared)
    stats = {m.name: 3 for m in declared} | {"not_declared": 1}
    text = render_prometheus({"r": metrics.snapshot(stats)}, {}, None, {}, 0, 0).decode()
    for m in declared:
        name = f"rayapp_{m.name}" + ("_total" if m.kind == "counter" else "")
        assert series(text, name) == {'{replica="r"}': 3}, name
    assert "not_declared" not in text

"""/metrics rendering: sparse-attention series appear for replicas that report them; routers are summed."""

from __future__ import annotations

import re

from rayapp.deployments.metrics import render_prometheus
from rayapp.engine.llm_engine import METRICS as ENGINE_METRICS
from rayapp.engine.sparse_kv import METRICS as SPARSE_METRICS
from rayapp.observability import LATENCY_BUCKETS_S

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

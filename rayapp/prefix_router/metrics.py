"""The prefix router's own metrics: why each replica was chosen, and the cache hit it expected."""

from __future__ import annotations

from typing import Any

from ray.util import metrics as ray_metrics

from rayapp.observability import LATENCY_BUCKETS_S, Histogram


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

"""An engine's process joins Ray as a driver for the tier: with subscription ids of its own, whatever the engine
seeded."""

from __future__ import annotations

import random

import ray

from rayapp.kvtier import join_ray


def test_joining_ray_draws_fresh_randomness_and_leaves_the_engines_seeded_stream(monkeypatch):
    # Ray names a driver's GCS subscriptions with `random`; engines seed it alike (vLLM: every worker with its
    # engine seed), and two drivers with one subscription id poll the GCS nonstop.
    drawn = []
    monkeypatch.setattr(ray, "init", lambda **kwargs: drawn.append(random.getrandbits(64)))
    random.seed(0)
    seeded = random.getrandbits(64)
    random.seed(0)
    join_ray("127.0.0.1:6379")
    join_ray("127.0.0.1:6379")
    assert seeded not in drawn and drawn[0] != drawn[1]
    assert random.getrandbits(64) == seeded  # the engine's own stream goes on where it was

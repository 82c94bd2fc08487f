"""An engine's process joins Ray as a driver for the tier: with subscription ids of its own, whatever the engine
seeded, and with its threads off the cores the engine computes on."""

from __future__ import annotations

import os
import random
import threading

import pytest
import ray

from rayapp.kvtier import join_ray, spare_cores, threads_on


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


def _affinity_of_a_new_thread() -> set[int]:
    seen = []
    thread = threading.Thread(target=lambda: seen.append(os.sched_getaffinity(0)))
    thread.start()
    thread.join()
    return seen[0]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_threads_the_tier_starts_from_a_core_bound_forward_run_on_the_cores_it_leaves():
    # vLLM's CPU worker binds its forward's thread to a core of its own; threads started from it inherit that core.
    assert spare_cores() == frozenset()  # nothing bound: nothing to move
    cores = os.sched_getaffinity(0)
    forward = {min(cores)}
    os.sched_setaffinity(0, forward)
    try:
        spare = spare_cores()
        assert spare == cores - forward
        with threads_on(spare):
            assert _affinity_of_a_new_thread() == spare
        assert os.sched_getaffinity(0) == forward and _affinity_of_a_new_thread() == forward
    finally:
        os.sched_setaffinity(0, cores)

"""The PrefixIndex actor in Ray: a routing decision is answered beside the queue of event batches, not behind it."""

from __future__ import annotations

import random

import ray

from rayapp.blocks import AllCleared, BlockStored
from rayapp.config import RouterConfig
from rayapp.prefix_router.actor import prefix_index
from rayapp.prefix_router.policy import Holding


def test_a_decision_does_not_wait_for_the_queue_of_event_batches():
    rng = random.Random(0)
    prompt = [rng.getrandbits(64) for _ in range(8)]
    # 30 batches of 20K blocks each (a fleet's burst: hundreds of replicas publishing at once).
    batches = [[AllCleared(), BlockStored(tuple(prompt), None, (), 16)]] + [
        [BlockStored(tuple(rng.getrandbits(64) for _ in range(200)), None, (), 16) for _ in range(100)]
        for _ in range(30)
    ]
    ray.init(address="local", num_cpus=1, include_dashboard=False, logging_level="ERROR")
    try:
        index = prefix_index("actor-test", RouterConfig(index_max_blocks=1_000_000, replica_timeout_s=600))
        ray.get(index.stats.remote())  # started
        queued = [index.publish.remote("r", batch, events) for batch, events in enumerate(batches)]
        assert ray.get(index.match.remote(prompt, ["r"])) == {"r": Holding(8)}
        applied, _ = ray.wait(queued, num_returns=len(queued), timeout=0)
        assert len(applied) < len(queued) // 2  # the match did not queue behind the batches
        assert all(ray.get(queued)) and ray.get(index.stats.remote())["blocks"] == 8 + 30 * 20_000
        ray.kill(index)
    finally:
        ray.shutdown()

"""The cluster tier across Ray nodes, with the embedded database rayapp starts itself (`kvtier.dsn` unset).

Two raylets on this machine (`ray.cluster_utils.Cluster`): an engine on the worker node serves a
conversation's first turn, an engine on the head node resumes it from the worker's store, and when
the worker node dies its blocks leave the catalog and the head recomputes them.
"""

from __future__ import annotations

import time

import psycopg
import pytest
import ray
from ray.cluster_utils import Cluster

from rayapp import LLM, SamplingParams
from rayapp.kvtier.embedded import stop_embedded_database
from rayapp.kvtier.store import store_name
from rayapp.models.tokenizer import chat_token_ids

# ~1.1K tokens of history, so the second turn is mostly blocks the worker node computed.
DOCUMENT = " ".join(
    f"Day {i}: the {bird} landed on the {roof} roof at {i % 12 + 1} o'clock and stayed {i * 3} minutes."
    for i, (bird, roof) in enumerate([("crow", "barn"), ("gull", "chapel"), ("swift", "mill"), ("owl", "school")] * 11)
)
PARAMS = SamplingParams(temperature=0.0, max_tokens=16)
FIRST_TURN = [{"role": "user", "content": f"Read this log.\n{DOCUMENT}\nWhich animal came first?"}]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    nodes = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "object_store_memory": 200 << 20, "include_dashboard": False},
    )
    worker = nodes.add_node(num_cpus=1, resources={"worker_node": 1}, object_store_memory=200 << 20)
    ray.init(address=nodes.address)
    nodes.wait_for_nodes()
    data_dir = str(tmp_path_factory.mktemp("kvtier-nodes") / "db")
    tier = {"enabled": True, "data_dir": data_dir, "capacity_bytes": 150 << 20}
    yield nodes, worker, tier
    stop_embedded_database()
    ray.shutdown()
    nodes.shutdown()


def worker_engine(tier: dict):
    """An `LLM` with the tier in an actor on the worker node (defined here, so Ray ships it by value)."""

    @ray.remote(num_cpus=1, resources={"worker_node": 1})
    class WorkerEngine:
        def __init__(self) -> None:
            self.llm = LLM(dtype="float32", num_pages=256, kvtier=tier)

        def node_id(self) -> str:
            return ray.get_runtime_context().get_node_id()

        def dsn(self) -> str:
            return self.llm.tier.dsn

        def chat(self, messages: list[dict], params: SamplingParams) -> str:
            text = self.llm.chat(messages, params)[0].outputs[0].text
            self.llm.tier.flush()  # written through before the next turn arrives, as a later request would be
            return text

    return WorkerEngine.remote()


def test_a_turn_served_on_one_node_resumes_on_another_and_a_dead_nodes_blocks_are_recomputed(cluster):
    nodes, worker, tier = cluster
    remote = worker_engine(tier)
    worker_id = ray.get(remote.node_id.remote())
    head_id = ray.get_runtime_context().get_node_id()
    assert worker_id != head_id

    # The database runs on the head and listens on its IP: the worker's replica dialled it there.
    dsn = ray.get(remote.dsn.remote())
    assert psycopg.conninfo.conninfo_to_dict(dsn)["host"] == ray.util.get_node_ip_address()
    with pytest.raises(psycopg.OperationalError):
        psycopg.connect(dsn.replace(psycopg.conninfo.conninfo_to_dict(dsn)["password"], "wrong"), connect_timeout=5)

    messages = FIRST_TURN + [
        {"role": "assistant", "content": ray.get(remote.chat.remote(FIRST_TURN, PARAMS))},
        {"role": "user", "content": "And which one came last?"},
    ]
    head = LLM(dtype="float32", num_pages=256, kvtier=tier)
    assert head.tier.dsn == dsn
    history_rows = head.tier.catalog.usage(node_id=worker_id).num_blocks
    assert history_rows > 0

    before = head.stats()
    resumed = head.chat(messages, PARAMS)[0]
    prompt = chat_token_ids(head.get_tokenizer(), messages)
    loaded = head.stats()["tier_loaded_tokens"] - before["tier_loaded_tokens"]
    assert loaded >= 0.9 * len(prompt), f"{loaded} of {len(prompt)} prompt tokens loaded from the worker's store"

    # The same turn recomputed (no tier, empty cache) answers exactly the same.
    engine = head.engine
    tier = engine.detach_tier()
    assert engine.block_manager.reset_prefix_cache()
    recomputed = head.chat(messages, PARAMS)[0]
    assert recomputed.num_cached_tokens == 0
    assert resumed.outputs[0].token_ids == recomputed.outputs[0].token_ids
    engine.attach_tier(tier)

    # The worker node dies: its object store, and every block in it, go with it.
    nodes.remove_node(worker)
    deadline = time.monotonic() + 60
    while any(n["NodeID"] == worker_id and n["Alive"] for n in ray.nodes()):
        assert time.monotonic() < deadline, "Ray did not declare the removed node dead"
        time.sleep(0.5)
    ray.get(ray.get_actor(store_name(head_id), namespace="rayapp").prune_dead_nodes.remote())
    assert head.tier.catalog.usage(node_id=worker_id).num_blocks == 0

    assert engine.block_manager.reset_prefix_cache()
    before = head.stats()
    again = head.chat(messages, PARAMS)[0]
    assert head.stats()["tier_loaded_tokens"] == before["tier_loaded_tokens"]
    assert again.outputs[0].token_ids == resumed.outputs[0].token_ids
    head.close()

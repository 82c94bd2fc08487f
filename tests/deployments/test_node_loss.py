"""Node loss, served: two Ray nodes on this machine (`ray.cluster_utils.Cluster`), one replica on each, the tier
on. The worker node dies (its raylet and every process on it) while answers stream: they continue on the head's
replica; the dead replica leaves the index and the dead node's blocks leave the catalog within their bounds; every
conversation, wherever its history lived, goes on with the same greedy answer; when a node joins again, Serve
places a replica on it and both replicas serve."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
import ray
from ray import serve
from ray.cluster_utils import Cluster
from ray.exceptions import GetTimeoutError, RayActorError
from ray.util.state import list_actors
from served import MODEL, stream_chat

from rayapp.config import AppConfig
from rayapp.deployments.builder import build
from rayapp.kvtier.catalog import Catalog
from rayapp.kvtier.embedded import start_embedded_database, stop_embedded_database
from rayapp.prefix_router.actor import prefix_index

CONVERSATIONS = [
    f"Here is a shelf list: {' '.join(f'box {i * 7 + k} holds {k * 3} {item}s;' for i in range(40))} "
    f"Which box holds the most {item}s?"
    for k, item in enumerate(["lamp", "spoon", "rope", "kettle"], start=1)
]
ANSWER_TOKENS = 96
# Bounds stated in docs/operations.md: a silent replica leaves the index after router.replica_timeout_s (10 s); the
# stores prune a dead node's catalog rows every 10 s once Ray declares it dead.
HEAL_S = 60


def _node(num_cpus: int = 1) -> dict:
    return {"num_cpus": num_cpus, "object_store_memory": 200 << 20}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, free_port):
    nodes = Cluster(initialize_head=True, head_node_args={**_node(), "include_dashboard": True})
    worker = nodes.add_node(**_node())
    ray.init(address=nodes.address)
    nodes.wait_for_nodes()
    port = free_port()
    config = AppConfig(
        replicas=2, num_cpus=1, dtype="float32", kv_cache_memory_gb=0.25,
        kvtier={"enabled": True, "data_dir": str(tmp_path_factory.mktemp("node-loss") / "db")},
    )  # fmt: skip
    try:
        # Both nodes are this machine: one proxy, on the head, takes the port.
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        serve.run(build(config), name="rayapp", route_prefix="/")
        yield nodes, worker, config, f"http://127.0.0.1:{port}"
    finally:
        try:
            serve.shutdown()
            stop_embedded_database()
        finally:
            ray.shutdown()
            nodes.shutdown()


def _replicas() -> dict[str, str]:
    """The live LLMReplica replicas: node ID -> replica ID (as the index names them)."""
    actors = list_actors(filters=[("class_name", "=", "ServeReplica:rayapp:LLMReplica"), ("state", "=", "ALIVE")])
    return {a.node_id: a.name.rsplit("#", 1)[-1] for a in actors}


def _body(messages: list[dict]) -> dict:
    return {"model": MODEL, "messages": messages, "max_tokens": ANSWER_TOKENS, "temperature": 0}


def _chat_all(url: str, conversations: list[list[dict]]) -> list[str]:
    """The answers to `conversations`, asked at once."""

    async def ask() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=url, timeout=300) as http:
            return await asyncio.gather(*(http.post("/v1/chat/completions", json=_body(m)) for m in conversations))

    responses = asyncio.run(ask())
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    return [r.json()["choices"][0]["message"]["content"] for r in responses]


def _wait(what: str, ready, limit_s: float = HEAL_S) -> float:
    """Seconds until `ready()` holds (at most `limit_s`)."""
    start = time.monotonic()
    while not ready():
        assert time.monotonic() - start < limit_s, f"{what}: not within {limit_s} s"
        time.sleep(0.5)
    return time.monotonic() - start


def test_a_lost_node_heals_and_its_conversations_go_on(cluster):
    nodes, worker, config, url = cluster
    replicas = _replicas()
    assert set(replicas) == {worker.node_id, ray.get_runtime_context().get_node_id()}
    lost = replicas[worker.node_id]
    index = prefix_index("rayapp", config.router, 0)
    catalog = Catalog(start_embedded_database(config.kvtier.data_dir), 3 * 64)

    # Each conversation's first turn, then its second turn's answer as the healthy cluster gives it; all at once,
    # so that load spreads the histories over both replicas.
    firsts = [[{"role": "user", "content": text}] for text in CONVERSATIONS]
    turns = [[*m, {"role": "assistant", "content": a}, {"role": "user", "content": "Why?"}]
             for m, a in zip(firsts, _chat_all(url, firsts), strict=True)]  # fmt: skip
    references = _chat_all(url, turns)
    # Some history lives on the worker: its replica wrote blocks to the tier from there.
    _wait("the worker's blocks in the catalog", lambda: catalog.usage(node_id=worker.node_id).num_blocks > 0)
    assert lost in _indexed(index)

    async def streams_through_the_loss() -> list[tuple[str, str | None, bool]]:
        started = asyncio.Event()
        async with httpx.AsyncClient(base_url=url, timeout=300) as http:
            answers = [asyncio.create_task(stream_chat(http, _body(m), started)) for m in turns]
            await started.wait()
            await asyncio.to_thread(nodes.remove_node, worker, False)  # no graceful exit: as a node crashes
            return await asyncio.gather(*answers)

    for (text, finish, done), reference in zip(asyncio.run(streams_through_the_loss()), references, strict=True):
        assert done and finish and text == reference

    _wait("the dead replica leaves the index", lambda: (held := _indexed(index)) is not None and lost not in held)
    _wait("the dead node's rows leave the catalog", lambda: catalog.usage(node_id=worker.node_id).num_blocks == 0)
    # Every conversation goes on where it is left: recomputed where its history died with the node.
    assert _chat_all(url, turns) == references

    # A node joins again: Serve places the second replica on it, and both replicas serve.
    returned = nodes.add_node(**_node())
    _wait("a replica on the new node", lambda: returned.node_id in _replicas(), limit_s=180)
    _wait("both replicas in the index", lambda: len(_indexed(index) or []) == 2)
    before = _served_by_replica(url)

    _chat_all(url, [[{"role": "user", "content": f"Name {k} colours."}] for k in range(2, 8)])
    _wait("requests on both replicas", lambda: all(
        _served_by_replica(url).get(r, 0) > before.get(r, 0) for r in _replicas().values()))  # fmt: skip
    catalog.close()


def _indexed(index) -> list[str] | None:
    """The replicas the index holds blocks of; None while it restarts (it may have lived on the lost node)."""
    try:
        return ray.get(index.replicas.remote(), timeout=10)
    except (RayActorError, GetTimeoutError):
        return None


def _served_by_replica(url: str) -> dict[str, float]:
    """Requests each replica finished, from /metrics."""
    counts: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith("rayapp_requests_total{"):
            replica = line.split('replica="', 1)[1].split('"', 1)[0]
            counts[replica] = counts.get(replica, 0.0) + float(line.rsplit(" ", 1)[1])
    return counts

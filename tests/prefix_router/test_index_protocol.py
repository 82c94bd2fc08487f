"""The replica-to-index protocol without Ray: numbered batches, snapshots after gaps and restarts, silent replicas."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from rayapp.blocks import AllCleared, BlockRemoved, BlockStored, hash_blocks
from rayapp.prefix_router import actor as actor_module
from rayapp.prefix_router.actor import PrefixIndexService
from rayapp.prefix_router.policy import Holding
from rayapp.prefix_router.publisher import KVEventPublisher

BS = 4
KEYS = ("m", "")
TOKENS = list(range(16))
HASHES = hash_blocks(TOKENS, BS, KEYS)


def stored(start: int, end: int) -> BlockStored:
    return BlockStored(
        tuple(HASHES[start:end]), HASHES[start - 1] if start else None, tuple(TOKENS[start * BS : end * BS]), BS
    )


class _Method:
    def __init__(self, fn, calls):
        self.fn, self.calls = fn, calls

    def remote(self, *args):
        self.calls.append(args)

        async def answer():
            return self.fn(*args)

        return answer()


class LocalHandle:
    """An in-process stand-in for the actor handle: `handle.method.remote(...)` is awaitable."""

    def __init__(self, service: PrefixIndexService) -> None:
        self.service, self.calls = service, []

    def __getattr__(self, name):
        return _Method(getattr(self.service, name), self.calls)


class FakeEngine:
    """What a replica's engine offers the publisher: pending events and an atomic snapshot."""

    def __init__(self) -> None:
        self.cached: list[BlockStored] = []
        self.pending: list = []

    def store(self, event: BlockStored) -> None:
        self.cached.append(event)
        self.pending.append(event)

    async def take_events(self) -> list:
        events, self.pending = self.pending, []
        return events

    async def snapshot(self) -> list:
        self.pending = []
        return [AllCleared(), *self.cached]


def publisher(engine: FakeEngine, handle: LocalHandle, max_events: int = 100) -> KVEventPublisher:
    return KVEventPublisher("r1", lambda: handle, engine.take_events, engine.snapshot, 0.01, max_events)


def test_first_batch_is_a_snapshot_then_events_follow_in_order():
    service, engine = PrefixIndexService(1000, 10.0), FakeEngine()
    handle = LocalHandle(service)
    pub = publisher(engine, handle)
    engine.store(stored(0, 2))
    asyncio.run(pub.publish())
    assert handle.calls[-1][1] == 0 and isinstance(handle.calls[-1][2][0], AllCleared)
    engine.store(stored(2, 4))
    asyncio.run(pub.publish())
    # Without their token ids: the index keys blocks by hash, and the ids would be most of the bytes sent.
    assert handle.calls[-1][1] == 1 and handle.calls[-1][2] == [dataclasses.replace(stored(2, 4), token_ids=())]
    assert service.match(HASHES, ["r1", "r2"]) == {"r1": Holding(4)}


def test_a_gap_is_refused_and_answered_with_a_snapshot():
    service, engine = PrefixIndexService(1000, 10.0), FakeEngine()
    handle = LocalHandle(service)
    pub = publisher(engine, handle)
    engine.store(stored(0, 2))
    asyncio.run(pub.publish())
    # A batch is lost on the way (say the call timed out): the next number arrives out of order.
    assert service.publish("r1", 5, [stored(2, 4)]) is False
    assert service.match(HASHES, ["r1"]) == {}
    pub._next_batch = 5
    engine.store(stored(2, 4))
    asyncio.run(pub.publish())  # refused: batch 5 is not what the index expects after a reset
    asyncio.run(pub.publish())  # the snapshot
    assert handle.calls[-1][1] == 0
    assert service.match(HASHES, ["r1"]) == {"r1": Holding(4)}


def test_an_index_that_restarted_empty_gets_a_snapshot():
    engine = FakeEngine()
    handle = LocalHandle(PrefixIndexService(1000, 10.0))
    pub = publisher(engine, handle)
    engine.store(stored(0, 3))
    asyncio.run(pub.publish())
    handle.service = PrefixIndexService(1000, 10.0)  # the actor restarted: it knows nobody
    engine.store(stored(3, 4))
    asyncio.run(pub.publish())  # refused
    asyncio.run(pub.publish())  # the snapshot
    assert handle.service.match(HASHES, ["r1"]) == {"r1": Holding(4)}


def test_large_snapshots_go_out_in_numbered_batches_of_at_most_max_events():
    service, engine = PrefixIndexService(1000, 10.0), FakeEngine()
    handle = LocalHandle(service)
    for i in range(4):
        engine.store(stored(i, i + 1))
    asyncio.run(publisher(engine, handle, max_events=2).publish())
    assert [(c[1], len(c[2])) for c in handle.calls] == [(0, 2), (1, 2), (2, 1)]
    assert service.match(HASHES, ["r1"]) == {"r1": Holding(4)}


def test_removed_blocks_and_stopped_replicas_leave_the_index():
    service = PrefixIndexService(1000, 10.0)
    service.publish("r1", 0, [AllCleared(), stored(0, 4)])
    service.publish("r2", 0, [AllCleared(), stored(0, 2)])
    service.publish("r1", 1, [BlockRemoved((HASHES[3],))])
    assert service.match(HASHES, ["r1", "r2"]) == {"r1": Holding(3), "r2": Holding(2)}
    service.remove_replica("r1")
    assert service.match(HASHES, ["r1", "r2"]) == {"r2": Holding(2)}
    assert service.stats() == {"blocks": 2, "replicas": 1}


def test_a_silent_replica_is_dropped_after_the_timeout(monkeypatch: pytest.MonkeyPatch):
    now = [100.0]
    monkeypatch.setattr(actor_module.time, "monotonic", lambda: now[0])
    service = PrefixIndexService(1000, replica_timeout_s=10.0)
    service.publish("r1", 0, [AllCleared(), stored(0, 4)])
    service.publish("r2", 0, [AllCleared(), stored(0, 4)])
    now[0] += 6
    service.publish("r2", 1, [])  # r2's heartbeat
    now[0] += 6
    assert set(service.match(HASHES, ["r1", "r2"])) == {"r2"}
    assert service.publish("r1", 1, []) is False  # r1 comes back: it must resend a snapshot


def test_matches_only_name_the_candidates_asked_about():
    service = PrefixIndexService(1000, 10.0)
    service.publish("r1", 0, [AllCleared(), stored(0, 4)])
    assert service.match(HASHES, ["r2"]) == {}

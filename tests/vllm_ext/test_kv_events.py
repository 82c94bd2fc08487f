"""vLLM's KV events, published by vLLM's own ZMQ publisher, re-keyed for the prefix router.

No engine here: vLLM's `ZmqEventPublisher` sends batches of vLLM's event types, as its scheduler
does, over IPC endpoints of this test's own; `VLLMKVEvents` must turn them into the hashes the
ingress computes for the same tokens and tenant, fill gaps from vLLM's replay buffer, and drop
what it can no longer vouch for.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

pytest.importorskip("vllm")

from vllm.distributed.kv_events import (  # noqa: E402
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    ZmqEventPublisher,
)

from rayapp.blocks import AllCleared, Tier, hash_blocks  # noqa: E402
from rayapp.blocks import BlockRemoved as RayappBlockRemoved  # noqa: E402
from rayapp.blocks import BlockStored as RayappBlockStored  # noqa: E402
from rayapp.prefix_router.actor import PrefixIndexService  # noqa: E402
from rayapp.prefix_router.index import PrefixIndex  # noqa: E402
from rayapp.prefix_router.publisher import KVEventPublisher  # noqa: E402
from rayapp.vllm_ext.kv_events import VLLMKVEvents  # noqa: E402
from rayapp.vllm_ext.tier_protocol import TIER_MEDIUM  # noqa: E402

BS = 4
MODEL = "m"
TOKENS = list(range(100, 124))  # 6 blocks


def vllm_hash(i: int, salt: str = "") -> bytes:
    """A stand-in for vLLM's own block hash of block i (any distinct bytes do)."""
    return f"{salt}/{i}".encode()


def stored(start: int, end: int, salt: str = "") -> BlockStored:
    """The BlockStored vLLM's BlockPool emits when blocks [start, end) of TOKENS become cached."""
    extra = [(salt,) if salt and i == 0 else None for i in range(start, end)]
    return BlockStored(
        block_hashes=[vllm_hash(i, salt) for i in range(start, end)],
        parent_block_hash=vllm_hash(start - 1, salt) if start else None,
        token_ids=TOKENS[start * BS : end * BS],
        block_size=BS,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        extra_keys=extra if any(extra) else None,
    )


def removed(*blocks: int, salt: str = "") -> BlockRemoved:
    return BlockRemoved(block_hashes=[vllm_hash(i, salt) for i in blocks], medium="GPU")


class Channel:
    """vLLM's publisher and rayapp's subscriber on fresh IPC endpoints."""

    def __init__(self, tmp_path, buffer_steps: int = 100) -> None:
        base = tmp_path / uuid.uuid4().hex[:8]
        self.endpoint, self.replay = f"ipc://{base}.pub", f"ipc://{base}.replay"
        self.publisher = ZmqEventPublisher(0, self.endpoint, self.replay, buffer_steps=buffer_steps)
        self.subscriber: VLLMKVEvents | None = None

    def subscribe(self) -> VLLMKVEvents:
        self.subscriber = VLLMKVEvents(self.endpoint, self.replay, MODEL, BS)
        time.sleep(0.3)  # let the SUB socket join before the live batches
        return self.subscriber

    def publish(self, *events) -> None:
        self.publisher.publish(KVEventBatch(ts=time.time(), events=list(events)))

    def wait_for(self, n_events: int) -> list:
        got: list = []
        deadline = time.monotonic() + 10
        while len(got) < n_events:
            assert time.monotonic() < deadline, f"got {got}"
            got += self.subscriber.take()
            time.sleep(0.02)
        return got

    def close(self) -> None:
        if self.subscriber is not None:
            self.subscriber.close()
        self.publisher.shutdown()


@pytest.fixture
def channel(tmp_path):
    c = Channel(tmp_path)
    yield c
    c.close()


def test_vllm_blocks_get_the_hashes_the_ingress_computes_for_the_same_tokens_and_tenant(channel):
    sub = channel.subscribe()
    channel.publish(stored(0, 2, salt="tenant-a"))
    channel.publish(stored(2, 5, salt="tenant-a"), removed(4, salt="tenant-a"))
    events = channel.wait_for(3)
    ingress = hash_blocks(TOKENS, BS, (MODEL, "tenant-a"))
    assert events[0] == RayappBlockStored(tuple(ingress[:2]), None, tuple(TOKENS[:8]), BS)
    assert events[1] == RayappBlockStored(tuple(ingress[2:5]), ingress[1], tuple(TOKENS[8:20]), BS)
    assert events[2] == RayappBlockRemoved((ingress[4],))
    # Another tenant's identical tokens are other blocks: the index never matches them to tenant-a's prompt.
    assert hash_blocks(TOKENS, BS, (MODEL, ""))[0] != ingress[0]
    assert sub.lost_batches == 0


def test_the_snapshot_rebuilds_what_the_events_built(channel):
    channel.subscribe()
    channel.publish(stored(0, 3))
    channel.publish(stored(3, 6), removed(5))
    events = channel.wait_for(3)
    live, rebuilt = PrefixIndex(), PrefixIndex()
    live.apply("r", events)
    request = hash_blocks(TOKENS, BS, (MODEL, ""))
    assert sorted(channel.subscriber.cached_blocks()) == sorted(request[:5])  # the mirror, as rayapp names it
    rebuilt.apply("r", channel.subscriber.snapshot())
    assert live.match(request)["r"].blocks == rebuilt.match(request)["r"].blocks == 5


def test_batches_a_slow_joiner_missed_are_replayed_from_vllms_buffer(channel):
    channel.publish(stored(0, 2))  # published before anyone listens: lost to the live stream
    channel.publish(stored(2, 4))
    time.sleep(0.3)
    sub = channel.subscribe()
    channel.publish(stored(4, 6))
    events = channel.wait_for(3)
    index = PrefixIndex()
    index.apply("r", events)
    assert index.match(hash_blocks(TOKENS, BS, (MODEL, "")))["r"].blocks == 6
    assert sub.lost_batches == 0


def test_a_gap_the_replay_buffer_no_longer_holds_drops_the_mirror_and_never_keeps_stale_blocks(tmp_path):
    channel = Channel(tmp_path, buffer_steps=1)
    try:
        channel.publish(stored(0, 2))
        channel.publish(removed(1))  # missed: a subscriber keeping block 1 would route to a block vLLM dropped
        time.sleep(0.3)
        sub = channel.subscribe()
        channel.publish(stored(2, 3), stored(0, 1, salt="b"))
        events = channel.wait_for(2)
        assert events[0] == AllCleared() and sub.lost_batches == 2
        # Block 2's parent chain was lost: it cannot be named; the other tenant's new chain can.
        assert events[1:] == [
            RayappBlockStored(tuple(hash_blocks(TOKENS[:4], BS, (MODEL, "b"))), None, tuple(TOKENS[:4]), BS)
        ]
        assert sub.skipped_blocks == 1
        assert sub.snapshot() == [AllCleared(), *events[1:]]
    finally:
        channel.close()


def test_vllm_clearing_its_cache_clears_the_replicas_entries(channel):
    channel.subscribe()
    channel.publish(stored(0, 3))
    channel.publish(AllBlocksCleared())
    assert channel.wait_for(2)[1] == AllCleared()
    assert channel.subscriber.snapshot() == [AllCleared()]


class _Method:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        async def answer():
            return self.fn(*args)

        return answer()


class LocalIndex:
    """The PrefixIndex actor in process, restarted by appending a new service: `handle.method.remote(...)`
    is awaitable and reaches the newest one, as a named actor's handle reaches the restarted actor."""

    def __init__(self, services: list[PrefixIndexService]) -> None:
        self.services = services

    def __getattr__(self, name):
        return _Method(getattr(self.services[-1], name))


def test_a_restarted_index_and_a_lost_index_batch_are_rebuilt_from_the_mirror(channel):
    sub = channel.subscribe()
    services = [PrefixIndexService(1000, 60.0)]

    async def take():
        return sub.take()

    async def snapshot():
        return sub.snapshot()

    publisher = KVEventPublisher("r", lambda: LocalIndex(services), take, snapshot, 0.01, 100)
    request = hash_blocks(TOKENS, BS, (MODEL, ""))

    def held() -> int:
        holding = services[-1].match(request, ["r"]).get("r")
        return holding.blocks if holding else 0

    async def until_held(blocks: int) -> None:
        deadline = time.monotonic() + 10
        while held() != blocks:
            assert time.monotonic() < deadline, f"the index holds {held()} blocks, not {blocks}"
            await publisher.publish()
            await asyncio.sleep(0.05)

    async def story():
        channel.publish(stored(0, 4))
        await until_held(4)
        services.append(PrefixIndexService(1000, 60.0))  # the actor restarted, empty
        channel.publish(stored(4, 6))
        await until_held(6)  # its batch is refused by the new index; the snapshot from the mirror is not
        services[-1].remove_replica("r")  # the index lost track of the replica (a gap in its numbered batches)
        channel.publish(removed(5))
        await until_held(5)

    asyncio.run(story())


def test_tier_connector_blocks_are_credited_to_every_replica_and_stay_out_of_the_mirror(channel):
    channel.subscribe()
    tier = hash_blocks(TOKENS, BS, (MODEL, ""))
    # What RayappKVTierConnector adds to vLLM's stream: blocks it wrote to the tier, by rayapp's hashes.
    channel.publish(
        BlockStored(
            block_hashes=tier[:4], parent_block_hash=None, token_ids=TOKENS[:16], block_size=BS, lora_id=None,
            medium=TIER_MEDIUM, lora_name=None,
        ),
        BlockRemoved(block_hashes=[tier[3]], medium=TIER_MEDIUM),
    )  # fmt: skip
    events = channel.wait_for(2)
    assert events == [
        RayappBlockStored(tuple(tier[:4]), None, tuple(TOKENS[:16]), BS, Tier.CLUSTER),
        RayappBlockRemoved((tier[3],), Tier.CLUSTER),
    ]
    service = PrefixIndexService(max_blocks=1000, replica_timeout_s=60)
    assert service.publish("writer", 0, [AllCleared(), *events])
    assert service.publish("other", 0, [AllCleared()])
    # Loadable by a replica that never held them; the one the store evicted is gone for everyone.
    assert service.match(tier, ["other"])["other"].blocks == 3
    assert channel.subscriber.snapshot() == [AllCleared()]

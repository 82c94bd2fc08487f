"""vLLM's KV events, re-keyed as rayapp's: the prefix router's feed for a vLLM replica.

vLLM's engine core publishes its prefix cache's changes over ZMQ (`kv_events_config`): numbered
batches of `BlockStored` / `BlockRemoved` / `AllBlocksCleared`, keyed by vLLM's own block hashes.
`VLLMKVEvents` subscribes in the replica's process, on a thread, and re-keys every block by
rayapp's hash chain (`hash_block`) over the token ids the event carries, salted by the
`cache_salt` the event carries, so a block's hash equals what the ingress computes for a new
prompt with the same tokens and tenant.

vLLM has no snapshot to ask for, so this keeps a mirror of the blocks vLLM reported holding; the
PrefixIndex's snapshot (first batch, after a lost batch, after the index restarted) is built from
it. A gap in vLLM's numbering (a slow-joining subscriber, a dropped message) is filled from vLLM's
replay buffer; when the buffer no longer holds it, the mirror is dropped (`AllCleared`) and rebuilt
from later events. So the index can miss blocks the replica holds (until vLLM stores them again),
but never keeps a block vLLM reported removing.

Blocks the cluster-tier connector wrote to (or saw leave) the tier come in the same stream with the
medium `TIER_MEDIUM`, already named by rayapp's hashes: they go to the router as cluster-tier events.
vLLM sends a step's connector events with the next step's output, so the router learns of a tier
block at the latest one engine step after its write, or with the next request on an idle replica.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq
from vllm.distributed.kv_events import AllBlocksCleared, KVEventBatch
from vllm.distributed.kv_events import BlockRemoved as VLLMBlockRemoved
from vllm.distributed.kv_events import BlockStored as VLLMBlockStored

from rayapp.blocks import AllCleared, BlockHash, BlockRemoved, BlockStored, KVEvent, Tier, hash_block
from rayapp.vllm_ext.tier_protocol import TIER_MEDIUM

logger = logging.getLogger(__name__)

# vLLM's replay protocol: the start sequence number, 8 bytes big-endian; -1 ends the replay.
_END_SEQ = -1
REPLAY_TIMEOUT_MS = 2000
POLL_MS = 100


@dataclass(frozen=True)
class _Block:
    block_hash: BlockHash
    parent: BlockHash | None
    token_ids: tuple[int, ...]
    salt: str


class VLLMKVEvents:
    """Subscriber to one vLLM engine's KV events; `take()` and `snapshot()` hand rayapp events to the publisher.

    `model_id` and `block_size` must be the ingress's (the extra keys and page size of its hashes).
    """

    def __init__(self, endpoint: str, replay_endpoint: str | None, model_id: str, block_size: int) -> None:
        self.model_id, self.block_size = model_id, block_size
        self._lock = threading.Lock()
        self._blocks: dict[Any, _Block] = {}  # vLLM block hash -> the block, as rayapp names it
        self._pending: list[KVEvent] = []
        self._next_seq = 0
        # Batches vLLM numbered that this subscriber never saw (nor could replay): each one dropped the mirror.
        self.lost_batches = 0
        # Blocks that could not be re-keyed (parent unknown after a loss, LoRA, multimodal keys, other page size).
        self.skipped_blocks = 0
        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self._ctx = zmq.Context.instance()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(endpoint)
        self._replay_endpoint = replay_endpoint
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rayapp-vllm-kv-events", daemon=True)
        self._thread.start()

    def take(self) -> list[KVEvent]:
        """The events since the last call."""
        with self._lock:
            events, self._pending = self._pending, []
        return events

    def snapshot(self) -> list[KVEvent]:
        """`AllCleared`, then a `BlockStored` per mirrored block (parents first); drops the pending events."""
        with self._lock:
            self._pending = []
            blocks = list(self._blocks.values())
        stored = [BlockStored((b.block_hash,), b.parent, b.token_ids, self.block_size) for b in blocks]
        return [AllCleared(), *stored]

    def cached_blocks(self) -> list[BlockHash]:
        """The mirrored blocks' hashes, as rayapp names them."""
        with self._lock:
            return [b.block_hash for b in self._blocks.values()]

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=2)
        self._sub.close(linger=0)

    def apply(self, batch: KVEventBatch) -> None:
        """Re-key one batch of vLLM events into pending rayapp events and the mirror."""
        with self._lock:
            for event in batch.events:
                if getattr(event, "medium", None) == TIER_MEDIUM:
                    self._tier(event)
                elif isinstance(event, VLLMBlockStored):
                    self._stored(event)
                elif isinstance(event, VLLMBlockRemoved):
                    self._removed(event)
                elif isinstance(event, AllBlocksCleared):
                    self._blocks.clear()
                    self._pending.append(AllCleared())

    def _tier(self, event: VLLMBlockStored | VLLMBlockRemoved) -> None:
        # The tier connector's events name blocks by rayapp's hashes already; they are the cluster's, not the mirror's.
        hashes = tuple(BlockHash(h) for h in event.block_hashes)
        if isinstance(event, VLLMBlockStored):
            parent = None if event.parent_block_hash is None else BlockHash(event.parent_block_hash)
            self._pending.append(BlockStored(hashes, parent, tuple(event.token_ids), event.block_size, Tier.CLUSTER))
        elif isinstance(event, VLLMBlockRemoved):
            self._pending.append(BlockRemoved(hashes, Tier.CLUSTER))

    def _stored(self, event: VLLMBlockStored) -> None:
        n = len(event.block_hashes)
        # lora_name, group_idx and extra_keys are newer fields of the event: absent on older vLLM releases.
        lora = getattr(event, "lora_name", None) or getattr(event, "lora_id", None)
        if (
            lora is not None
            or getattr(event, "group_idx", None) not in (None, 0)
            or event.block_size != self.block_size
        ):
            self.skipped_blocks += n
            return
        parent: BlockHash | None = None
        salt = ""
        if event.parent_block_hash is not None:
            known = self._blocks.get(event.parent_block_hash)
            if known is None:  # its chain was lost with a batch: nothing links it to a prompt's hashes
                self.skipped_blocks += n
                return
            parent, salt = known.block_hash, known.salt
        first_parent = parent
        extra_keys = getattr(event, "extra_keys", None) or [None] * n
        hashes: list[BlockHash] = []
        for i, vllm_hash in enumerate(event.block_hashes):
            keys = extra_keys[i]
            if parent is None and i == 0 and keys is not None:
                # The first block's extra keys: the cache_salt alone (LoRA and multimodal keys are not rayapp's).
                if len(keys) != 1 or not isinstance(keys[0], str):
                    self.skipped_blocks += n
                    return
                salt = keys[0]
            elif keys is not None:
                self.skipped_blocks += n - i
                break
            tokens = tuple(event.token_ids[i * self.block_size : (i + 1) * self.block_size])
            block_hash = hash_block(parent, tokens, (self.model_id, salt))
            self._blocks[vllm_hash] = _Block(block_hash, parent, tokens, salt)
            hashes.append(block_hash)
            parent = block_hash
        if hashes:
            tokens = tuple(event.token_ids[: len(hashes) * self.block_size])
            self._pending.append(BlockStored(tuple(hashes), first_parent, tokens, self.block_size))

    def _removed(self, event: VLLMBlockRemoved) -> None:
        if getattr(event, "group_idx", None) not in (None, 0):
            return
        gone = [self._blocks.pop(h).block_hash for h in event.block_hashes if h in self._blocks]
        if gone:
            self._pending.append(BlockRemoved(tuple(gone)))

    def _lost(self, upto: int) -> None:
        """Batches before `upto` cannot be had: forget the mirror, tell the index, go on from `upto`."""
        logger.warning(
            "vLLM KV event batches %d..%d were lost; the prefix index forgets this replica's blocks",
            self._next_seq,
            upto - 1,
        )
        with self._lock:
            self.lost_batches += upto - self._next_seq
            self._blocks.clear()
            self._pending.append(AllCleared())
        self._next_seq = upto

    def _receive(self, seq: int, payload: bytes) -> None:
        if seq < self._next_seq:
            return  # already applied (a replay overlapping the live stream)
        if seq > self._next_seq:
            self._replay(seq)
        if seq > self._next_seq:
            self._lost(seq)
        self.apply(self._decoder.decode(payload))
        self._next_seq = seq + 1

    def _replay(self, until: int) -> None:
        """Ask vLLM's replay buffer for the batches from `_next_seq` up to `until`, and apply them in order."""
        if self._replay_endpoint is None:
            return
        dealer = self._ctx.socket(zmq.DEALER)
        try:
            dealer.connect(self._replay_endpoint)
            dealer.send_multipart((b"", self._next_seq.to_bytes(8, "big")))
            while dealer.poll(REPLAY_TIMEOUT_MS):
                *_, seq_bytes, payload = dealer.recv_multipart()
                seq = int.from_bytes(seq_bytes, "big", signed=True)
                if seq == _END_SEQ or seq >= until:
                    break
                if seq != self._next_seq:
                    break  # the buffer starts later than we need: the rest is lost
                self.apply(self._decoder.decode(payload))
                self._next_seq = seq + 1
        finally:
            dealer.close(linger=0)

    def _run(self) -> None:
        while not self._closed.is_set():
            try:
                if not self._sub.poll(POLL_MS):
                    continue
                _topic, seq_bytes, payload = self._sub.recv_multipart()
                self._receive(int.from_bytes(seq_bytes, "big"), payload)
            except zmq.ZMQError:
                if self._closed.is_set():
                    return
                logger.exception("vLLM KV event subscription failed; retrying")
            except Exception:  # a batch we cannot decode: treat it as lost rather than stop listening
                logger.exception("could not apply a vLLM KV event batch")

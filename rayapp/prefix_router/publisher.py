"""A replica's side of the PrefixIndex protocol: numbered KV event batches, snapshots after a gap."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from rayapp.blocks import BlockStored, KVEvent

logger = logging.getLogger(__name__)

# With no events to send, a batch still goes out this often so the index knows the replica lives.
HEARTBEAT_S = 1.0
# A batch the index has not acknowledged by then is taken as lost. The index applies a replica's batches in order
# and Ray fails the call of an actor that died, so a late acknowledgement means a queue at the index: waiting for
# it (the events of the meantime going out together, in one larger batch) relieves the index, where resending a
# snapshot would add the replica's whole cache to the queue (with hundreds of replicas, a storm of them).
PUBLISH_TIMEOUT_S = 120.0


def on_the_wire(events: list[KVEvent]) -> list[KVEvent]:
    """`events` as the index reads them: stored blocks without their token ids (it keys blocks by hash), which
    would be most of a batch's bytes to pickle, send and unpickle."""
    return [dataclasses.replace(e, token_ids=()) if isinstance(e, BlockStored) and e.token_ids else e for e in events]


class KVEventPublisher:
    """Sends one replica's KV events to the PrefixIndex actor, in order, every `period_s`.

    `connect` returns the PrefixIndex actor (blocking; run off the event loop, again after a
    failure). `take_events` returns the events since its last call; `snapshot` returns `AllCleared`
    plus a `BlockStored` per cached block, taken atomically with dropping the pending events. The
    first send, and every send after a refused or failed one, is a snapshot.
    """

    def __init__(
        self,
        replica: str,
        connect: Callable[[], Any],
        take_events: Callable[[], Awaitable[list[KVEvent]]],
        snapshot: Callable[[], Awaitable[list[KVEvent]]],
        period_s: float,
        max_events: int,
    ) -> None:
        self.replica = replica
        self._connect = connect
        self._index: Any = None
        self._take_events = take_events
        self._snapshot = snapshot
        self.period_s = period_s
        self.max_events = max_events
        self._next_batch = 0
        self._resync = True
        self._last_sent = 0.0
        self._warned = False

    async def run(self) -> None:
        """Publish until cancelled; an unreachable index is retried (with a snapshot) every period."""
        while True:
            await asyncio.sleep(self.period_s)
            try:
                await self.publish()
                self._warned = False
            except Exception as error:  # the index is down or restarting: the router falls back meanwhile
                self._index = None
                if not self._warned:
                    logger.warning("PrefixIndex unreachable (%s); will resend a snapshot when it answers", error)
                    self._warned = True

    async def publish(self) -> None:
        """Send what happened since the last call (or a snapshot, if the index lost track of us)."""
        resync = self._resync
        events = await (self._snapshot() if resync else self._take_events())
        if not events and time.monotonic() - self._last_sent < HEARTBEAT_S:
            return
        # Until every batch below is acknowledged, the index may be missing some of these events.
        self._resync = True
        if self._index is None:
            self._index = await asyncio.to_thread(self._connect)
        batch = 0 if resync else self._next_batch
        for start in range(0, max(len(events), 1), self.max_events):
            chunk = on_the_wire(events[start : start + self.max_events])
            applied = await asyncio.wait_for(self._index.publish.remote(self.replica, batch, chunk), PUBLISH_TIMEOUT_S)
            batch += 1
            if not applied:
                return
        self._next_batch, self._resync, self._last_sent = batch, False, time.monotonic()

"""`PrefixAwareRouter`: Serve's request router for the replicas, routing each request by its cached prefix.

It runs inside every deployment handle of the replicas (the ingress'). Per request it reads the
block hashes the ingress computed (`prompt_blocks`; `rayapp.integrations` computes them itself behind
Ray Serve LLM's ingress), asks the PrefixIndex actor which candidate holds how many
leading blocks, takes each candidate's ongoing requests from Serve's queue-length cache, and
ranks the candidates by `policy.rank`. It never blocks the event loop and never fails a
request on the index's account: an index that is slow (over `index_timeout_s`) or down sends
the request through power-of-two choices instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Iterable
from typing import Any

import ray
from ray import serve
from ray.serve.exceptions import RayServeException
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from rayapp.blocks import BlockHash
from rayapp.config import RouterConfig
from rayapp.observability import PUSH_PERIOD_S
from rayapp.observability.hub import HubClient
from rayapp.prefix_router.metrics import RouterMetrics
from rayapp.prefix_router.policy import Holding, rank
from rayapp.prefix_router.shards import IndexShards

logger = logging.getLogger(__name__)

# After the index failed (not merely slow), it is not asked again for this long.
INDEX_RETRY_S = 1.0


def _in_serve_replica() -> bool:
    """Whether this router runs in a Serve replica (the ingress), not in a driver's handle.

    Only a replica's routers push metrics: a driver's (a test's, a script's) would keep calling Ray
    from Serve's router thread after the driver's `ray.shutdown`, which ends the process.
    """
    try:
        serve.get_replica_context()
    except RayServeException:
        return False
    return True


class PrefixAwareRouter(RequestRouter):
    """Routes by (prefill tokens left, queued requests); see `rayapp.prefix_router.policy`."""

    def initialize_state(self, block_size: int = 16, **router_config: Any) -> None:
        """`request_router_kwargs`: the KV page size and the `RouterConfig` fields."""
        self.block_size = block_size
        self.config = RouterConfig(**router_config)
        self.metrics = RouterMetrics()
        self._rng = random.Random()
        self._index: IndexShards | None = None
        self._index_retry_at = 0.0
        self._pusher: asyncio.Task[None] | None = None

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        start = time.perf_counter()
        if self._pusher is None and _in_serve_replica():
            self._pusher = asyncio.get_running_loop().create_task(self._push_metrics())
        hashes, prompt_tokens = await self.prompt_blocks(pending_request)
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        holdings = await self._match(hashes, list(by_id)) if hashes else None
        ongoing = await self._ongoing(candidate_replicas) if holdings else {}
        decision = rank(list(by_id), prompt_tokens, self.block_size, holdings, ongoing, self.config, self._rng)
        self.metrics.decided(decision.reason, decision.predicted_cached_tokens, time.perf_counter() - start)
        # One rank per replica, best first: if the best is full, Serve tries the next.
        return [[by_id[r]] for r in decision.ranked]

    async def prompt_blocks(self, pending_request: PendingRequest | None) -> tuple[list[BlockHash], int]:
        """The request's block hashes and prompt length: those rayapp's ingress computed and put on the request.

        Routers behind another ingress override this to compute them from what that ingress sends."""
        request = pending_request.args[0] if pending_request is not None and pending_request.args else None
        return getattr(request, "block_hashes", None) or [], len(getattr(request, "prompt_token_ids", ()))

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._forget([replica_id])

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        gone = set(self.curr_replicas) - {r.replica_id for r in replicas}
        super().update_replicas(replicas)
        self._forget(gone)  # scaled down or replaced: its pages are no longer routable

    def _forget(self, replica_ids: Iterable[ReplicaID]) -> None:
        """Tell the index these replicas are gone; if it cannot hear it now, its silence timeout will do."""
        if self._index is None:
            return
        with contextlib.suppress(Exception):
            for replica_id in replica_ids:
                self._index.remove_replica(replica_id.unique_id)

    async def _match(self, hashes: list[int], replicas: list[str]) -> dict[str, Holding] | None:
        """The index's answer, or None when it is down, restarting, or slower than `index_timeout_s`."""
        if time.monotonic() < self._index_retry_at:
            return None
        try:
            if self._index is None:
                self._index = await asyncio.wait_for(
                    asyncio.to_thread(IndexShards.connect, self.app_name, self.config), INDEX_RETRY_S
                )
            return await asyncio.wait_for(self._index.match(hashes, replicas), self.config.index_timeout_s)
        except asyncio.TimeoutError:
            return None
        except Exception as error:
            logger.warning("PrefixIndex unavailable (%s); power-of-two routing for %.0f s", error, INDEX_RETRY_S)
            self._index, self._index_retry_at = None, time.monotonic() + INDEX_RETRY_S
            return None

    async def _ongoing(self, candidates: list[RunningReplica]) -> dict[str, int]:
        """Requests each candidate runs or queues: Serve's cache, probing the replicas it lacks."""
        cache = self.replica_queue_len_cache
        known = {r.replica_id.unique_id: cache.get(r.replica_id) for r in candidates}
        missing = [r for r in candidates if known[r.replica_id.unique_id] is None]
        if missing:
            for replica, queue_len in await self._probe_queue_lens(missing, 0):
                known[replica.replica_id.unique_id] = queue_len
        return {r: n for r, n in known.items() if n is not None}

    async def _push_metrics(self) -> None:
        hub = HubClient(self.app_name)
        router_id = f"{self._deployment_id.name}@{id(self):x}"
        while True:
            try:
                await hub.call("push_router", router_id, self.metrics.snapshot())
            except Exception:  # metrics must never disturb routing
                if not ray.is_initialized():  # Ray shut down under this router (a driver's handle): nothing to push to
                    return
            await asyncio.sleep(PUSH_PERIOD_S)

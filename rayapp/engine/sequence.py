"""One request's tokens and progress through the engine."""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING, Any

from rayapp.blocks import BlockHash
from rayapp.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    # Out of the queue while the cluster tier loads blocks of it (`TierConnector`); back to WAITING when loaded.
    WAITING_FOR_TIER = "waiting_for_tier"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """A prompt plus the tokens generated so far.

    Invariants: `num_computed_tokens <= num_tokens`; the first `num_computed_tokens` tokens have
    their K/V in the pages of `block_table` (in token order), until layer-wise compression compacts
    them into per-layer slots of `carrier_pages`; `block_table` is append-only while the sequence
    runs and emptied only when the sequence is freed, preempted or compacted.
    """

    def __init__(
        self,
        seq_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_salt: str = "",
        arrival_time: float | None = None,
        block_hashes: list[BlockHash] | None = None,
    ) -> None:
        self.seq_id = seq_id
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        # Salts the block hashes: sequences with different salts (tenants) never share pages.
        self.cache_salt = cache_salt
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        # Prompt tokens found in the prefix cache at the latest admission.
        self.num_cached_tokens = 0
        self.block_table: list[int] = []
        # Hashes of this sequence's full blocks, in order: given by the ingress (which hashed the
        # prompt once, to route it) or filled by the BlockManager.
        self.block_hashes: list[BlockHash] = list(block_hashes or [])
        self.finish_reason: str | None = None
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.first_token_time: float | None = None
        self.num_preemptions = 0
        # Set by the engine for seeded sampling: the sequence's own random stream.
        self.generator: torch.Generator | None = None
        # Set by the engine for structured output: the grammar matcher its tokens advance.
        self.grammar: Any = None
        # Prompt tokens a prefix-cache hit must leave to compute (sparse retrieval scores blocks with
        # the queries of the prompt's last tokens, so they are recomputed, never served from cache).
        self.min_recompute_tokens = 1
        # The pages whose per-layer slots hold this sequence's KV once layer-wise compression compacted it
        # (`LayerwiseKV` keeps the per-layer tables); `block_table` is then empty.
        self.carrier_pages: list[int] = []
        # Table indices of prompt pages whose K/V a tier load put straight into the sparse host pool (a long
        # history resumed with offload on): admission maps them to `OFFLOADED` instead of device pages.
        self.host_pages = range(0)

    @property
    def compacted(self) -> bool:
        """Whether layer-wise compression holds this sequence's KV (in `carrier_pages`)."""
        return bool(self.carrier_pages)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()

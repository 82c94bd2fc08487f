"""Sparse retrieval's side of a long history resumed from the cluster tier: its middle goes to the host pool.

A prompt that sparse retrieval offloads (longer than `offload_boundary`) keeps its middle blocks in host
memory once prefilled. Loaded from the tier, the same blocks go there directly (`TierConnector.install` asks
`host_range`, then `resume_to_host`): they are copied into the `SparseKV` host pool and represented there,
the sequence's `host_pages` make admission map their pages to `OFFLOADED`, and only the init pages and
the window take device pages. The prefill of the prompt's uncached tail attends to that middle from host
memory, one layer at a time (`plan_prefill_host`, `host_pages_kv`); decode selects from it as for a
sequence offloaded after a local prefill.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import torch
from torch import Tensor

from rayapp.config import SparseConfig
from rayapp.engine.pages import OFFLOADED
from rayapp.engine.sequence import Sequence
from rayapp.kernels.retrieval import block_representation
from rayapp.sparse.host_pool import HostBlockPool
from rayapp.sparse.policy import AttentionMode, RetrievalPolicy

logger = logging.getLogger(__name__)


class LoadedBlock(Protocol):
    """One block loaded from outside the engine (the cluster tier's blocks are such)."""

    key: Tensor  # [num_layers, block_size, num_kv_heads, head_dim]
    value: Tensor


class RetrievalStore(Protocol):
    """What a resume reads and writes of one engine's `SparseKV`: its host pool, its representation store and
    its per-sequence state."""

    cfg: SparseConfig
    policy: RetrievalPolicy
    pool: HostBlockPool
    reps: Tensor  # [L, rows, max_blocks, Hkv, rep_rows, D]
    host_ids: Tensor  # [rows, max_blocks]
    rep_rows: int
    L: int
    Hkv: int
    D: int
    device: torch.device
    counters: dict[str, int]

    def state(self, seq: Sequence) -> Any: ...


class HostResume:
    """Puts resumed histories' middles into one engine's `SparseKV` host pool (its state, its counters): the
    cluster tier connector's `HostPlacement`."""

    def __init__(self, sparse: RetrievalStore) -> None:
        self.sparse = sparse

    def host_range(self, seq: Sequence, start: int, num_pages: int) -> range:
        """The pages of `seq` that a tier load of its pages `[start, start + num_pages)` puts in the host pool
        instead of device pages: the whole middle blocks it covers, for a sequence that offloads, when the
        load begins at or before the middle (a middle partly cached on the device is loaded as before)."""
        p = self.sparse.policy
        if p.mode(seq.num_prompt_tokens) is not AttentionMode.OFFLOAD or start > p.init_pages:
            return range(0)
        covered = max(0, start + num_pages - p.init_pages) // p.pages_per_block
        n = min(p.num_middle_blocks(seq.num_tokens + 1), covered)
        return range(p.init_pages, p.init_pages + n * p.pages_per_block)

    @torch.inference_mode()
    def resume_to_host(self, seq: Sequence, pages: range, blocks: list[LoadedBlock]) -> bool:
        """Put the middle blocks `blocks` (tier blocks, one per page of `pages`, from `host_range`) in the host
        pool as `seq`'s offloaded middle and represent them there, so admission maps those pages to
        `OFFLOADED`; False (nothing changed) when the host pool is full."""
        sp, ppb = self.sparse, self.sparse.policy.pages_per_block
        n = len(pages) // ppb
        try:
            ids = sp.pool.allocate(n)
        except ValueError as error:
            logger.warning("history of %s loaded onto the device, not the host pool: %s", seq.seq_id, error)
            return False
        # The pool as pages, [L, capacity * ppb, bs, Hkv, D]: each tier block is copied once, straight in.
        k_pages, v_pages = (x.view(sp.L, -1, sp.policy.block_size, sp.Hkv, sp.D) for x in (sp.pool.k, sp.pool.v))
        for j, block in enumerate(blocks):
            page = ids[j // ppb] * ppb + j % ppb
            k_pages[:, page] = block.key
            v_pages[:, page] = block.value
        host = torch.tensor(ids, dtype=torch.int64)
        st = sp.state(seq)
        if sp.rep_rows:
            keys = sp.pool.k.index_select(1, host).to(sp.device).flatten(0, 1)  # [L * n, rb, Hkv, D]
            reps = block_representation(keys, sp.cfg.representation, sp.cfg.representative_keys)
            sp.reps[:, st.row, :n] = reps.view(sp.L, n, sp.Hkv, sp.rep_rows, sp.D)
        sp.host_ids[st.row, :n] = host.to(sp.device)
        st.host_blocks.extend(ids)
        st.num_offloaded = st.num_represented = n
        seq.host_pages = pages
        sp.counters["sparse_blocks_resumed_to_host"] += n
        return True

    def plan_prefill_host(self, seqs: list[Sequence]) -> dict[int, tuple[int, Tensor]] | None:
        """For the step's prefill rows `seqs`: row -> (first page, host block ids) of each one whose middle
        is in the host pool (a resumed history), which its prefill attends to from there."""
        plan = {}
        for i, seq in enumerate(seqs):
            pages = seq.host_pages
            if pages and seq.block_table[pages.start] == OFFLOADED:
                row = self.sparse.state(seq).row
                plan[i] = (pages.start, self.sparse.host_ids[row, : len(pages) // self.sparse.policy.pages_per_block])
        return plan or None

    def host_pages_kv(self, layer: int, plan: dict[int, tuple[int, Tensor]]) -> dict[int, tuple[int, Tensor, Tensor]]:
        """`plan_prefill_host`'s rows with `layer`'s K and V of their host pages: [pages, bs, Hkv, D] each."""
        sp = self.sparse
        shape = (-1, sp.policy.block_size, sp.Hkv, sp.D)
        out = {}
        for i, (first, ids) in plan.items():
            ids = ids.cpu()
            k = sp.pool.k[layer].index_select(0, ids).view(shape).to(sp.device)
            v = sp.pool.v[layer].index_select(0, ids).view(shape).to(sp.device)
            out[i] = (first, k, v)
        return out

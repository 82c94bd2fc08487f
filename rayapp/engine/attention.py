"""Attention in rayapp's engine: what each of a step's rows attends to (`AttentionMetadata`, with the sparse
and layer-wise plans of the rows they take) and the model's attention callable (`PagedAttention`).

Prefill rows attend densely, over the shared page table (a resumed offloaded history's middle read from the
host pool); sparse retrieval may keep their queries to score blocks, and layer-wise compression their
log-sum-exp. Each decode row attends one way: densely over the shared table, sparsely (init pages, its
selected middle blocks, the window), or over its own per-layer tables once layer-wise compression compacted it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from rayapp.kernels.attention import paged_decode_attention, paged_prefill_attention, store_kv

if TYPE_CHECKING:
    from rayapp.engine.layerwise_kv import LayerwiseKV, LayerwisePlan
    from rayapp.engine.sparse_kv import SparseKV


@dataclass
class DecodePlan:
    """One step's sparse decode work. Indices refer to the step's decode rows."""

    dense_idx: Tensor  # [Bd] decode rows attending densely
    dense_table: Tensor  # [Bd, w] their page tables (only as wide as they need)
    dense_ctx: Tensor  # [Bd]
    sparse_idx: Tensor  # [Bs] decode rows attending sparsely
    rows: Tensor  # [Bs] store rows
    num_middle: Tensor  # [Bs]
    num_selected: Tensor  # [Bs]
    fixed_pages: Tensor  # [Bs, nf] init + window pages
    fixed_lens: Tensor  # [Bs, nf] valid tokens per fixed page (0: padding)
    middle_pages: Tensor  # [Bs, N, ppb] device pages of each middle block (sparse mode rows)
    full_table: Tensor  # [Bs, w] whole page table (dense layers of sparse-mode rows)
    full_ctx: Tensor  # [Bs]
    offload: Tensor  # [Bs] bool
    reselect: Tensor | None  # [Bs] bool rows due for a new selection; None: all
    query_slots: Tensor  # [Bs] where this step's query goes in the recent-query ring
    # Host-side copies of what each layer branches on, so no layer waits on a device sync.
    max_selected: int = 0
    any_offload: bool = False
    any_reselect: bool = True


@dataclass
class QueryCapture:
    """Prefill rows whose queries (the prompt's last `scoring_queries` tokens) are kept for scoring."""

    src: Tensor  # [M] rows of the step's prefill queries
    rows: Tensor  # [M] store rows
    slots: Tensor  # [M] ring slots


@dataclass
class AttentionMetadata:
    """Where this step's tokens go in the paged cache and what each one attends to."""

    slot_mapping: Tensor  # [T] page * block_size + offset of every new token
    num_decode_tokens: int  # the first tokens are decodes, one per sequence
    prefill_page_table: Tensor  # [Bp, max_pages]
    prefill_query_start_loc: Tensor  # [Bp + 1]
    prefill_context_lens: Tensor  # [Bp]
    # The decode rows, each in exactly one group: how they attend.
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    sparse_capture: QueryCapture | None = None  # prefill queries kept to score retrieval blocks
    # Prefill rows whose middle is in the sparse host pool: row -> (first page, host block ids).
    prefill_host: dict[int, tuple[int, Tensor]] | None = None
    layerwise: LayerwisePlan | None = None  # set when rows are compacted or prefill rows score their prompt


class DenseDecode:
    """Decode rows over their token-ordered page tables."""

    def __init__(self, table: Tensor, context_lens: Tensor, scale: float) -> None:
        self.table, self.context_lens, self.scale = table, context_lens, scale  # [B, w], [B]

    def __call__(self, layer: int, q: Tensor, k_cache: Tensor, v_cache: Tensor) -> Tensor:
        return paged_decode_attention(q, k_cache, v_cache, self.table, self.context_lens, self.scale)


class SparseDecode:
    """Decode rows in a sparse retrieval mode: init pages, their selected middle blocks, the window."""

    def __init__(self, sparse: SparseKV, plan: DecodePlan, scale: float) -> None:
        self.sparse, self.plan, self.scale = sparse, plan, scale

    def __call__(self, layer: int, q: Tensor, k_cache: Tensor, v_cache: Tensor) -> Tensor:
        return self.sparse.attend(layer, q, k_cache, v_cache, self.plan, self.scale)


class CompactedDecode:
    """Decode rows of sequences layer-wise compression compacted: each layer over its own slot table."""

    def __init__(self, layerwise: LayerwiseKV, plan: LayerwisePlan, scale: float) -> None:
        self.layerwise, self.plan, self.scale = layerwise, plan, scale

    def __call__(self, layer: int, q: Tensor, k_cache: Tensor, v_cache: Tensor) -> Tensor:
        return self.layerwise.attend(layer, q, self.plan, self.scale)


@dataclass
class DecodeGroup:
    """Decode rows that attend one way (`attend(layer, q, k_cache, v_cache)`, q: [rows, Hq, D])."""

    rows: Tensor | None  # their indices among the step's decode rows; None: all of them
    attend: DenseDecode | SparseDecode | CompactedDecode


class PagedAttention:
    """The model's attention callable for one step: store K/V into the pages, then attend."""

    def __init__(
        self,
        k_cache: Tensor,
        v_cache: Tensor,
        meta: AttentionMetadata,
        scale: float,
        sparse: SparseKV | None = None,
        layerwise: LayerwiseKV | None = None,
    ) -> None:
        self.k_cache, self.v_cache, self.meta, self.scale = k_cache, v_cache, meta, scale
        self.sparse, self.layerwise = sparse, layerwise

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        # q: [T, Hq, D]; k, v: [T, Hkv, D]
        m, lw = self.meta, self.meta.layerwise
        kc, vc = self.k_cache[layer], self.v_cache[layer]
        if lw is not None and lw.slots is not None:
            assert self.layerwise is not None
            self.layerwise.store(layer, k, v, lw)  # compacted rows write to their own slots
        else:
            store_kv(k, v, kc, vc, m.slot_mapping)
        nd = m.num_decode_tokens
        if m.sparse_capture is not None:
            assert self.sparse is not None
            self.sparse.capture(layer, q[nd:], m.sparse_capture)
        if nd == q.shape[0]:
            return self._decode(layer, q, kc, vc)
        host = None
        if m.prefill_host is not None:
            assert self.sparse is not None
            host = self.sparse.resume.host_pages_kv(layer, m.prefill_host)
        prefill = paged_prefill_attention(
            q[nd:], kc, vc, m.prefill_page_table, m.prefill_query_start_loc, m.prefill_context_lens, self.scale,
            host_pages=host,
        )  # fmt: skip
        if lw is not None and lw.capture is not None and self.layerwise is not None and layer >= self.layerwise.Lf:
            self.layerwise.capture(layer, q[nd:], kc, vc, prefill, lw.capture, self.scale)
        if nd == 0:
            return prefill
        return torch.cat([self._decode(layer, q[:nd], kc, vc), prefill])

    def _decode(self, layer: int, q: Tensor, kc: Tensor, vc: Tensor) -> Tensor:
        groups = self.meta.decode_groups
        if len(groups) == 1 and groups[0].rows is None:
            return groups[0].attend(layer, q, kc, vc)
        out = torch.empty_like(q)
        for group in groups:
            out[group.rows] = group.attend(layer, q[group.rows], kc, vc)
        return out

"""Attention in rayapp's engine: what each of a step's rows attends to (`AttentionMetadata`) and the model's
attention callable (`PagedAttention`).

The core attends densely: prefill rows over the shared page table, decode rows over theirs. A KV extension
(`rayapp.engine.extension`) changes that for the rows it plans: it may take decode rows into a `DecodeGroup`
of its own (sparse retrieval's selected blocks, layer-wise compression's per-layer tables), and hook each
layer of the step (`StepHooks`): store the new K/V itself, read the prefill queries or give host pages for
them to attend, read the prefill's output.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch
from torch import Tensor

from rayapp.kernels.attention import paged_decode_attention, paged_prefill_attention, store_kv

if TYPE_CHECKING:
    from rayapp.engine.sequence import Sequence

# Host-resident pages a prefill row attends to: row -> (first page, k, v), k and v [pages, bs, Hkv, D].
HostPages = dict[int, tuple[int, Tensor, Tensor]]
# How a group of decode rows attends at one layer: (layer, q [rows, Hq, D], k_cache, v_cache) -> [rows, Hq, D].
DecodeRows = Callable[[int, Tensor, Tensor, Tensor], Tensor]


class StepHooks(Protocol):
    """What an extension's plan does inside each layer of one step (`PagedAttention` calls them in order)."""

    def store(self, layer: int, k: Tensor, v: Tensor) -> bool:
        """Store the step's new K/V of `layer` itself (True), or leave it to the slot mapping (False)."""
        ...

    def prefill_queries(self, layer: int, q: Tensor) -> HostPages | None:
        """See the step's prefill queries (q: [T, Hq, D]) before they attend; return the host pages some prefill
        rows attend to, if any."""
        ...

    def after_prefill(self, layer: int, q: Tensor, k_cache: Tensor, v_cache: Tensor, out: Tensor) -> None:
        """See the prefill's output (out: [T, Hq, D]); rows it computes again its own way it writes back."""
        ...


class StepPlanner(Protocol):
    """What the model runner asks of each extension while it prepares a step (`KVExtension.plan`)."""

    def plan(self, step: StepInputs, decode_rows: list[int]) -> StepPlan | None:
        """This step's plan, taking some of `decode_rows` (indices among the step's decode rows that no planner
        before took); None: nothing to do in this step."""
        ...


@dataclass
class StepInputs:
    """One step as the model runner laid it out, for the extensions' plans. Decode rows come first."""

    seqs: list[Sequence]
    num_decodes: int
    starts: list[int]  # each sequence's computed tokens before the step
    num_new: list[int]  # the tokens it computes in the step
    tables: Tensor  # [B, w] page tables, padded with the null page
    slot_mapping: Tensor  # [T] page * block_size + offset of every new token
    scale: float


@dataclass
class StepPlan:
    """What one extension does in a step."""

    hooks: StepHooks | None = None
    # Groups of decode rows (indices among the step's decode rows) attending the extension's way, and those rows.
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    taken: list[int] = field(default_factory=list)


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
    # The extensions' hooks for this step, in the order the extensions were built.
    hooks: list[StepHooks] = field(default_factory=list)


class DenseDecode:
    """Decode rows over their token-ordered page tables."""

    def __init__(self, table: Tensor, context_lens: Tensor, scale: float) -> None:
        self.table, self.context_lens, self.scale = table, context_lens, scale  # [B, w], [B]

    def __call__(self, layer: int, q: Tensor, k_cache: Tensor, v_cache: Tensor) -> Tensor:
        return paged_decode_attention(q, k_cache, v_cache, self.table, self.context_lens, self.scale)


@dataclass
class DecodeGroup:
    """Decode rows that attend one way (`attend(layer, q, k_cache, v_cache)`, q: [rows, Hq, D])."""

    rows: Tensor | None  # their indices among the step's decode rows; None: all of them
    attend: DecodeRows


class PagedAttention:
    """The model's attention callable for one step: store K/V into the pages, then attend."""

    def __init__(self, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata, scale: float) -> None:
        self.k_cache, self.v_cache, self.meta, self.scale = k_cache, v_cache, meta, scale

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        # q: [T, Hq, D]; k, v: [T, Hkv, D]
        m = self.meta
        kc, vc = self.k_cache[layer], self.v_cache[layer]
        if not any(hooks.store(layer, k, v) for hooks in m.hooks):
            store_kv(k, v, kc, vc, m.slot_mapping)
        nd = m.num_decode_tokens
        if nd == q.shape[0]:
            return self._decode(layer, q, kc, vc)
        host: HostPages | None = None
        for hooks in m.hooks:
            host = hooks.prefill_queries(layer, q[nd:]) or host
        prefill = paged_prefill_attention(
            q[nd:], kc, vc, m.prefill_page_table, m.prefill_query_start_loc, m.prefill_context_lens, self.scale,
            host_pages=host,
        )  # fmt: skip
        for hooks in m.hooks:
            hooks.after_prefill(layer, q[nd:], kc, vc, prefill)
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

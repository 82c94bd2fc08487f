"""Sparse retrieval attention in the engine: per-sequence state, per-step plans, per-layer attention.

Each sequence's mode follows its prompt length (`RetrievalPolicy.mode`). Sparse sequences get a
row in the representation store; after each step, blocks that filled get their representation
(all layers at once) and offload-mode sequences past their prefill move new middle blocks to the
host pool, releasing their device pages. Each decode step, per layer: score the middle blocks
with the step's query, keep the top-k per KV head, copy missing blocks into the device block
cache (offload mode), and attend over init + selected + window pages. Prefill stays dense.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from rayapp.config import EngineConfig
from rayapp.engine.attention import DecodeGroup, DenseDecode, StepInputs, StepPlan
from rayapp.engine.block_manager import BlockManager
from rayapp.engine.pages import NULL_PAGE, OFFLOADED
from rayapp.engine.sequence import Sequence
from rayapp.kernels.attention import paged_decode_attention
from rayapp.kernels.retrieval import (
    REPRESENTATIVE_ROWS,
    block_representation,
    oracle_block_scores,
    score_blocks,
    select_topk_blocks,
    sparse_decode_attention,
)
from rayapp.models.loader import ModelSpec
from rayapp.observability import Metric
from rayapp.sparse.block_cache import DeviceBlockCache
from rayapp.sparse.host_pool import HostBlockPool, copy_blocks_to_host
from rayapp.sparse.metrics import ENGINE_METRICS
from rayapp.sparse.plans import DecodePlan, SparseHooks
from rayapp.sparse.policy import AttentionMode, RetrievalPolicy
from rayapp.sparse.queries import QueryRing
from rayapp.sparse.resume import HostResume


@dataclass
class _SeqState:
    mode: AttentionMode
    row: int = -1  # row in the representation store; -1 for dense sequences
    num_represented: int = 0  # leading retrieval blocks with a representation
    num_offloaded: int = 0  # leading middle blocks moved to the host pool
    host_blocks: list[int] = field(default_factory=list)
    steps_since_select: int = 0
    selected_for: int = -1  # middle size the stored selection was made for


class SparseKV:
    """Retrieval state of one engine's sequences; reads and writes the ModelRunner's KV pools. Registered as the
    engine extension `sparse`; `resume` places resumed histories' middles in its host pool."""

    @staticmethod
    def reserved_pages(config: EngineConfig, spec: ModelSpec, num_pages: int) -> dict[str, int]:
        """The device block cache of offloaded sequences, after the BlockManager's pages."""
        policy = RetrievalPolicy(config.sparse, config.cache.block_size)
        limit = config.model.max_model_len or spec.max_position_embeddings
        blocks = policy.device_cache_blocks(limit, config.scheduler.max_num_seqs, num_pages)
        return {"sparse_cache": blocks * policy.pages_per_block} if blocks else {}

    # Entry points run in inference mode (the ModelRunner's, for the others): tensors created in it
    # may only be updated in it.
    def __init__(self, config: EngineConfig, runner, block_manager: BlockManager, max_model_len: int) -> None:
        self.cfg = config.sparse
        self.bm = block_manager
        self.runner = runner
        self.policy = RetrievalPolicy(self.cfg, config.cache.block_size)
        spec = runner.spec
        self.L, self.Hkv, self.D = spec.num_layers, spec.num_kv_heads, spec.head_dim
        self.device = runner.device
        self.dense_layers = frozenset(self.cfg.dense_layers)
        self.max_blocks = math.ceil(max_model_len / self.cfg.retrieval_block_size) + 1
        kind = self.cfg.representation
        self.rep_rows = 0 if kind == "oracle" else REPRESENTATIVE_ROWS[kind](self.cfg.representative_keys)
        self.rows_cap = 0
        self._free_rows: list[int] = []
        self.reps = torch.zeros(self.L, 0, self.max_blocks, self.Hkv, self.rep_rows, self.D, device=self.device)
        self.host_ids = torch.zeros(0, self.max_blocks, dtype=torch.int64, device=self.device)
        self.selection = torch.zeros(self.L, 0, self.Hkv, self.max_blocks, dtype=torch.int64, device=self.device)
        self.W = self.cfg.scoring_queries
        self.queries = QueryRing(self.L, self.W, spec.num_heads, self.Hkv, self.D, self.device)
        rb = self.cfg.retrieval_block_size
        block_bytes = 2 * self.L * rb * self.Hkv * self.D * runner.dtype.itemsize
        self.pool = HostBlockPool(
            (self.L, rb, self.Hkv, self.D),
            runner.dtype,
            max(1, int(self.cfg.host_pool_memory_gb * 2**30) // block_bytes),
            pin=self.device.type == "cuda",
        )
        region = runner.pool.region("sparse_cache")
        # Retrieval blocks per layer and KV head the device block cache holds.
        self.num_cache_blocks = region.num_pages // self.policy.pages_per_block
        self.cache = DeviceBlockCache(
            self.L,
            self.Hkv,
            self.num_cache_blocks,
            region.base,
            self.policy.pages_per_block,
            0,
            self.max_blocks,
            self.device,
        )
        self._states: dict[str, _SeqState] = {}
        self.counters = {f"sparse_seqs_{m.value}": 0 for m in AttentionMode}
        self.counters.update(sparse_selected_blocks=0, sparse_blocks_offloaded=0, sparse_blocks_resumed_to_host=0)
        self.last_step = {"sparse_selected_blocks_last_step": 0, "sparse_blocks_copied_last_step": 0}
        self.resume = HostResume(self)

    # --- per-sequence state ---------------------------------------------------------------

    def state(self, seq: Sequence) -> _SeqState:
        st = self._states.get(seq.seq_id)
        if st is None:
            st = _SeqState(self.policy.mode(seq.num_prompt_tokens))
            self.counters[f"sparse_seqs_{st.mode.value}"] += 1
            if st.mode is not AttentionMode.DENSE:
                st.row = self._take_row()
            self._states[seq.seq_id] = st
        return st

    def min_recompute_tokens(self, seq: Sequence) -> int:
        """The prompt's last queries score its retrieval blocks: they are recomputed, never served from cache."""
        if self.policy.mode(seq.num_prompt_tokens) is AttentionMode.DENSE:
            return 1
        return min(seq.num_prompt_tokens, self.cfg.scoring_queries)

    def keeps_own_layout(self, seq: Sequence) -> bool:
        """Sequences in a retrieval mode keep per-sequence state beside their pages."""
        return self.policy.mode(seq.num_prompt_tokens) is not AttentionMode.DENSE

    @torch.inference_mode()
    def drop(self, seq: Sequence) -> None:
        """Forget `seq` (finished, aborted or preempted): its row, host blocks and cached blocks."""
        seq.host_pages = range(0)
        st = self._states.pop(seq.seq_id, None)
        if st is None or st.row < 0:
            return
        self.pool.release(st.host_blocks)
        self.cache.forget_row(st.row)
        self._free_rows.append(st.row)

    def _take_row(self) -> int:
        if not self._free_rows:
            old, new = self.rows_cap, max(4, 2 * self.rows_cap)
            shape = (self.L, new - old, self.max_blocks, self.Hkv, self.rep_rows, self.D)
            self.reps = torch.cat([self.reps, torch.zeros(shape, device=self.device)], 1)
            self.host_ids = torch.cat(
                [self.host_ids, torch.zeros(new - old, self.max_blocks, dtype=torch.int64, device=self.device)], 0
            )
            extra = torch.zeros(self.L, new - old, self.Hkv, self.max_blocks, dtype=torch.int64, device=self.device)
            self.selection = torch.cat([self.selection, extra], 1)
            self.cache.grow_rows(new)
            self.queries.grow(new)
            self._free_rows = list(range(new - 1, old - 1, -1))
            self.rows_cap = new
        row = self._free_rows.pop()
        self.queries.clear(row)
        return row

    # --- after each step: representations and offload -----------------------------------

    @torch.inference_mode()
    def after_step(self, seqs: list[Sequence]) -> None:
        """Represent the blocks that filled this step; offload middle blocks of offload-mode sequences."""
        p, ppb = self.policy, self.policy.pages_per_block
        rep_pages, rep_rows, rep_blocks = [], [], []
        off_pages, off_seqs = [], []
        for seq in seqs:
            st = self.state(seq)
            if st.mode is AttentionMode.DENSE:
                continue
            filled = p.num_filled_blocks(seq.num_computed_tokens)
            for j in range(st.num_represented, filled if self.rep_rows else 0):
                first = p.init_pages + j * ppb
                rep_pages.append(seq.block_table[first : first + ppb])
                rep_rows.append(st.row)
                rep_blocks.append(j)
            st.num_represented = max(st.num_represented, filled)
            if st.mode is AttentionMode.OFFLOAD and seq.num_computed_tokens >= seq.num_prompt_tokens:
                if (host := seq.host_pages) and seq.block_table[host.start] != OFFLOADED:
                    # Recomputed (init pages evicted before admission) though the host pool holds them: it serves.
                    self.bm.release_pages(seq, list(host))
                middle = p.num_middle_blocks(seq.num_computed_tokens + 1)
                for j in range(st.num_offloaded, middle):
                    first = p.init_pages + j * ppb
                    off_pages.append(seq.block_table[first : first + ppb])
                    off_seqs.append((seq, st, j))
        if rep_pages:
            self._represent(rep_pages, rep_rows, rep_blocks)
        if off_pages:
            self._offload(off_pages, off_seqs)
        self.end_step()

    def _represent(self, pages: list[list[int]], rows: list[int], blocks: list[int]) -> None:
        k_cache = self.runner.pool.k  # [L, P, bs, Hkv, D]
        n, rb = len(pages), self.cfg.retrieval_block_size
        # keys: [L * n, rb, Hkv, D]
        keys = k_cache.index_select(1, self._tensor(pages).view(-1)).view(self.L * n, rb, self.Hkv, self.D)
        reps = block_representation(keys, self.cfg.representation, self.cfg.representative_keys)
        self.reps[:, self._tensor(rows), self._tensor(blocks)] = reps.view(self.L, n, self.Hkv, self.rep_rows, self.D)

    def _offload(self, pages: list[list[int]], owners: list[tuple[Sequence, _SeqState, int]]) -> None:
        ids = self.pool.allocate(len(pages))
        page_t = self._tensor(pages)
        copy_blocks_to_host(self.pool, self.runner.pool.k, page_t, ids, is_v=False)
        copy_blocks_to_host(self.pool, self.runner.pool.v, page_t, ids, is_v=True)
        ppb, init = self.policy.pages_per_block, self.policy.init_pages
        for (seq, st, j), host_id in zip(owners, ids):
            self.host_ids[st.row, j] = host_id
            st.host_blocks.append(host_id)
            st.num_offloaded = j + 1
            self.bm.release_pages(seq, list(range(init + j * ppb, init + (j + 1) * ppb)))
        self.counters["sparse_blocks_offloaded"] += len(pages)

    # --- decode ----------------------------------------------------------------------------

    def plan(self, step: StepInputs, decode_rows: list[int]) -> StepPlan | None:
        """Takes every decode row given when one of them is in a retrieval mode (the dense ones as a dense group
        of their own); keeps the scoring queries of the prefill rows and gives the host pages of resumed ones."""
        nd, hooks = step.num_decodes, None
        if nd < len(step.seqs):
            prefills = step.seqs[nd:]
            capture = self.queries.plan_capture(
                [None if (st := self.state(s)).mode is AttentionMode.DENSE else st.row for s in prefills],
                step.starts[nd:], step.num_new[nd:], [s.num_prompt_tokens for s in prefills],
            )  # fmt: skip
            host = self.resume.plan_prefill_host(prefills)
            if capture is not None or host is not None:
                hooks = SparseHooks(
                    None if capture is None else functools.partial(self.queries.capture, cap=capture),
                    None if host is None else functools.partial(self.resume.host_pages_kv, plan=host),
                )
        seqs = [step.seqs[i] for i in decode_rows]
        states = [self.state(s) for s in seqs]
        if all(st.mode is AttentionMode.DENSE for st in states):  # the engine's dense path, untouched
            return None if hooks is None else StepPlan(hooks)
        rows = self._tensor(decode_rows)
        decode = self.plan_decode(seqs, states, step.tables[rows])
        groups = [DecodeGroup(rows[decode.sparse_idx], functools.partial(self.attend, plan=decode, scale=step.scale))]
        if decode.dense_idx.numel():
            dense = DenseDecode(decode.dense_table, decode.dense_ctx, step.scale)
            groups.insert(0, DecodeGroup(rows[decode.dense_idx], dense))
        return StepPlan(hooks, groups, decode_rows)

    def reserve(self, seq: Sequence, num_new_tokens: int) -> None:
        """A retrieval-mode sequence's pages are the BlockManager's (offloaded ones only marked in its table)."""

    def plan_decode(self, seqs: list[Sequence], states: list[_SeqState], tables: Tensor) -> DecodePlan:
        """The sparse plan for decode rows `seqs` (their states `states`, their page tables `tables`' first rows),
        at least one of them in a retrieval mode."""
        sparse = [i for i, st in enumerate(states) if st.mode is not AttentionMode.DENSE]
        p, bs, ppb = self.policy, self.policy.block_size, self.policy.pages_per_block
        dense = [i for i, st in enumerate(states) if st.mode is AttentionMode.DENSE]
        fixed, lens, mids, ks, due, ctxs = [], [], [], [], [], []
        for i in sparse:
            seq, st = seqs[i], states[i]
            ctx = seq.num_computed_tokens + 1
            n_mid = p.num_middle_blocks(ctx)
            total = math.ceil(ctx / bs)
            pages = seq.block_table[: p.init_pages] + seq.block_table[p.window_start_page(ctx) : total]
            last = ctx - (total - 1) * bs
            fixed.append(pages)
            lens.append([bs] * (len(pages) - 1) + [last])
            mids.append(n_mid)
            ks.append(p.num_selected(n_mid))
            due.append(st.steps_since_select % self.cfg.retrieval_stride == 0 or st.selected_for != n_mid)
            st.steps_since_select = 0 if due[-1] else st.steps_since_select + 1
            if due[-1]:
                st.selected_for = n_mid
            ctxs.append(ctx)
        rows = self._tensor([states[i].row for i in sparse])
        query_slots = (self._tensor(ctxs) - 1) % self.W
        self.queries.mark(rows, query_slots)
        n_max = max(mids)
        width = max(map(len, fixed))
        sparse_t = self._tensor(sparse)
        mid_cols = p.init_pages + torch.arange(n_max * ppb, device=self.device)
        mid_cols = mid_cols.clamp(max=max(tables.shape[1] - 1, 0))
        dense_w = max((len(seqs[i].block_table) for i in dense), default=0)
        full_w = max(len(seqs[i].block_table) for i in sparse)
        self.last_step["sparse_selected_blocks_last_step"] = sum(ks)
        self.counters["sparse_selected_blocks"] += sum(ks)
        return DecodePlan(
            dense_idx=self._tensor(dense),
            dense_table=tables[self._tensor(dense), :dense_w],
            dense_ctx=self._tensor([seqs[i].num_computed_tokens + 1 for i in dense]),
            sparse_idx=sparse_t,
            rows=rows,
            num_middle=self._tensor(mids),
            num_selected=self._tensor(ks),
            fixed_pages=self._tensor([f + [NULL_PAGE] * (width - len(f)) for f in fixed]),
            fixed_lens=self._tensor([n + [0] * (width - len(n)) for n in lens]),
            middle_pages=tables[sparse_t][:, mid_cols].view(len(sparse), n_max, ppb),
            full_table=tables[sparse_t, :full_w],
            full_ctx=self._tensor(ctxs),
            offload=torch.tensor([states[i].mode is AttentionMode.OFFLOAD for i in sparse], device=self.device),
            reselect=None if all(due) else torch.tensor(due, device=self.device),
            query_slots=query_slots,
            max_selected=max(ks),
            any_offload=any(states[i].mode is AttentionMode.OFFLOAD for i in sparse),
            any_reselect=any(due),
        )

    def attend(self, layer: int, q: Tensor, k_cache: Tensor, v_cache: Tensor, plan: DecodePlan, scale: float) -> Tensor:
        """Attention of the sparse decode rows at `layer`. q: [Bs, Hq, D] -> [Bs, Hq, D]."""
        if layer in self.dense_layers and not plan.any_offload:
            return paged_decode_attention(q, k_cache, v_cache, plan.full_table, plan.full_ctx, scale)
        blocks, valid = self._select(layer, q, k_cache, plan, scale)
        Bs, Hkv, K = blocks.shape
        bs, ppb = self.policy.block_size, self.policy.pages_per_block
        rows = torch.arange(Bs, device=self.device)[:, None, None]
        # pages: [Bs, Hkv, K, ppb]
        pages = plan.middle_pages[rows, blocks]
        if plan.any_offload:
            off = plan.offload.nonzero().squeeze(1)
            o_rows, o_blocks = plan.rows[off], blocks[off]
            host = self.host_ids[o_rows[:, None, None], o_blocks]
            slots = self.cache.fetch(layer, o_rows, o_blocks, valid[off], host, self.pool, k_cache, v_cache)
            pages[off] = self.cache.slot_pages(slots)
        sel_lens = (valid.to(torch.int64) * bs)[:, :, None].expand(Bs, K, ppb).reshape(Bs, K * ppb)
        nf = plan.fixed_pages.shape[1]
        table = torch.cat([plan.fixed_pages[:, None].expand(Bs, Hkv, nf), pages.view(Bs, Hkv, K * ppb)], dim=2)
        lens = torch.cat([plan.fixed_lens, sel_lens], dim=1)
        out = sparse_decode_attention(q, k_cache, v_cache, table, lens, scale)
        if layer in self.dense_layers:  # sparse-mode rows stay dense here; offload rows cannot
            dense_rows = (~plan.offload).nonzero().squeeze(1)
            out[dense_rows] = paged_decode_attention(
                q[dense_rows], k_cache, v_cache, plan.full_table[dense_rows], plan.full_ctx[dense_rows], scale
            )
        return out

    def _select(self, layer: int, q: Tensor, k_cache: Tensor, plan: DecodePlan, scale: float) -> tuple[Tensor, Tensor]:
        """Top-k middle blocks per row and KV head: blocks [Bs, Hkv, K], valid [Bs, K]."""
        K = plan.max_selected
        valid = torch.arange(K, device=self.device) < plan.num_selected[:, None]
        stored = self.selection[layer, plan.rows, :, :K]  # [Bs, Hkv, K]
        if not plan.any_reselect:
            return stored, valid
        if self.rep_rows == 0:
            if plan.any_offload:
                raise ValueError("representation='oracle' reads every middle key and cannot serve offloaded sequences")
            scores = oracle_block_scores(q, k_cache, plan.middle_pages, plan.num_middle, scale)
        else:
            n_max = plan.middle_pages.shape[1]
            scores = score_blocks(
                self.queries.scoring_queries(layer, q, plan.rows, plan.query_slots),
                self.reps[layer, plan.rows, :n_max],
                self.cfg.representation,
            )
        blocks, valid = select_topk_blocks(scores, plan.num_middle, plan.num_selected)
        if self.cfg.retrieval_stride > 1:
            if plan.reselect is not None:
                blocks = torch.where(plan.reselect[:, None, None], blocks, stored)
            self.selection[layer, plan.rows, :, :K] = blocks
        return blocks, valid

    def metrics(self) -> tuple[Metric, ...]:
        return ENGINE_METRICS

    def stats(self) -> dict[str, int]:
        cs = self.cache.stats
        running = [st.mode for st in self._states.values()]
        return {
            **self.counters,
            **self.last_step,
            "sparse_running_sparse": running.count(AttentionMode.SPARSE),
            "sparse_running_offload": running.count(AttentionMode.OFFLOAD),
            "sparse_cache_hits": cs.hits,
            "sparse_cache_misses": cs.misses,
            "sparse_device_cache_pages": self.num_cache_blocks * self.policy.pages_per_block,
            "sparse_host_pages_held": self.pool.num_used * self.policy.pages_per_block,
        }

    def begin_step(self) -> None:
        """Start counting a step's selected and copied blocks (`after_step` ends it)."""
        self.last_step["sparse_blocks_copied_last_step"] = -self.cache.stats.misses
        self.last_step["sparse_selected_blocks_last_step"] = 0

    def end_step(self) -> None:
        self.last_step["sparse_blocks_copied_last_step"] += self.cache.stats.misses

    def _tensor(self, values: list) -> Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)

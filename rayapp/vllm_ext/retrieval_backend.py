"""RetrievalKV on vLLM's CPU attention: the backend the `retrieval` plugin registers as `CPU_ATTN`.

Per step the metadata builder sorts the batch's rows. Prefill rows, and decode rows whose context is
below `dense_boundary`, run vLLM's own kernel exactly as stock vLLM. (vLLM's attention metadata
carries no prompt length, so a sequence turns sparse when its context reaches the boundary, not by its
prompt alone as in rayapp's engine.) Each other decode row attends to its first `init_tokens`, its last
`local_tokens` and the top `topk_percent` of the retrieval blocks between, chosen per KV head at every
layer by scoring the step's query against block representations (`rayapp.kernels.retrieval`).

Selection and attention run on rayapp's C++ kernels (`rayapp.kernels.native`) where they can: one pass
scores every middle block of a row from the representation store and keeps its top k per KV head, and
the attention reads vLLM's pages in place, in vLLM's `vec` packing, each KV head its own page list.
Selection runs in torch only for the `mean` and `minmax` scorers, or where the kernels are not built.
With vLLM's `amx` packing, a quantized cache or no AVX-512, the attention is vLLM's CPU kernel: each
(sequence, KV head) is passed as a sequence of its own with one KV head, over a block table of only the
pages that head chose. The pages of one head sit at a fixed stride in vLLM's cache
(`[num_blocks, H, block_size, 2 * D]`), so the cache viewed as `[num_blocks * H, 1, block_size, 2 * D]`
is the same memory, and page `p` of head `h` is page `p * H + h` there.

Representations are kept per layer beside vLLM's cache, keyed by the physical page that ends the
block, and recomputed when a page of the block was written after them (`PageEpochs`): vLLM's prefix
cache hands a second turn the same pages and so the same representations.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor
from vllm import _custom_ops as ops
from vllm import envs
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.attention.backend import AttentionType, CommonAttentionMetadata
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
    CPUAttentionMetadataBuilder,
)

from rayapp.kernels import native
from rayapp.kernels.retrieval import REPRESENTATIVE_ROWS, block_representation, score_blocks, select_topk_blocks
from rayapp.sparse.policy import RetrievalPolicy
from rayapp.vllm_ext.pages import cpu_page_keys
from rayapp.vllm_ext.retrieval import EPOCHS, STATS, retrieval_config

logger = logging.getLogger("rayapp.retrieval")


@dataclass
class DenseRows:
    """The step's rows that run vLLM's kernel, as a batch of their own."""

    tokens: Tensor  # [Td] their query tokens in the step's batch
    query_start_loc: Tensor  # [Bd + 1] int32
    seq_lens: Tensor  # [Bd] int32
    block_table: Tensor  # [Bd, w]
    scheduler_metadata: Tensor


@dataclass
class SparseRows:
    """The step's sparse decode rows and what every layer needs to attend them."""

    tokens: Tensor  # [Bs] their query token in the step's batch
    middle: Tensor  # [Bs, N, ppb] pages of each middle retrieval block (0 past a row's num_middle)
    num_middle: Tensor  # [Bs]
    num_selected: Tensor  # [Bs]
    init: Tensor  # [Bs, 1, ni] init pages
    window: Tensor  # [Bs, 1, nw] window pages (the row's last page repeated past its own)
    # [Bs, 1, T] where each entry of a head's block table comes from in cat(init, selected pages, window):
    # a row's own init, then its selected blocks, then its window, then padding.
    order: Tensor
    seq_lens: Tensor  # [Bs * H] int32 tokens each (row, KV head) attends
    query_start_loc: Tensor  # [Bs * H + 1] int32
    scheduler_metadata: Tensor
    stale: Tensor  # [n, ppb] pages of the middle blocks whose representations this step computes


@dataclass
class RetrievalMetadata(CPUAttentionMetadata):
    """vLLM's CPU metadata for the whole batch (what a stock layer reads), and the sparse split."""

    dense_rows: DenseRows | None = None
    sparse_rows: SparseRows | None = None


class RetrievalCPUBackend(CPUAttentionBackend):
    """vLLM's CPU attention backend with sparse retrieval decode for long contexts."""

    @staticmethod
    def get_impl_cls() -> type[RetrievalCPUImpl]:
        return RetrievalCPUImpl

    @staticmethod
    def get_builder_cls() -> type[RetrievalCPUBuilder]:
        return RetrievalCPUBuilder


class RetrievalCPUBuilder(CPUAttentionMetadataBuilder):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.config = retrieval_config()
        errors = self.config.vllm_plugin_errors(self.block_size)
        if errors:
            raise ValueError("invalid retrieval plugin settings: " + "; ".join(errors))
        self.policy = RetrievalPolicy(self.config, self.block_size)
        self._warned_offload = False

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> RetrievalMetadata:
        cm = common_attn_metadata
        stock = super().build(common_prefix_len, cm, fast_build)
        meta = RetrievalMetadata(**{f.name: getattr(stock, f.name) for f in dataclasses.fields(stock)})
        slots = cm.slot_mapping[: cm.num_actual_tokens]
        pages = torch.unique(slots[slots >= 0] // self.block_size)
        num_pages = max(int(cm.block_table_tensor.max()) + 1 if cm.block_table_tensor.numel() else 0, 1)
        EPOCHS.begin_step(pages, num_pages)
        if self.is_cross_attention or self.is_encoder_only_attention or stock.causal is not True:
            return meta
        n = cm.num_reqs
        qsl, seq_lens = cm.query_start_loc_cpu[: n + 1], cm.seq_lens[:n].cpu()
        decode = (qsl[1:] - qsl[:-1]) == 1
        if cm.is_prefilling is not None:
            decode &= ~cm.is_prefilling[:n].cpu()
        rows = (decode & (seq_lens >= self.config.dense_boundary)).nonzero().squeeze(1).tolist()
        rows = [r for r in rows if self.policy.num_middle_blocks(int(seq_lens[r])) > 0]
        num_decodes = int(decode.sum())
        if not rows:
            STATS.record_step(num_decodes, 0, 0, 0)
            return meta
        if not self._warned_offload and int(seq_lens[rows].max()) > self.config.offload_boundary:
            self._warned_offload = True
            logger.warning(
                "retrieval plugin: a context above offload_boundary=%d runs sparse on the device (vLLM's pages "
                "cannot move to host memory; DDR offload is a rayapp-engine feature)",
                self.config.offload_boundary,
            )
        tables, Hq, H = cm.block_table_tensor, self.num_heads, self.num_kv_heads
        plan = meta.sparse_rows = plan_sparse_rows(self.policy, Hq, H, rows, qsl, seq_lens, tables, self._scheduler)
        sparse = set(rows)
        dense = [r for r in range(n) if r not in sparse]
        if dense:
            meta.dense_rows = plan_dense_rows(Hq, H, dense, qsl, seq_lens, tables, self._scheduler)
        STATS.record_step(num_decodes - len(rows), len(rows), int(plan.num_selected.sum()), plan.stale.shape[0])
        return meta

    def _scheduler(self, qsl: Tensor, seq_lens: Tensor, heads: int, kv_heads: int) -> Tensor:
        return ops.cpu_attn_get_scheduler_metadata(
            num_reqs=seq_lens.shape[0],
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=self.head_dim,
            seq_lens=seq_lens,
            dtype=self.dtype,
            query_start_loc=qsl,
            causal=True,
            sliding_window_size=self.window_size,
            isa=self.isa,
            enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV,
            kv_cache_dtype=self.kv_cache_dtype,
        )


# (query_start_loc, seq_lens, query heads, KV heads) -> vLLM's CPU scheduler metadata for that batch.
Scheduler = Callable[[Tensor, Tensor, int, int], Tensor]


def plan_sparse_rows(
    policy: RetrievalPolicy, num_heads: int, num_kv_heads: int, rows: list[int], qsl: Tensor, seq_lens: Tensor,
    tables: Tensor, scheduler: Scheduler,
) -> SparseRows:  # fmt: skip
    """The sparse decode rows `rows` of a batch (`qsl`, `seq_lens`, block `tables`), for every layer to attend."""
    p, bs, H = policy, policy.block_size, num_kv_heads
    ppb, ni = p.pages_per_block, p.init_pages
    ctx = [int(seq_lens[r]) for r in rows]
    mids = [p.num_middle_blocks(c) for c in ctx]
    ks = [p.num_selected(m) for m in mids]
    starts = [p.window_start_page(c) for c in ctx]
    totals = [math.ceil(c / bs) for c in ctx]
    K, N, nw = max(ks), max(mids), max(t - s for t, s in zip(totals, starts))
    table = tables[rows].long()  # [Bs, w]
    cols = (ni + torch.arange(N * ppb)).clamp(max=table.shape[1] - 1)
    valid = torch.arange(N)[None] < torch.tensor(mids)[:, None]  # [Bs, N]
    middle = (table[:, cols].view(len(rows), N, ppb) * valid[..., None]).contiguous()
    window_cols = torch.tensor(starts)[:, None] + torch.arange(nw)[None]
    window = table.gather(1, torch.minimum(window_cols, torch.tensor(totals)[:, None] - 1))
    T = ni + K * ppb + nw
    order = torch.arange(T).repeat(len(rows), 1)
    for i, (k, s, t) in enumerate(zip(ks, starts, totals)):
        own = ni + k * ppb  # entries from here on are the window, then padding (its last page again)
        order[i, own:] = ni + K * ppb + torch.arange(T - own).clamp(max=t - s - 1)
    attended = [ni * bs + k * ppb * bs + c - s * bs for k, c, s in zip(ks, ctx, starts)]
    seq_lens_sel = torch.tensor(attended, dtype=torch.int32).repeat_interleave(H)
    qsl_sel = torch.arange(len(rows) * H + 1, dtype=torch.int32)
    flat = middle.view(-1, ppb)
    return SparseRows(
        tokens=qsl[rows].long(),
        middle=middle,
        num_middle=torch.tensor(mids),
        num_selected=torch.tensor(ks),
        init=table[:, None, :ni],
        window=window[:, None],
        order=order[:, None],
        seq_lens=seq_lens_sel,
        query_start_loc=qsl_sel,
        scheduler_metadata=scheduler(qsl_sel, seq_lens_sel, num_heads // H, 1),
        stale=flat[EPOCHS.take_stale(flat, valid.reshape(-1))],
    )


def plan_dense_rows(
    num_heads: int, num_kv_heads: int, rows: list[int], qsl: Tensor, seq_lens: Tensor, tables: Tensor,
    scheduler: Scheduler,
) -> DenseRows:  # fmt: skip
    """The rows `rows` of a batch as a batch of their own, for vLLM's kernel."""
    lens = qsl[1:] - qsl[:-1]
    sub_qsl = torch.zeros(len(rows) + 1, dtype=torch.int32)
    sub_qsl[1:] = torch.cumsum(lens[rows], 0)
    sub_lens = seq_lens[rows].to(torch.int32)
    return DenseRows(
        tokens=torch.cat([torch.arange(int(qsl[r]), int(qsl[r + 1])) for r in rows]),
        query_start_loc=sub_qsl,
        seq_lens=sub_lens,
        block_table=tables[rows],
        scheduler_metadata=scheduler(sub_qsl, sub_lens, num_heads, num_kv_heads),
    )


class RetrievalCPUImpl(CPUAttentionBackendImpl):
    """vLLM's CPU attention, with sparse decode for the rows the builder marked."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.config = retrieval_config()
        # What the flattened-head call cannot carry: such a layer runs stock for every row.
        self.sparse_capable = (
            self.attn_type == AttentionType.DECODER
            and self.alibi_slopes is None
            and self.sinks is None
            and self.sliding_window == -1
            and not self.logits_soft_cap
        )
        # [H, num_blocks, R, D] float32, keyed by a block's last page; head-major, so one gather gives the
        # scorer its [rows, H, N, R, D] operand contiguous (a copy of that size otherwise costs as much as scoring).
        self.reps: Tensor | None = None
        self._dense_layer: bool | None = None
        native.available()  # build (or load) the C++ kernels now, not inside the first sparse step

    def forward(
        self,
        layer,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        kv_cache: Tensor,
        attn_metadata: RetrievalMetadata | None,
        output: Tensor,
        output_scale: Tensor | None = None,
        output_block_scale: Tensor | None = None,
    ) -> Tensor:
        if self._dense_layer is None:
            self._dense_layer = extract_layer_index(layer.layer_name) in self.config.dense_layers
        sparse = getattr(attn_metadata, "sparse_rows", None)
        if sparse is None or not self.sparse_capable or self._dense_layer:
            return super().forward(
                layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale
            )
        num_blocks, H, bs, _ = kv_cache.shape
        key_cache, value_cache = kv_cache.view(num_blocks, H, 2 * bs, -1).chunk(2, dim=2)
        q = query[: attn_metadata.num_actual_tokens].view(-1, self.num_heads, self.head_size)
        out = output[: attn_metadata.num_actual_tokens].view(-1, self.num_heads, self.head_size)
        if attn_metadata.dense_rows is not None:
            self._dense(layer, q, key_cache, value_cache, out, attn_metadata.dense_rows)
        self._sparse(layer, q, kv_cache, key_cache, value_cache, out, sparse)
        return output

    def _dense(self, layer, q: Tensor, key_cache: Tensor, value_cache: Tensor, out: Tensor, rows: DenseRows) -> None:
        q_rows = q.index_select(0, rows.tokens)
        out_rows = torch.empty_like(q_rows)
        self._attend(layer, q_rows, key_cache, value_cache, out_rows, rows.query_start_loc, rows.seq_lens,
                     rows.block_table, rows.scheduler_metadata)  # fmt: skip
        out.index_copy_(0, rows.tokens, out_rows)

    def _sparse(
        self, layer, q: Tensor, kv_cache: Tensor, key_cache: Tensor, value_cache: Tensor, out: Tensor, rows: SparseRows
    ) -> None:
        Bs, H, D = rows.tokens.shape[0], kv_cache.shape[1], self.head_size
        G = self.num_heads // H
        q_rows = q.index_select(0, rows.tokens)  # [Bs, Hq, D]
        blocks = self.select(q_rows, kv_cache, layer.isa, rows)  # [Bs, H, K]
        chosen = rows.middle[torch.arange(Bs)[:, None, None], blocks].view(Bs, H, -1)  # [Bs, H, K * ppb]
        sources = torch.cat([rows.init.expand(Bs, H, -1), chosen, rows.window.expand(Bs, H, -1)], dim=2)
        pages = sources.gather(2, rows.order.expand(Bs, H, -1))  # [Bs, H, T]
        if self.kv_cache_dtype == "auto" and native.handles_vec_pages(q_rows, kv_cache, layer.isa):
            lens = rows.seq_lens.view(Bs, H)[:, 0]
            attended = native.vec_pages_decode_attention(q_rows, kv_cache, pages, lens, self.scale)
            out.index_copy_(0, rows.tokens, attended)
            return
        heads = torch.arange(H)[None, :, None]
        table = (pages * H + heads).view(Bs * H, -1).to(torch.int32)
        out_rows = torch.empty(Bs * H, G, D, dtype=q.dtype)
        self._attend(layer, q_rows.view(Bs * H, G, D), _per_head(key_cache), _per_head(value_cache), out_rows,
                     rows.query_start_loc, rows.seq_lens, table, rows.scheduler_metadata)  # fmt: skip
        out.index_copy_(0, rows.tokens, out_rows.view(Bs, self.num_heads, D))

    def select(self, q: Tensor, kv_cache: Tensor, isa: str, rows: SparseRows) -> Tensor:
        """Each row's top-k middle blocks per KV head, [Bs, H, K] (ascending; entries past a row's k
        repeat block 0 and are not attended), after representing the blocks that need it."""
        num_blocks, H, bs, D2 = kv_cache.shape
        kind, R = self.config.representation, self.config.representative_keys
        if self.reps is None or self.reps.shape[1] < num_blocks:
            self.reps = torch.zeros(H, num_blocks, REPRESENTATIVE_ROWS[kind](R), D2 // 2)
        if rows.stale.shape[0]:
            n, ppb = rows.stale.shape
            keys = cpu_page_keys(kv_cache, isa, rows.stale.reshape(-1)).reshape(n, ppb * bs, H, D2 // 2)
            self.reps[:, rows.stale[:, -1]] = block_representation(keys, kind, R).transpose(0, 1)
        ends = rows.middle[:, :, -1]  # each block's last page, its key in the store
        if native.handles_selection(q, kind):
            return native.select_retrieval_blocks(q, self.reps, ends, rows.num_middle, rows.num_selected)
        _, P, rows_per_block, D = self.reps.shape
        Bs, N = rows.middle.shape[:2]
        # Row h * P + page of the flat store is head h's representation of the block ending at `page`.
        index = (torch.arange(H)[None, :, None] * P + ends[:, None]).view(-1)
        reps = self.reps.view(H * P, -1).index_select(0, index).view(Bs, H, N, rows_per_block, D)
        scores = score_blocks(q, reps.transpose(1, 2), kind)
        blocks, _ = select_topk_blocks(scores, rows.num_middle, rows.num_selected)
        return blocks

    def _attend(self, layer, q, key_cache, value_cache, out, qsl, seq_lens, block_table, scheduler_metadata) -> None:
        ops.cpu_attention_with_kv_cache(
            query=q,
            key_cache=key_cache,
            value_cache=value_cache,
            output=out,
            query_start_loc=qsl,
            seq_lens=seq_lens,
            scale=self.scale,
            causal=True,
            alibi_slopes=None,
            sliding_window=-1,
            block_table=block_table,
            softcap=0.0,
            scheduler_metadata=scheduler_metadata,
            s_aux=None,
            k_scale=layer._k_scale_float,
            v_scale=layer._v_scale_float,
            kv_cache_dtype=self.kv_cache_dtype,
        )


def _per_head(cache: Tensor) -> Tensor:
    """K (or V) of vLLM's CPU cache, `[num_blocks, H, block_size, D]`, as `[num_blocks * H, 1, block_size, D]`:
    the same memory, one page per (page, head)."""
    num_blocks, H, bs, D = cache.shape
    s = cache.stride()
    if s[0] != H * s[1]:
        raise RuntimeError(f"vLLM's CPU KV cache has strides {s}; its heads are not evenly spaced pages")
    return cache.as_strided((num_blocks * H, 1, bs, D), (s[1], s[1], s[2], s[3]), cache.storage_offset())

"""RetrievalKV on vLLM's CPU attention: the backend the `retrieval` plugin registers as `CPU_ATTN`.

The rows of each step are planned, and each layer's call sent, as on every platform (`rayapp.vllm_ext.retrieval_base`):
prefill rows and decode rows below `dense_boundary` run vLLM's own kernel exactly as stock vLLM; the other decode rows
attend their init, window and top-k retrieval blocks per KV head and layer.

Selection and attention run on rayapp's C++ kernels (`rayapp.kernels.native`) where they can: one pass
scores every middle block of a row from the representation store and keeps its top k per KV head, and
the attention reads vLLM's pages in place, in vLLM's `vec` packing, each KV head its own page list.
Selection runs in torch only for the `mean` and `minmax` scorers, or where the kernels are not built.
With vLLM's `amx` packing, a quantized cache or no AVX-512, the attention is vLLM's CPU kernel: each
(sequence, KV head) is passed as a sequence of its own with one KV head, over a block table of only the
pages that head chose. The pages of one head sit at a fixed stride in vLLM's cache
(`[num_blocks, H, block_size, 2 * D]`), so the cache viewed as `[num_blocks * H, 1, block_size, 2 * D]`
is the same memory, and page `p` of head `h` is page `p * H + h` there.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor
from vllm import _custom_ops as ops
from vllm import envs
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
    CPUAttentionMetadataBuilder,
)

from rayapp.kernels import native
from rayapp.kernels.retrieval import score_blocks
from rayapp.vllm_ext import retrieval_plan
from rayapp.vllm_ext.pages import cpu_page_keys
from rayapp.vllm_ext.retrieval_base import RetrievalBuilder, RetrievalImpl
from rayapp.vllm_ext.retrieval_plan import StepPlan, page_table


@dataclass
class DenseRows:
    """The step's rows that run vLLM's kernel, as a batch of their own."""

    tokens: Tensor  # [Td] their query tokens in the step's batch
    query_start_loc: Tensor  # [Bd + 1] int32
    seq_lens: Tensor  # [Bd] int32
    block_table: Tensor  # [Bd, w]
    scheduler_metadata: Tensor


@dataclass
class SparseRows(retrieval_plan.SparseRows):
    """The shared plan of the sparse rows, and vLLM's CPU kernel's view of them: one sequence per (row, KV head)."""

    seq_lens: Tensor  # [Bs * H] int32 tokens each (row, KV head) attends
    query_start_loc: Tensor  # [Bs * H + 1] int32
    scheduler_metadata: Tensor


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


class RetrievalCPUBuilder(RetrievalBuilder, CPUAttentionMetadataBuilder):
    metadata_cls = RetrievalMetadata

    def _attends(self, cm: CommonAttentionMetadata, stock: CPUAttentionMetadata) -> bool:
        return not (self.is_cross_attention or self.is_encoder_only_attention or stock.causal is not True)

    def _split(self, meta: RetrievalMetadata, cm: CommonAttentionMetadata, step: StepPlan, fast_build: bool) -> None:
        Hq, H = self.num_heads, self.num_kv_heads
        meta.sparse_rows = cpu_sparse_rows(step.sparse, Hq, H, self._scheduler)
        if step.dense:
            tables = cm.block_table_tensor
            meta.dense_rows = plan_dense_rows(Hq, H, step.dense, step.query_start_loc, step.seq_lens, tables,
                                              self._scheduler)  # fmt: skip

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


def cpu_sparse_rows(
    plan: retrieval_plan.SparseRows, num_heads: int, num_kv_heads: int, scheduler: Scheduler
) -> SparseRows:
    """A step's planned sparse rows `plan` for every layer to attend on vLLM's CPU kernel."""
    seq_lens = plan.attended.repeat_interleave(num_kv_heads)
    qsl = torch.arange(plan.tokens.shape[0] * num_kv_heads + 1, dtype=torch.int32)
    fields = {f.name: getattr(plan, f.name) for f in dataclasses.fields(plan)}
    return SparseRows(**fields, seq_lens=seq_lens, query_start_loc=qsl,
                      scheduler_metadata=scheduler(qsl, seq_lens, num_heads // num_kv_heads, 1))  # fmt: skip


def plan_dense_rows(
    num_heads: int, num_kv_heads: int, rows: list[int], qsl: Tensor, seq_lens: Tensor, tables: Tensor,
    scheduler: Scheduler,
) -> DenseRows:  # fmt: skip
    """The rows `rows` of a batch as a batch of their own, for vLLM's kernel."""
    batch = retrieval_plan.dense_batch(rows, qsl, seq_lens)
    return DenseRows(
        tokens=batch.tokens,
        query_start_loc=batch.query_start_loc,
        seq_lens=batch.seq_lens,
        block_table=tables[rows],
        scheduler_metadata=scheduler(batch.query_start_loc, batch.seq_lens, num_heads, num_kv_heads),
    )


class RetrievalCPUImpl(RetrievalImpl, CPUAttentionBackendImpl):
    """vLLM's CPU attention, with sparse decode for the rows the builder marked."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        native.available()  # build (or load) the C++ kernels now, not inside the first sparse step

    def _sparse_path_takes_layer(self) -> bool:
        # What the flattened-head call cannot carry.
        return self.sliding_window == -1 and not self.logits_soft_cap

    def _forward_sparse(
        self, layer, query: Tensor, key: Tensor, value: Tensor, kv_cache: Tensor, attn_metadata: RetrievalMetadata,
        output: Tensor, sparse: SparseRows,
    ) -> None:  # fmt: skip
        num_blocks, H, bs, _ = kv_cache.shape
        key_cache, value_cache = kv_cache.view(num_blocks, H, 2 * bs, -1).chunk(2, dim=2)
        q, out = self._tokens(query, attn_metadata), self._tokens(output, attn_metadata)
        if attn_metadata.dense_rows is not None:
            self._dense(layer, q, key_cache, value_cache, out, attn_metadata.dense_rows)
        self._sparse(layer, q, kv_cache, key_cache, value_cache, out, sparse)

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
        pages = page_table(rows, self.select(q_rows, kv_cache, layer.isa, rows))  # [Bs, H, T]
        if self.kv_cache_dtype == "auto" and native.handles_vec_pages(q_rows, kv_cache, layer.isa):
            attended = native.vec_pages_decode_attention(q_rows, kv_cache, pages, rows.attended, self.scale)
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
        num_blocks, H, _, D2 = kv_cache.shape
        self.store.refresh((num_blocks, H, D2 // 2), kv_cache.device, rows.stale,
                           lambda pages: cpu_page_keys(kv_cache, isa, pages))  # fmt: skip
        if native.handles_selection(q, self.config.representation):
            ends = rows.middle[:, :, -1]  # each block's last page, its key in the store
            return native.select_retrieval_blocks(q, self.store.reps, ends, rows.num_middle, rows.num_selected)
        return self.store.select(q, rows, score_blocks)

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

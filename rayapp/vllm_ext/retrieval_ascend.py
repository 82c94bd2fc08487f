"""RetrievalKV on vllm-ascend 0.23's attention (Ascend NPU), with rayapp's Triton kernels through triton-ascend.

vllm-ascend's `NPUPlatform.get_attn_backend_cls` returns fixed classes whatever backend vLLM selected, so the
plugin wraps it (`rayapp.vllm_ext.retrieval.register`) to hand back `RetrievalAscendBackend` where it would
return `AscendAttentionBackend` (plain decoder models; MLA, SFA, DSA, 310P and context parallelism stay stock).
This module imports vllm-ascend's classes by their 0.23 names; the wrapper imports it at backend selection
and, where that fails (another release), leaves vllm-ascend's own backend in place.

Steps that only decode (vllm-ascend's `DecodeOnly` state) and have sparse rows run every row on rayapp's
kernels (`rayapp.kernels.triton`, compiled by triton-ascend): sparse rows over the pages each KV head chose
(`rayapp.vllm_ext.retrieval_plan`), the other rows over all their pages. Any other step (a prefill chunk
among its rows) runs vllm-ascend's own attention for every row: dense, exact. vllm-ascend keeps K and V as
two tensors `[num_blocks, block_size, H, D]`, the kernels' own layout. The planning is on the host per step,
so the builder declares no ACL-graph support: vLLM's graphs stay piecewise around the attention.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor
from vllm_ascend.attention.attention_v1 import (
    AscendAttentionBackend,
    AscendAttentionBackendImpl,
    AscendAttentionMetadataBuilder,
    AscendAttentionState,
    AscendMetadata,
)
from vllm_ascend.attention.utils import enable_cp

from rayapp.vllm_ext.retrieval_base import RetrievalBuilder, RetrievalImpl
from rayapp.vllm_ext.retrieval_plan import FullRows, SparseRows, StepPlan, full_rows
from rayapp.vllm_ext.retrieval_plan import triton_sparse_decode as sparse_decode


@dataclass
class RetrievalAscendMetadata(AscendMetadata):
    """vllm-ascend's metadata for the whole batch, and the rows rayapp's kernels attend (on the device)."""

    sparse_rows: SparseRows | None = None
    full_rows: FullRows | None = None


class RetrievalAscendBackend(AscendAttentionBackend):
    """vllm-ascend's attention backend with sparse retrieval decode for long contexts."""

    @staticmethod
    def get_impl_cls() -> type[AscendAttentionBackendImpl]:
        return AscendAttentionBackend.get_impl_cls() if enable_cp() else RetrievalAscendImpl

    @staticmethod
    def get_builder_cls() -> type[AscendAttentionMetadataBuilder]:
        return AscendAttentionBackend.get_builder_cls() if enable_cp() else RetrievalAscendBuilder


class RetrievalAscendBuilder(RetrievalBuilder, AscendAttentionMetadataBuilder):
    metadata_cls = RetrievalAscendMetadata

    def _attends(self, cm, stock: AscendMetadata) -> bool:
        return stock.attn_state == AscendAttentionState.DecodeOnly and cm.causal is True

    def _split(self, meta: RetrievalAscendMetadata, cm, step: StepPlan, fast_build: bool) -> None:
        meta.sparse_rows = step.sparse.to(self.device)
        if step.dense:
            tables = cm.block_table_tensor[step.dense].cpu()
            rows = full_rows(step.dense, step.query_start_loc, step.seq_lens, tables, self.planner.block_size)
            meta.full_rows = rows.to(self.device)


class RetrievalAscendImpl(RetrievalImpl, AscendAttentionBackendImpl):
    """vllm-ascend's attention, with every row of a sparse decode step on rayapp's kernels."""

    def _sparse_path_takes_layer(self) -> bool:
        return self.sliding_window is None and self.kv_cache_dtype == "auto" and not self.enable_c8_quant

    def _forward_sparse(
        self, layer, query: Tensor, key: Tensor, value: Tensor, kv_cache, attn_metadata: RetrievalAscendMetadata,
        output: Tensor, sparse: SparseRows,
    ) -> None:  # fmt: skip
        if self.key_cache is None:
            self.key_cache, self.value_cache = kv_cache[0], kv_cache[1]
        if key is not None and value is not None:  # this step's K and V into the cache, as vllm-ascend writes them
            self.reshape_and_cache(query, key, value, kv_cache, attn_metadata, output)
        from rayapp.kernels.triton import sparse_decode_attention

        q, out = self._tokens(query, attn_metadata), self._tokens(output, attn_metadata)  # [T, Hq, D]
        key_cache, value_cache = self.key_cache, self.value_cache  # [num_blocks, block_size, H, D] each
        q_rows = q.index_select(0, sparse.tokens)
        out.index_copy_(0, sparse.tokens, sparse_decode(self.store, q_rows, key_cache, value_cache, sparse, self.scale))
        full = attn_metadata.full_rows
        if full is not None:
            q_rows = q.index_select(0, full.tokens)
            pages = full.pages.expand(-1, self.num_kv_heads, -1)
            attended = sparse_decode_attention(q_rows, key_cache, value_cache, pages, full.page_lens, self.scale)
            out.index_copy_(0, full.tokens, attended)

"""RetrievalKV on vLLM's Triton attention (CUDA): the backend the `retrieval` plugin registers as `CUSTOM`.

Built on vLLM 0.32's TRITON_ATTN. Each step's rows are planned, and each layer's call sent, as on every
platform (`rayapp.vllm_ext.retrieval_base`). Prefill rows and dense decode rows run vLLM's own `unified_attention`
as a batch of their own (metadata built by vLLM's Triton builder for just those rows); sparse decode rows run
rayapp's Triton kernels (`rayapp.kernels.triton`): block scoring, `torch.topk`, and decode attention over the
pages each KV head chose, read in place from vLLM's cache through the strided views its own kernels use
(`kv_cache.transpose(1, 2).split(D, -1)`, whatever the engine's `KVCacheLayout`).

The planning reads each step's lengths and block table on the host and sizes its tensors per step, so the
builder declares no CUDA-graph support (`AttentionCGSupport.NEVER`): vLLM then captures piecewise graphs,
the attention running eagerly between them, never whole decode steps.

vLLM picks it with `attention_config={"backend": "CUSTOM"}` (`--attention-backend CUSTOM`); rayapp's vLLM
replicas set that when `sparse.enabled` on `device: cuda`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.attention.backends.triton_attn import (
    TritonAttentionBackend,
    TritonAttentionImpl,
    TritonAttentionMetadata,
    TritonAttentionMetadataBuilder,
)

from rayapp.vllm_ext.retrieval_base import RetrievalBuilder, RetrievalImpl
from rayapp.vllm_ext.retrieval_plan import DenseBatch, SparseRows, StepPlan, dense_batch
from rayapp.vllm_ext.retrieval_plan import triton_sparse_decode as sparse_decode


@dataclass
class RetrievalTritonMetadata(TritonAttentionMetadata):
    """vLLM's Triton metadata for the whole batch (what a stock layer reads), and the sparse split."""

    dense: TritonAttentionMetadata | None = None  # the other rows as a batch of their own
    dense_tokens: Tensor | None = None  # [Td] their query tokens in the step's batch
    sparse_rows: SparseRows | None = None  # on the device


class RetrievalTritonBackend(TritonAttentionBackend):
    """vLLM's TRITON_ATTN with sparse retrieval decode for long contexts."""

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls() -> type[RetrievalTritonImpl]:
        return RetrievalTritonImpl

    @staticmethod
    def get_builder_cls() -> type[RetrievalTritonBuilder]:
        return RetrievalTritonBuilder


class RetrievalTritonBuilder(RetrievalBuilder, TritonAttentionMetadataBuilder):
    metadata_cls = RetrievalTritonMetadata

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        # vLLM's Triton builder turns it on; a draft step's metadata updated in place would keep a stale row plan.
        self.supports_draft_decode_metadata_update = False

    def _attends(self, cm: CommonAttentionMetadata, stock: TritonAttentionMetadata) -> bool:
        # Multimodal prefix ranges and R-SWA prefixes are per request of the whole batch: such steps stay stock.
        return cm.causal is True and cm.mm_req_doc_ranges is None and cm.rswa_prefix_lens is None

    def _split(
        self, meta: RetrievalTritonMetadata, cm: CommonAttentionMetadata, step: StepPlan, fast_build: bool
    ) -> None:
        meta.sparse_rows = step.sparse.to(self.device)
        if step.dense:
            batch = dense_batch(step.dense, step.query_start_loc, step.seq_lens)
            meta.dense = TritonAttentionMetadataBuilder.build(self, 0, sub_batch(cm, batch), fast_build)
            meta.dense_tokens = batch.tokens.to(self.device)


# Per-request fields of vLLM's CommonAttentionMetadata that its builders may read, cut to a sub-batch's rows.
_PER_REQUEST = ("is_prefilling", "seq_lens_cpu_upper_bound", "req_idx", "dcp_local_seq_lens",
                "dcp_local_seq_lens_cpu_upper_bound", "encoder_seq_lens", "encoder_seq_lens_cpu")  # fmt: skip


def _rows(value, rows: list[int]):
    if isinstance(value, torch.Tensor):
        return value[torch.tensor(rows, device=value.device)]
    return None if value is None else value[rows]  # numpy


def sub_batch(cm: CommonAttentionMetadata, batch: DenseBatch) -> CommonAttentionMetadata:
    """`cm` restricted to the rows of `batch`, as vLLM's builders read a batch."""
    lens = batch.query_start_loc[1:] - batch.query_start_loc[:-1]
    return dataclasses.replace(
        cm,
        query_start_loc=batch.query_start_loc.to(cm.query_start_loc.device),
        query_start_loc_cpu=batch.query_start_loc,
        seq_lens=batch.seq_lens.to(cm.seq_lens.device),
        num_reqs=len(batch.rows),
        num_actual_tokens=int(batch.query_start_loc[-1]),
        max_query_len=int(lens.max()),
        max_seq_len=int(batch.seq_lens.max()),
        block_table_tensor=_rows(cm.block_table_tensor, batch.rows),
        slot_mapping=cm.slot_mapping[batch.tokens.to(cm.slot_mapping.device)],
        positions=None,
        logits_indices_padded=None,
        num_logits_indices=None,
        _num_computed_tokens_cache=None,
        _token_to_req_indices_cache=None,
        **{name: _rows(getattr(cm, name), batch.rows) for name in _PER_REQUEST},
    )


class RetrievalTritonImpl(RetrievalImpl, TritonAttentionImpl):
    """vLLM's Triton attention, with sparse decode for the rows the builder marked."""

    def _sparse_path_takes_layer(self) -> bool:
        # What rayapp's sparse kernel does not do.
        return (
            self.sliding_window == (-1, -1)
            and not self.logits_soft_cap
            and self.kv_cache_dtype == "auto"
            and self.chunk_lookback == -1
        )

    def _forward_sparse(
        self, layer, query: Tensor, key: Tensor, value: Tensor, kv_cache: Tensor,
        attn_metadata: RetrievalTritonMetadata, output: Tensor, sparse: SparseRows,
    ) -> None:  # fmt: skip
        q, out = self._tokens(query, attn_metadata), self._tokens(output, attn_metadata)  # [T, Hq, D]
        if attn_metadata.dense is not None:
            tokens = attn_metadata.dense_tokens
            q_rows = q.index_select(0, tokens)
            out_rows = torch.empty_like(q_rows)
            TritonAttentionImpl.forward(self, layer, q_rows, None, None, kv_cache, attn_metadata.dense, out_rows)
            out.index_copy_(0, tokens, out_rows)
        # [num_pages, block_size, H, D] each, strided views of vLLM's cache (its own kernels' split).
        key_cache, value_cache = kv_cache.transpose(1, 2).split(self.head_size, dim=-1)
        q_rows = q.index_select(0, sparse.tokens)
        out.index_copy_(0, sparse.tokens, sparse_decode(self.store, q_rows, key_cache, value_cache, sparse, self.scale))

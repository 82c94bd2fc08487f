"""RetrievalKV on vLLM's Triton attention (CUDA): the backend the `retrieval` plugin registers as `CUSTOM`.

Built on vLLM 0.32's TRITON_ATTN. Each step's rows are planned as on every platform
(`rayapp.vllm_ext.retrieval_plan`). Prefill rows and dense decode rows run vLLM's own `unified_attention`
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
from typing import ClassVar

import torch
from torch import Tensor
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.attention.backend import AttentionCGSupport, AttentionType, CommonAttentionMetadata
from vllm.v1.attention.backends.triton_attn import (
    TritonAttentionBackend,
    TritonAttentionImpl,
    TritonAttentionMetadata,
    TritonAttentionMetadataBuilder,
)

from rayapp.vllm_ext.retrieval import retrieval_config
from rayapp.vllm_ext.retrieval_plan import BlockStore, DenseBatch, RowPlanner, SparseRows, dense_batch
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


class RetrievalTritonBuilder(TritonAttentionMetadataBuilder):
    # Host-side planning per step: piecewise CUDA graphs only.
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER
    supports_draft_decode_metadata_update = False

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.supports_draft_decode_metadata_update = False
        self.planner = RowPlanner(retrieval_config(), self.block_size)

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> RetrievalTritonMetadata:
        cm = common_attn_metadata
        stock = super().build(common_prefix_len, cm, fast_build)
        meta = RetrievalTritonMetadata(**{f.name: getattr(stock, f.name) for f in dataclasses.fields(stock)})
        # Multimodal prefix ranges and R-SWA prefixes are per request of the whole batch: such steps stay stock.
        attends = cm.causal is True and cm.mm_req_doc_ranges is None and cm.rswa_prefix_lens is None
        step = self.planner.plan(cm, self.num_heads_kv, attends)
        if step is None:
            return meta
        meta.sparse_rows = step.sparse.to(self.device)
        if step.dense:
            batch = dense_batch(step.dense, step.query_start_loc, step.seq_lens)
            meta.dense = super().build(0, sub_batch(cm, batch), fast_build)
            meta.dense_tokens = batch.tokens.to(self.device)
        return meta


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


class RetrievalTritonImpl(TritonAttentionImpl):
    """vLLM's Triton attention, with sparse decode for the rows the builder marked."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.config = retrieval_config()
        # What rayapp's sparse kernel does not do: such a layer runs stock for every row.
        self.sparse_capable = (
            self.attn_type == AttentionType.DECODER
            and self.alibi_slopes is None
            and self.sinks is None
            and self.sliding_window == (-1, -1)
            and not self.logits_soft_cap
            and self.kv_cache_dtype == "auto"
            and self.chunk_lookback == -1
        )
        self.store = BlockStore(self.config)
        self._dense_layer: bool | None = None

    def forward(
        self,
        layer,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        kv_cache: Tensor,
        attn_metadata: RetrievalTritonMetadata | None,
        output: Tensor,
        output_scale: Tensor | None = None,
        output_block_scale: Tensor | None = None,
    ) -> Tensor:
        if self._dense_layer is None:
            self._dense_layer = extract_layer_index(layer.layer_name) in self.config.dense_layers
        sparse = getattr(attn_metadata, "sparse_rows", None)
        fused_quant = output_scale is not None or output_block_scale is not None
        if sparse is None or not self.sparse_capable or self._dense_layer or fused_quant:
            return super().forward(
                layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale
            )
        n = attn_metadata.num_actual_tokens
        q = query[:n].view(-1, self.num_heads, self.head_size)  # [T, Hq, D]
        out = output[:n].view(-1, self.num_heads, self.head_size)
        if attn_metadata.dense is not None:
            tokens = attn_metadata.dense_tokens
            q_rows = q.index_select(0, tokens)
            out_rows = torch.empty_like(q_rows)
            super().forward(layer, q_rows, None, None, kv_cache, attn_metadata.dense, out_rows)
            out.index_copy_(0, tokens, out_rows)
        # [num_pages, block_size, H, D] each, strided views of vLLM's cache (its own kernels' split).
        key_cache, value_cache = kv_cache.transpose(1, 2).split(self.head_size, dim=-1)
        q_rows = q.index_select(0, sparse.tokens)
        out.index_copy_(0, sparse.tokens, sparse_decode(self.store, q_rows, key_cache, value_cache, sparse, self.scale))
        return output

"""What every retrieval backend (CPU, CUDA, Ascend) adds alike to its platform's attention classes.

Each backend subclasses its platform's metadata builder and attention impl with these first in line:
`RetrievalBuilder` builds the platform's own metadata for the whole batch (what a stock layer reads) and
plans the step's rows beside it (`rayapp.vllm_ext.retrieval_plan.RowPlanner`); `RetrievalImpl` sends a
layer's call to the platform's stock forward unless the step has sparse rows this layer can run. What
stays in each backend is its platform's own: which steps may go sparse, how its kernels take the rows,
and which layers its sparse path handles.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from typing import ClassVar

from torch import Tensor
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.attention.backend import AttentionCGSupport, AttentionType

from rayapp.vllm_ext.retrieval import retrieval_config
from rayapp.vllm_ext.retrieval_plan import BlockStore, RowPlanner, SparseRows, StepPlan


class RetrievalBuilder(ABC):
    """A platform's metadata builder whose metadata also carries each step's row plan."""

    # The platform's metadata dataclass with the retrieval fields added, every one defaulting to None.
    metadata_cls: ClassVar[type]
    # The planning is on the host and sizes tensors per step: piecewise graphs only. vLLM's builders read
    # the ClassVar, vllm-ascend's override the classmethod.
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec) -> AttentionCGSupport:
        return AttentionCGSupport.NEVER

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        config = retrieval_config().for_context(vllm_config.model_config.max_model_len)
        self.planner = RowPlanner(config, kv_cache_spec.block_size)

    def build(self, common_prefix_len: int, common_attn_metadata, fast_build: bool = False):
        """The platform's metadata of the step, with its sparse rows and the others split out where it has any."""
        cm = common_attn_metadata
        stock = super().build(common_prefix_len, cm, fast_build)
        meta = self.metadata_cls(**{f.name: getattr(stock, f.name) for f in dataclasses.fields(stock)})
        step = self.planner.plan(cm, self._attends(cm, stock))
        if step is not None:
            self._split(meta, cm, step, fast_build)
        return meta

    @abstractmethod
    def _attends(self, cm, stock) -> bool:
        """Whether the rows of the step (vLLM's `CommonAttentionMetadata` `cm`, the platform's metadata `stock`)
        may go sparse: causal decoder layers the platform's sparse path takes. False: every row runs stock."""

    @abstractmethod
    def _split(self, meta, cm, step: StepPlan, fast_build: bool) -> None:
        """Put the `step`'s sparse rows, and its other rows as the platform runs them, into `meta`."""


class RetrievalImpl(ABC):
    """A platform's attention impl that runs the rows its builder planned sparse on the platform's sparse path."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.config = retrieval_config()
        # What no sparse path carries, and what this platform's does not: such a layer runs stock for every row.
        self.sparse_capable = (
            self.attn_type == AttentionType.DECODER
            and self.alibi_slopes is None
            and self.sinks is None
            and self._sparse_path_takes_layer()
        )
        self.store = BlockStore(self.config)
        self._dense_layer: bool | None = None

    def forward(
        self,
        layer,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        kv_cache,
        attn_metadata,
        output: Tensor | None = None,
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
        self._forward_sparse(layer, query, key, value, kv_cache, attn_metadata, output, sparse)
        return output

    def _tokens(self, x: Tensor, attn_metadata) -> Tensor:
        """The step's tokens of `x` (the query or the output) per query head, [T, Hq, D]."""
        return x[: attn_metadata.num_actual_tokens].view(-1, self.num_heads, self.head_size)

    @abstractmethod
    def _sparse_path_takes_layer(self) -> bool:
        """Whether this platform's sparse path runs this (plain decoder) layer: its window, soft cap, cache dtype."""

    @abstractmethod
    def _forward_sparse(
        self, layer, query: Tensor, key: Tensor, value: Tensor, kv_cache, attn_metadata, output: Tensor,
        sparse: SparseRows,
    ) -> None:  # fmt: skip
        """Every row of a step that has `sparse` rows into `output`: those on the sparse path, the others as the
        builder split them."""

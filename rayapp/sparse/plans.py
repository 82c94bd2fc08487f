"""One step's sparse retrieval work, as `SparseKV.plan` lays it out: the decode rows' plan and the prefill
queries kept for scoring, and the hooks that run them inside each layer's attention."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor

from rayapp.engine.attention import HostPages


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


class SparseHooks:
    """Inside each layer of a step with prefill rows: keep the scoring queries (`capture(layer, q)`), and give
    the host pages of resumed histories for their prefill to attend (`host_pages(layer)`)."""

    def __init__(
        self,
        capture: Callable[[int, Tensor], None] | None,
        host_pages: Callable[[int], HostPages] | None,
    ) -> None:
        self.capture, self.host_pages = capture, host_pages

    def store(self, layer: int, k: Tensor, v: Tensor) -> bool:
        return False

    def prefill_queries(self, layer: int, q: Tensor) -> HostPages | None:
        if self.capture is not None:
            self.capture(layer, q)
        return None if self.host_pages is None else self.host_pages(layer)

    def after_prefill(self, layer: int, q: Tensor, k_cache: Tensor, v_cache: Tensor, out: Tensor) -> None:
        pass

"""Each retrieval row's recent queries, per layer: what scores its middle blocks besides the current query."""

from __future__ import annotations

import torch
from torch import Tensor

from rayapp.sparse.plans import QueryCapture


class QueryRing:
    """A ring of the last `window` queries of every row of `SparseKV`'s store, per layer (the prompt's last
    tokens, then each decode step's), and which slots hold one. With `window` 1 the decode query alone scores
    and nothing is kept."""

    def __init__(self, num_layers: int, window: int, num_heads: int, num_kv_heads: int, head_dim: int, device) -> None:
        self.L, self.W, self.Hq, self.Hkv, self.D = num_layers, window, num_heads, num_kv_heads, head_dim
        self.device = device
        self.queries = torch.zeros(self.L, 0, self.W, self.Hq, self.D, device=device)  # [L, rows, W, Hq, D]
        self.valid = torch.zeros(0, self.W, dtype=torch.bool, device=device)  # [rows, W]

    def grow(self, num_rows: int) -> None:
        """Room for `num_rows` rows in all (the store grew)."""
        extra = num_rows - self.valid.shape[0]
        self.queries = torch.cat([self.queries, self.queries.new_zeros(self.L, extra, self.W, self.Hq, self.D)], 1)
        self.valid = torch.cat([self.valid, self.valid.new_zeros(extra, self.W)])

    def clear(self, row: int) -> None:
        """A new sequence takes `row`: none of its slots holds a query yet."""
        self.valid[row] = False

    def plan_capture(self, rows: list[int | None], starts: list[int], num_new: list[int], prompt_lens: list[int]):
        """Which of a step's prefill queries to keep: those of each retrieval prompt's last tokens. `rows[i]` is
        prefill row i's store row (None: a dense sequence, nothing kept)."""
        if self.W == 1:
            return None  # the decode query alone scores
        src, cap_rows, slots = [], [], []
        offset = 0
        for row, start, n, prompt_len in zip(rows, starts, num_new, prompt_lens):
            first = max(start, prompt_len - self.W)
            if row is not None and first < start + n:
                positions = range(first, start + n)
                src.extend(offset + pos - start for pos in positions)
                cap_rows.extend([row] * len(positions))
                slots.extend(pos % self.W for pos in positions)
            offset += n
        if not src:
            return None
        cap = QueryCapture(*(torch.tensor(x, dtype=torch.int64, device=self.device) for x in (src, cap_rows, slots)))
        self.valid[cap.rows, cap.slots] = True
        return cap

    def capture(self, layer: int, q: Tensor, cap: QueryCapture) -> None:
        """Keep the captured prefill queries of `layer`. q: [T, Hq, D], the step's prefill queries."""
        self.queries[layer, cap.rows, cap.slots] = q[cap.src].float()

    def mark(self, rows: Tensor, slots: Tensor) -> None:
        """This step's decode queries of `rows` go to `slots`."""
        self.valid[rows, slots] = True

    def scoring_queries(self, layer: int, q: Tensor, rows: Tensor, slots: Tensor) -> Tensor:
        """q [Bs, Hq, D] (the decode rows `rows`, stored at `slots`) and their recent queries as extra query heads:
        [Bs, Hkv * W * G, D]."""
        if self.W == 1:
            return q
        Bs, G = q.shape[0], self.Hq // self.Hkv
        self.queries[layer, rows, slots] = q.float()
        recent = self.queries[layer, rows]  # [Bs, W, Hq, D]
        # A slot never filled (a prompt's prefix came from cache) repeats the current query instead.
        valid = self.valid[rows][:, :, None, None]
        recent = torch.where(valid, recent, q.float()[:, None])
        return recent.view(Bs, self.W, self.Hkv, G, self.D).transpose(1, 2).reshape(Bs, -1, self.D)

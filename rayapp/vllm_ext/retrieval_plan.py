"""What every retrieval backend (CPU, CUDA, Ascend) plans alike for one vLLM step, on the host.

Per step the builder sorts the batch's rows (`RowPlanner.plan`). Prefill rows, and decode rows whose context
is below `dense_boundary`, are dense. (vLLM's attention metadata carries no prompt length, so a sequence
turns sparse when its context reaches the boundary, not by its prompt alone as in rayapp's engine.) Each
other decode row attends to its first `init_tokens`, its last `local_tokens` and the top `topk_percent` of
the retrieval blocks between, chosen per KV head at every layer by scoring the step's query against block
representations (`BlockStore`), and reads the pages `page_table` lists for it.

Representations are kept per layer beside vLLM's cache, keyed by the physical page that ends the block,
and recomputed when a page of the block was written after them (`PageEpochs`): vLLM's prefix cache hands
a second turn the same pages and so the same representations. The store is float32, `R` rows per page (1 mean,
2 minmax, `representative_keys` multimean): `R / block_size` of a 16-bit KV cache's memory, allocated at the
first sparse step beside what vLLM sized (large pages keep it small: 1/16 at R = 8 and pages of 128).

The planning reads the step's lengths and block table on the host (a device sync on accelerators) and sizes
tensors per step: its backends take piecewise CUDA graphs, never whole-step ones.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from rayapp.config import SparseConfig
from rayapp.kernels.retrieval import REPRESENTATIVE_ROWS, block_representation, select_topk_blocks
from rayapp.sparse.policy import RetrievalPolicy
from rayapp.vllm_ext.retrieval import EPOCHS, STATS

logger = logging.getLogger("rayapp.retrieval")


class _Tensors:
    def to(self, device: torch.device):
        """This plan with its tensors on `device`."""
        return dataclasses.replace(self, **{f.name: getattr(self, f.name).to(device) for f in dataclasses.fields(self)})


@dataclass
class SparseRows(_Tensors):
    """The step's sparse decode rows and what every layer needs to attend them."""

    tokens: Tensor  # [Bs] their query token in the step's batch
    middle: Tensor  # [Bs, N, ppb] pages of each middle retrieval block (0 past a row's num_middle)
    num_middle: Tensor  # [Bs]
    num_selected: Tensor  # [Bs]
    init: Tensor  # [Bs, 1, ni] init pages
    window: Tensor  # [Bs, 1, nw] window pages (the row's last page repeated past its own)
    # [Bs, 1, T] where each entry of a head's page list comes from in cat(init, selected pages, window):
    # a row's own init, then its selected blocks, then its window, then padding.
    order: Tensor
    attended: Tensor  # [Bs] int32 tokens each row attends (every KV head alike)
    page_lens: Tensor  # [Bs, T] int32 tokens of each listed page attended (0 for padding)
    stale: Tensor  # [n, ppb] pages of the middle blocks whose representations this step computes


@dataclass
class FullRows(_Tensors):
    """Decode rows over every page of their context (a backend whose dense decode is rayapp's kernel too)."""

    tokens: Tensor  # [Bd] their query token in the step's batch
    pages: Tensor  # [Bd, 1, n] the row's pages in order (its last repeated past its own)
    page_lens: Tensor  # [Bd, n] int32 tokens of each (0 for padding)


@dataclass
class DenseBatch:
    """Rows of a step as a batch of their own (for a backend's stock kernel)."""

    rows: list[int]
    tokens: Tensor  # [Td] their query tokens in the step's batch
    query_start_loc: Tensor  # [Bd + 1] int32
    seq_lens: Tensor  # [Bd] int32


@dataclass
class StepPlan:
    """A step that has sparse decode rows: the batch's lengths (host), its other rows, and the sparse ones."""

    query_start_loc: Tensor  # [n + 1] int32
    seq_lens: Tensor  # [n] int32
    dense: list[int]
    sparse: SparseRows


def plan_rows(
    policy: RetrievalPolicy, rows: list[int], qsl: Tensor, seq_lens: Tensor, row_tables: Tensor
) -> SparseRows:
    """The sparse decode rows `rows` of a batch (`qsl`, `seq_lens`, and the block tables of those rows `row_tables`;
    host tensors)."""
    p, bs = policy, policy.block_size
    ppb, ni = p.pages_per_block, p.init_pages
    ctx = [int(seq_lens[r]) for r in rows]
    mids = [p.num_middle_blocks(c) for c in ctx]
    ks = [p.num_selected(m) for m in mids]
    starts = [p.window_start_page(c) for c in ctx]
    totals = [math.ceil(c / bs) for c in ctx]
    K, N, nw = max(ks), max(mids), max(t - s for t, s in zip(totals, starts))
    table = row_tables.long()  # [Bs, w]
    cols = (ni + torch.arange(N * ppb)).clamp(max=table.shape[1] - 1)
    valid = torch.arange(N)[None] < torch.tensor(mids)[:, None]  # [Bs, N]
    middle = (table[:, cols].view(len(rows), N, ppb) * valid[..., None]).contiguous()
    window_cols = torch.tensor(starts)[:, None] + torch.arange(nw)[None]
    window = table.gather(1, torch.minimum(window_cols, torch.tensor(totals)[:, None] - 1))
    T = ni + K * ppb + nw
    order = torch.arange(T).repeat(len(rows), 1)
    page_lens = torch.zeros(len(rows), T, dtype=torch.int32)
    for i, (k, s, t, c) in enumerate(zip(ks, starts, totals, ctx)):
        own = ni + k * ppb  # entries from here on are the window, then padding (its last page again)
        order[i, own:] = ni + K * ppb + torch.arange(T - own).clamp(max=t - s - 1)
        page_lens[i, : own + t - s] = bs
        page_lens[i, own + t - s - 1] = c - (t - 1) * bs  # the last page holds the current token
    attended = [ni * bs + k * ppb * bs + c - s * bs for k, c, s in zip(ks, ctx, starts)]
    flat = middle.view(-1, ppb)
    return SparseRows(
        tokens=qsl[rows].long(),
        middle=middle,
        num_middle=torch.tensor(mids),
        num_selected=torch.tensor(ks),
        init=table[:, None, :ni],
        window=window[:, None],
        order=order[:, None],
        attended=torch.tensor(attended, dtype=torch.int32),
        page_lens=page_lens,
        stale=flat[EPOCHS.take_stale(flat, valid.reshape(-1))],
    )


def dense_batch(rows: list[int], qsl: Tensor, seq_lens: Tensor) -> DenseBatch:
    """The rows `rows` of a batch (`qsl`, `seq_lens`, host tensors) as a batch of their own."""
    lens = qsl[1:] - qsl[:-1]
    sub_qsl = torch.zeros(len(rows) + 1, dtype=torch.int32)
    sub_qsl[1:] = torch.cumsum(lens[rows], 0)
    return DenseBatch(
        rows=rows,
        tokens=torch.cat([torch.arange(int(qsl[r]), int(qsl[r + 1])) for r in rows]),
        query_start_loc=sub_qsl,
        seq_lens=seq_lens[rows].to(torch.int32),
    )


def full_rows(rows: list[int], qsl: Tensor, seq_lens: Tensor, tables: Tensor, block_size: int) -> FullRows:
    """Decode rows `rows` of a batch (`qsl`, `seq_lens`, block `tables` of those rows, host) over all their pages."""
    ctx = seq_lens[rows].long()  # [Bd]
    totals = (ctx + block_size - 1) // block_size
    cols = torch.minimum(torch.arange(int(totals.max()))[None], totals[:, None] - 1)
    page_lens = (ctx[:, None] - torch.arange(cols.shape[1])[None] * block_size).clamp(0, block_size)
    return FullRows(qsl[rows].long(), tables.long().gather(1, cols)[:, None], page_lens.to(torch.int32))


class RowPlanner:
    """One metadata builder's settings, and the row planning of each of its steps."""

    def __init__(self, config: SparseConfig, block_size: int) -> None:
        errors = config.vllm_plugin_errors(block_size)
        if errors:
            raise ValueError("invalid retrieval plugin settings: " + "; ".join(errors))
        self.config, self.block_size = config, block_size
        self.policy = RetrievalPolicy(config, block_size)
        self._warned_offload = False
        share = REPRESENTATIVE_ROWS[config.representation](config.representative_keys) / block_size
        if share > 0.1:  # the store is outside what vLLM sized: on a full accelerator this can run out of memory
            logger.warning(
                "retrieval plugin: block representations take %.0f%% of a 16-bit KV cache's memory beside it at "
                "pages of %d tokens; larger pages (block_size 128) or fewer representative_keys shrink them",
                100 * share, block_size,
            )  # fmt: skip

    def plan(self, cm, attends: bool) -> StepPlan | None:
        """Begin the step of vLLM's `CommonAttentionMetadata` `cm` (the pages it writes); where `attends` (causal
        decoder layers), its sparse decode rows. None: every row runs the backend's stock kernel."""
        slots = cm.slot_mapping[: cm.num_actual_tokens]
        tables = cm.block_table_tensor
        pages = torch.unique(slots[slots >= 0] // self.block_size).cpu()
        EPOCHS.begin_step(pages, max(int(tables.max()) + 1 if tables.numel() else 0, 1))
        if not attends:
            return None
        n = cm.num_reqs
        qsl, seq_lens = cm.query_start_loc_cpu[: n + 1], cm.seq_lens[:n].cpu()
        decode = (qsl[1:] - qsl[:-1]) == 1
        prefilling = getattr(cm, "is_prefilling", None)  # not in every vLLM release
        if prefilling is not None:
            decode &= ~prefilling[:n].cpu()
        rows = (decode & (seq_lens >= self.config.dense_boundary)).nonzero().squeeze(1).tolist()
        rows = [r for r in rows if self.policy.num_middle_blocks(int(seq_lens[r])) > 0]
        num_decodes = int(decode.sum())
        if not rows:
            STATS.record_step(num_decodes, 0, 0, 0)
            return None
        if not self._warned_offload and int(seq_lens[rows].max()) > self.config.offload_boundary:
            self._warned_offload = True
            logger.warning(
                "retrieval plugin: a context above offload_boundary=%d runs sparse on the device (vLLM's pages "
                "cannot move to host memory; DDR offload is a rayapp-engine feature)",
                self.config.offload_boundary,
            )
        sparse = plan_rows(self.policy, rows, qsl, seq_lens, tables[rows].cpu())
        chosen = set(rows)
        STATS.record_step(num_decodes - len(rows), len(rows), int(sparse.num_selected.sum()), sparse.stale.shape[0])
        return StepPlan(qsl, seq_lens, [r for r in range(n) if r not in chosen], sparse)


class BlockStore:
    """One layer's block representations, `reps` `[H, num_pages, R, D]` float32 on the cache's device, keyed by
    the page that ends each block. Head-major, so one gather gives the scorer its `[rows, H, N, R, D]` operand
    contiguous (a copy of that size otherwise costs as much as scoring)."""

    def __init__(self, config: SparseConfig) -> None:
        self.kind, self.representative_keys = config.representation, config.representative_keys
        self.reps: Tensor | None = None

    def refresh(self, cache_shape: tuple[int, int, int], device: torch.device, stale: Tensor, keys: Callable) -> None:
        """Compute the representations of the `stale` blocks (`[n, ppb]` pages) from `keys(pages)`, the keys of
        pages `[n * ppb]` as `[n * ppb, block_size, H, D]`, for a cache of `(num_pages, H, D)` on `device`."""
        num_pages, num_kv_heads, head_dim = cache_shape
        rows = REPRESENTATIVE_ROWS[self.kind](self.representative_keys)
        if self.reps is None or self.reps.shape[1] < num_pages:
            self.reps = torch.zeros(num_kv_heads, num_pages, rows, head_dim, device=device)
            logger.info(
                "retrieval plugin: block representations of one layer take %.2f GiB (%d pages)",
                self.reps.numel() * 4 / 2**30, num_pages,
            )  # fmt: skip
        if stale.shape[0]:
            n, ppb = stale.shape
            block_keys = keys(stale.reshape(-1))  # [n * ppb, bs, H, D]
            block_keys = block_keys.reshape(n, ppb * block_keys.shape[1], num_kv_heads, head_dim)
            reps = block_representation(block_keys, self.kind, self.representative_keys)  # [n, H, R, D]
            self.reps[:, stale[:, -1]] = reps.transpose(0, 1).to(self.reps.device)

    def select(self, q: Tensor, rows: SparseRows, score: Callable[[Tensor, Tensor, str], Tensor]) -> Tensor:
        """Each row's top-k middle blocks per KV head, [Bs, H, K] (ascending; entries past a row's k repeat
        block 0 and are not attended), scored by `score` (`rayapp.kernels.retrieval.score_blocks`' contract)."""
        H, P, rows_per_block, D = self.reps.shape
        Bs, N = rows.middle.shape[:2]
        ends = rows.middle[:, :, -1]  # each block's last page, its key in the store
        # Row h * P + page of the flat store is head h's representation of the block ending at `page`.
        index = (torch.arange(H, device=ends.device)[None, :, None] * P + ends[:, None]).view(-1)
        reps = self.reps.view(H * P, -1).index_select(0, index).view(Bs, H, N, rows_per_block, D)
        scores = score(q, reps.transpose(1, 2), self.kind)
        blocks, _ = select_topk_blocks(scores, rows.num_middle, rows.num_selected)
        return blocks


def page_table(rows: SparseRows, blocks: Tensor) -> Tensor:
    """Each (row, KV head)'s pages, [Bs, H, T]: its init, the pages of its selected `blocks` ([Bs, H, K]), its
    window, then padding; `rows.page_lens` says how many tokens of each are attended."""
    Bs, H, _ = blocks.shape
    chosen = rows.middle[torch.arange(Bs, device=blocks.device)[:, None, None], blocks].view(Bs, H, -1)
    sources = torch.cat([rows.init.expand(Bs, H, -1), chosen, rows.window.expand(Bs, H, -1)], dim=2)
    return sources.gather(2, rows.order.expand(Bs, H, -1))


def triton_sparse_decode(
    store: BlockStore, q: Tensor, key_cache: Tensor, value_cache: Tensor, rows: SparseRows, scale: float
) -> Tensor:
    """Sparse decode of `rows` (on the cache's device) with rayapp's Triton kernels: q [Bs, Hq, D]; the caches
    `[num_pages, block_size, H, D]` views of any strides. Returns [Bs, Hq, D]."""
    from rayapp.kernels.triton import score_blocks, sparse_decode_attention

    num_pages, _, H, D = key_cache.shape
    store.refresh((num_pages, H, D), key_cache.device, rows.stale, lambda pages: key_cache.index_select(0, pages))
    pages = page_table(rows, store.select(q, rows, score_blocks))
    return sparse_decode_attention(q, key_cache, value_cache, pages, rows.page_lens, scale)

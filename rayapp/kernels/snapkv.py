"""Layer-wise KV compression (SnapKV / PyramidKV) kernels: token scores, token selection, and
per-layer budgets.

Layout as in :mod:`rayapp.kernels.attention`: caches ``[P, bs, Hkv, D]``; token ``t`` of a
sequence lives in page ``page_table[t // bs]`` at offset ``t % bs``; query head ``h`` reads KV
head ``h // G`` with ``G = Hq // Hkv``.

The score of a key is the attention the prompt's last ``W`` queries (the observation window) pay
it, summed over the query heads of its KV head, then max-pooled along the keys so that a chosen
token brings its neighbours. The prefill kernel already returns each row's log-sum-exp, so the
probabilities of the window rows are rebuilt as ``exp(q.k * scale - lse)`` without a second
softmax over the prompt: O(W x N) work, not O(N^2). :func:`ref_snapkv_scores` at the bottom is the
O(N^2) explicit-softmax twin the tests compare with.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

# Window rows per chunk keep the float32 scores [Hq, rows, N] under this, as the prefill kernel does.
_MAX_SCORE_BYTES = 256 * 1024**2
# PyramidKV's beta: the top compressed layer keeps 1/beta of the average budget beyond the window,
# the first compressed layer the rest of twice the average (the paper's default, 20).
_PYRAMID_BETA = 20


def snapkv_scores(
    q_window: Tensor,
    k_cache: Tensor,
    page_table: Tensor,
    num_tokens: int,
    lse_window: Tensor,
    scale: float,
    kernel_size: int,
) -> Tensor:
    """Score every prompt token of one sequence, for one layer, by the attention of its last W queries.

    q_window: [W, Hq, D], the queries of prompt positions ``num_tokens - W .. num_tokens - 1``;
    k_cache: [P, bs, Hkv, D], one layer's cache (any float dtype), holding the prompt's keys;
    page_table: [>= ceil(num_tokens / bs)] the sequence's pages in token order (extra entries are
    ignored); lse_window: [W, Hq], the log-sum-exp rows :func:`paged_prefill_attention` returned
    for those queries (``return_lse=True``, same ``scale``). Window query ``i`` sees keys up to its
    own position, so key ``j`` gets ``sum_{i, g} exp(q_{i,g} . k_j * scale - lse_{i,g})`` over the
    window rows that see it and the G query heads of its KV head.

    The sums are then max-pooled along the keys (window ``kernel_size``, odd, stride 1, padding
    ``kernel_size // 2``, so the length stays N; 1 turns pooling off). The pool runs over all N
    keys, window included (SnapKV's code pools only the keys before the window), so the
    ``kernel_size // 2`` tokens just before the window can inherit its scores. Returns
    [Hkv, num_tokens] float32. A prompt shorter than the observation window passes all its ``num_tokens`` queries
    (W <= num_tokens).
    """
    W, Hq, D = q_window.shape
    _, bs, Hkv, _ = k_cache.shape
    if Hq % Hkv:
        raise ValueError(f"{Hq} query heads do not divide into {Hkv} KV heads")
    group = Hq // Hkv
    if num_tokens < 1:
        raise ValueError(f"num_tokens is {num_tokens}; a prompt to score has at least one token")
    if not 1 <= W <= num_tokens:
        raise ValueError(
            f"q_window holds {W} queries for a {num_tokens}-token prompt; pass the last min(window, num_tokens) "
            "prompt queries (at least one)"
        )
    if lse_window.shape != (W, Hq):
        raise ValueError(f"lse_window is {tuple(lse_window.shape)}, expected {(W, Hq)} to match q_window")
    if kernel_size < 1 or kernel_size % 2 == 0:
        raise ValueError(f"kernel_size is {kernel_size}; use an odd size >= 1 (1: no pooling)")
    num_pages = -(-num_tokens // bs)
    if page_table.dim() != 1 or page_table.shape[0] < num_pages:
        raise ValueError(
            f"page_table is {tuple(page_table.shape)}; one sequence's pages, at least {num_pages} for {num_tokens} "
            f"tokens in pages of {bs}"
        )
    # Only this sequence's pages of this layer are read. k_t: [Hkv, D, N] float32
    keys = k_cache.index_select(0, page_table[:num_pages].to(torch.long)).view(-1, Hkv, D)[:num_tokens]
    k_t = keys.permute(1, 2, 0).to(torch.float32, memory_format=torch.contiguous_format)
    # Fold the G query heads of a KV head into its rows, ordered (g, i). q_rows: [Hkv, G, W, D]
    q_rows = (q_window.float() * scale).view(W, Hkv, group, D).permute(1, 2, 0, 3)
    # lse_rows: [Hkv, G, W, 1]
    lse_rows = lse_window.float().view(W, Hkv, group).permute(1, 2, 0)[..., None]
    # totals: [Hkv, N], the attention each key receives from the window
    totals = torch.zeros(Hkv, num_tokens, dtype=torch.float32, device=q_window.device)
    first = num_tokens - W  # position of the first window query
    rows = max(1, min(W, _MAX_SCORE_BYTES // (4 * Hq * num_tokens)))
    for r0 in range(0, W, rows):
        r1 = min(r0 + rows, W)
        m, kv = r1 - r0, first + r1
        # Keys after the chunk's last query are hidden from all its rows: leave them out.
        # scores: [Hkv, G, m, kv]
        scores = torch.matmul(q_rows[:, :, r0:r1].reshape(Hkv, group * m, D), k_t[:, :, :kv]).view(Hkv, group, m, kv)
        # Only the last m keys can lie after a chunk row; future: [m, m], True above the diagonal
        future = torch.ones(m, m, dtype=torch.bool, device=q_window.device).triu_(1)
        scores[..., first + r0 :].masked_fill_(future, float("-inf"))
        probs = scores.sub_(lse_rows[:, :, r0:r1]).exp_()  # [Hkv, G, m, kv]
        totals[:, :kv] += probs.sum(dim=(1, 2))
    if kernel_size == 1:
        return totals
    # max_pool1d pads with -inf, so the edges pool over the keys that exist. [Hkv, 1, N] -> [Hkv, N]
    return F.max_pool1d(totals[:, None], kernel_size, stride=1, padding=kernel_size // 2)[:, 0]


def select_tokens(scores: Tensor, budget: int, window: int) -> Tensor:
    """Pick, per KV head, the tokens a compressed layer keeps.

    scores: [Hkv, N] (from :func:`snapkv_scores`). The last ``window`` tokens are always kept;
    the rest of the budget goes to the highest-scoring earlier tokens (ties broken by
    ``torch.topk``). Returns int64 indices [Hkv, min(budget, N)], ascending per head, ready for
    compaction in positional order. A budget >= N keeps every token.
    """
    Hkv, N = scores.shape
    if window < 0:
        raise ValueError(f"window is {window}; use 0 or more tokens")
    if budget < window:
        raise ValueError(f"budget {budget} cannot hold the {window}-token observation window; raise the budget")
    if budget >= N:
        return torch.arange(N, device=scores.device).expand(Hkv, N).clone()
    prefix = N - window
    # top: [Hkv, budget - window], indices into the tokens before the window
    top = torch.topk(scores[:, :prefix], budget - window, dim=-1, sorted=False).indices
    # recent: [Hkv, window]
    recent = torch.arange(prefix, N, device=scores.device).expand(Hkv, window)
    return torch.cat([top, recent], dim=-1).sort(dim=-1).values


def pyramid_budgets(
    num_layers: int,
    full_layers: int,
    total_tokens: int,
    compression_ratio: float,
    window: int,
    schedule: Literal["pyramid", "uniform"],
) -> list[int]:
    """Token budget of every layer for a prompt of ``total_tokens`` tokens.

    The first ``full_layers`` layers keep all ``total_tokens``. The other ``n = num_layers -
    full_layers`` compressed layers share ``n * total_tokens / compression_ratio`` tokens:
    ``compression_ratio`` is how many times smaller their cache is on average (4: a quarter).
    ``0`` means no compression, as does ``1``: every layer keeps every token. A ratio between 0
    and 1 is rejected, since it reads as a fraction kept (pass its inverse).

    - ``"uniform"`` (SnapKV): every compressed layer gets the average (budgets differ by at most
      one token from rounding).
    - ``"pyramid"`` (PyramidKV): an arithmetic sequence decreasing with depth, the top layer
      smallest. As in PyramidKV, the top layer keeps ``1/20`` of the average beyond the window
      and the first compressed layer the rest of twice that, narrowed where that would exceed
      ``total_tokens``.

    Every compressed budget is at least ``min(window, total_tokens)`` and at most
    ``total_tokens``; the budgets sum to ``round(n * total_tokens / compression_ratio)`` exactly,
    unless the average is below the window, where each layer keeps just the window.
    """
    if num_layers < 1:
        raise ValueError(f"num_layers is {num_layers}; a model has at least one layer")
    if not 0 <= full_layers <= num_layers:
        raise ValueError(f"full_layers is {full_layers}; use 0 to {num_layers} (the model's layer count)")
    if total_tokens < 0:
        raise ValueError(f"total_tokens is {total_tokens}; use the prompt length (>= 0)")
    if window < 0:
        raise ValueError(f"window is {window}; use 0 or more tokens")
    if schedule not in ("pyramid", "uniform"):
        raise ValueError(f"schedule is {schedule!r}; use 'pyramid' (PyramidKV) or 'uniform' (SnapKV)")
    if compression_ratio < 0:
        raise ValueError(f"compression_ratio is {compression_ratio}; use 0 (no compression) or a ratio >= 1")
    if 0 < compression_ratio < 1:
        # A fraction kept, not a ratio: guessing would silently keep everything or too little.
        raise ValueError(
            f"compression_ratio is {compression_ratio}; it is how many times smaller compressed layers are, so to "
            f"keep that fraction pass {1 / compression_ratio:.3g}; use 0 or 1 for no compression"
        )
    n = num_layers - full_layers
    full = [total_tokens] * full_layers
    if compression_ratio <= 1 or n == 0:
        return full + [total_tokens] * n
    floor = min(window, total_tokens)
    average = total_tokens / compression_ratio
    if average <= floor:
        return full + [floor] * n
    # Budgets beyond the window: mean `extra`, spread symmetrically by +-half around it.
    extra = average - floor
    if schedule == "pyramid" and n > 1:
        half = min(extra * (1 - 1 / _PYRAMID_BETA), total_tokens - floor - extra)
    else:
        half = 0.0
    step = 2 * half / (n - 1) if n > 1 else 0.0
    exact = [floor + extra + half - i * step for i in range(n)]
    return full + _round_keeping_sum(exact)


def _round_keeping_sum(values: list[float]) -> list[int]:
    """Round non-negative values to integers summing to round(sum(values)), largest remainders up.

    Keeps a non-increasing sequence non-increasing: two values with the same integer part have
    their remainders in the same order, and equal remainders round up the earlier one first.
    """
    floors = [int(v) for v in values]
    missing = round(sum(values)) - sum(floors)
    by_remainder = sorted(range(len(values)), key=lambda i: floors[i] - values[i])
    for i in by_remainder[:missing]:
        floors[i] += 1
    return floors


# --- reference: explicit softmax over the whole prompt ---------------------------------------


def ref_snapkv_scores(
    q_prompt: Tensor, k_cache: Tensor, page_table: Tensor, window: int, scale: float, kernel_size: int
) -> Tensor:
    """Reference for :func:`snapkv_scores`: O(N^2) causal softmax over all prompt queries.

    q_prompt: [N, Hq, D], the queries of every prompt position; keys are gathered token by token
    through page_table. Takes the last ``window`` rows of the softmax, sums them and the G query
    heads of each KV head, and max-pools with explicit ``-inf`` padding. Returns [Hkv, N] float32.
    """
    N, Hq, D = q_prompt.shape
    bs, Hkv = k_cache.shape[1], k_cache.shape[2]
    # keys: [N, Hkv, D] float32
    keys = torch.stack([k_cache[int(page_table[t // bs]), t % bs] for t in range(N)]).float()
    # k_h: [Hq, N, D], each query head's own KV head (repeat_kv order)
    k_h = keys[:, torch.arange(Hq) // (Hq // Hkv)].transpose(0, 1)
    logits = torch.einsum("qhd,hkd->hqk", q_prompt.float(), k_h) * scale  # [Hq, N, N]
    causal = torch.ones(N, N, dtype=torch.bool).tril()
    probs = torch.softmax(logits.masked_fill(~causal, float("-inf")), dim=-1)  # [Hq, N, N]
    totals = probs[:, N - window :].sum(dim=1).view(Hkv, Hq // Hkv, N).sum(dim=1)  # [Hkv, N]
    pad = kernel_size // 2
    padded = F.pad(totals, (pad, pad), value=float("-inf"))  # [Hkv, N + 2 * pad]
    return padded.unfold(-1, kernel_size, 1).amax(dim=-1)  # [Hkv, N]

"""Sparse retrieval attention (RetrievalKV) kernels: block summaries, block scores, top-k, and
decode attention over a per-KV-head list of pages.

Layout as in :mod:`rayapp.kernels.attention`: caches ``[P, bs, Hkv, D]``; query head ``h`` reads
KV head ``h // G`` with ``G = Hq // Hkv``. A retrieval block is ``rb`` consecutive tokens (whole
pages). Every kernel works on the whole batch at once; each has a ``ref_*`` twin at the bottom
(loops, float32) that the tests compare it with.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

# Rows of the representation tensor each kind keeps per block and KV head.
REPRESENTATIVE_ROWS = {"mean": lambda r: 1, "minmax": lambda r: 2, "multimean": lambda r: r}


def block_representation(keys: Tensor, kind: str, representative_keys: int = 1) -> Tensor:
    """Summarize full retrieval blocks for scoring.

    keys: [N, rb, Hkv, D] (N blocks). Returns reps [N, Hkv, R, D] float32, where
    - ``mean``: R = 1, the mean key;
    - ``minmax``: R = 2, the per-channel minimum then maximum (Quest's bounds);
    - ``multimean``: R = representative_keys, the mean key of each of R equal slices of the block.
    """
    N, rb, Hkv, D = keys.shape
    k = keys.float()
    if kind == "mean":
        reps = k.mean(dim=1, keepdim=True)  # [N, 1, Hkv, D]
    elif kind == "minmax":
        reps = torch.stack([k.amin(dim=1), k.amax(dim=1)], dim=1)  # [N, 2, Hkv, D]
    elif kind == "multimean":
        R = representative_keys
        reps = k.view(N, R, rb // R, Hkv, D).mean(dim=2)  # [N, R, Hkv, D]
    else:
        raise ValueError(f"unknown representation {kind!r}")
    return reps.transpose(1, 2).contiguous()


def score_blocks(q: Tensor, reps: Tensor, kind: str) -> Tensor:
    """Score every block for every KV head from the current queries.

    q: [B, Hq, D]; reps: [B, N, Hkv, R, D] (from :func:`block_representation`). Returns
    scores [B, Hkv, N] float32 (higher: more relevant). ``mean`` and ``minmax`` average the
    score over the G query heads of a KV head (the plain scorers); ``multimean`` takes the best
    representative key and the best query head, so one head that needs a block keeps it.
    """
    B, Hq, D = q.shape
    _, N, Hkv, R, _ = reps.shape
    G = Hq // Hkv
    qg = q.float().view(B, Hkv, G, D)
    if kind == "minmax":
        # Upper bound of q.k over the box [min, max]: per channel the larger of q*min and q*max.
        lo, hi = reps[:, :, :, 0], reps[:, :, :, 1]  # [B, N, Hkv, D]
        # bound: [B, Hkv, G, N]
        prod_lo = torch.einsum("bhgd,bnhd->bhgnd", qg, lo)
        prod_hi = torch.einsum("bhgd,bnhd->bhgnd", qg, hi)
        return torch.maximum(prod_lo, prod_hi).sum(-1).mean(dim=2)
    # dots: [B, Hkv, G, N, R]
    dots = torch.einsum("bhgd,bnhrd->bhgnr", qg, reps)
    if kind == "mean":
        return dots[..., 0].mean(dim=2)
    if kind == "multimean":
        return dots.amax(dim=-1).amax(dim=2)
    raise ValueError(f"unknown representation {kind!r}")


def oracle_block_scores(q: Tensor, k_cache: Tensor, block_pages: Tensor, num_blocks: Tensor, scale: float) -> Tensor:
    """The attention mass each middle block gets (softmax over the middle's keys, summed over a
    KV head's query heads). Reads every middle key: a yardstick for scorers, not a fast path.

    q: [B, Hq, D]; block_pages: [B, N, ppb] page ids of each block; num_blocks: [B] valid blocks.
    Returns [B, Hkv, N] float32; invalid blocks score -inf.
    """
    B, Hq, D = q.shape
    _, bs, Hkv, _ = k_cache.shape
    _, N, ppb = block_pages.shape
    G = Hq // Hkv
    # k: [B, N * ppb * bs, Hkv, D]
    k = k_cache.index_select(0, block_pages.reshape(-1)).view(B, N * ppb * bs, Hkv, D).float()
    # logits: [B, Hkv, G, N * ppb * bs]
    logits = torch.einsum("bhgd,bthd->bhgt", q.float().view(B, Hkv, G, D), k) * scale
    valid = torch.arange(N, device=q.device) < num_blocks[:, None]  # [B, N]
    token_valid = valid.repeat_interleave(ppb * bs, dim=1)  # [B, N * ppb * bs]
    logits.masked_fill_(~token_valid[:, None, None], float("-inf"))
    mass = logits.softmax(dim=-1).view(B, Hkv, G, N, ppb * bs).sum(-1).sum(2)
    return mass.masked_fill(~valid[:, None], float("-inf"))


def select_topk_blocks(scores: Tensor, num_blocks: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
    """The ``k[b]`` best of each row's first ``num_blocks[b]`` blocks, per KV head.

    scores: [B, Hkv, N]; num_blocks, k: [B] with k <= num_blocks. Returns blocks [B, Hkv, K]
    int64 (K = max k; ascending within each valid prefix, so pages are read in order) and
    valid [B, K] bool (entry j of row b is a selection iff j < k[b]; invalid entries hold 0).
    """
    B, Hkv, N = scores.shape
    K = int(k.max()) if B else 0
    if K == 0:
        return torch.zeros(B, Hkv, 0, dtype=torch.int64, device=scores.device), torch.zeros(
            B, 0, dtype=torch.bool, device=scores.device
        )
    in_range = torch.arange(N, device=scores.device) < num_blocks[:, None]  # [B, N]
    masked = scores.masked_fill(~in_range[:, None], float("-inf"))
    top = masked.topk(K, dim=-1).indices  # [B, Hkv, K], best first
    valid = torch.arange(K, device=scores.device) < k[:, None]  # [B, K]
    # Invalid entries sort last, then are zeroed.
    top = top.masked_fill(~valid[:, None], N).sort(dim=-1).values
    return top.masked_fill(~valid[:, None], 0), valid


def sparse_decode_attention(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, page_table: Tensor, page_lens: Tensor, scale: float
) -> Tensor:
    """One query per sequence over a chosen list of pages, chosen per KV head.

    q: [B, Hq, D]; page_table: [B, Hkv, n] page ids (KV head h reads its own list);
    page_lens: [B, n] valid tokens in each listed page (bs for a full page, fewer for the
    sequence's last page, 0 for padding), the same for every head. Returns [B, Hq, D] in q.dtype.
    Each listed page is read once, and only the KV head that chose it.
    """
    B, Hq, D = q.shape
    _, bs, Hkv, _ = k_cache.shape
    n = page_table.shape[2]
    G = Hq // Hkv
    heads = torch.arange(Hkv, device=q.device)[None, :, None]  # [1, Hkv, 1]
    # k, v: [B, Hkv, n * bs, D]; the head-major view lets one index pick (page, head) pairs.
    k = k_cache.permute(2, 0, 1, 3)[heads, page_table].view(B, Hkv, n * bs, D)
    v = v_cache.permute(2, 0, 1, 3)[heads, page_table].view(B, Hkv, n * bs, D)
    # mask: [B, 1, 1, n * bs]
    mask = (torch.arange(bs, device=q.device) < page_lens[..., None]).view(B, 1, 1, n * bs)
    out = F.scaled_dot_product_attention(q.view(B, Hkv, G, D), k, v, attn_mask=mask, scale=scale)
    return out.reshape(B, Hq, D)


# --- references: loops, float32 ---------------------------------------------------------------


def ref_block_representation(keys: Tensor, kind: str, representative_keys: int = 1) -> Tensor:
    """Reference for :func:`block_representation`, one block and head at a time."""
    N, rb, Hkv, D = keys.shape
    rows = REPRESENTATIVE_ROWS[kind](representative_keys)
    out = torch.empty(N, Hkv, rows, D)
    for n in range(N):
        for h in range(Hkv):
            k = keys[n, :, h].float()
            if kind == "mean":
                out[n, h, 0] = k.sum(0) / rb
            elif kind == "minmax":
                out[n, h, 0], out[n, h, 1] = k.min(0).values, k.max(0).values
            else:
                part = rb // rows
                for r in range(rows):
                    out[n, h, r] = k[r * part : (r + 1) * part].sum(0) / part
    return out


def ref_score_blocks(q: Tensor, reps: Tensor, kind: str) -> Tensor:
    """Reference for :func:`score_blocks`, one block and query head at a time."""
    B, Hq, D = q.shape
    _, N, Hkv, R, _ = reps.shape
    G = Hq // Hkv
    out = torch.empty(B, Hkv, N)
    for b in range(B):
        for h in range(Hkv):
            for n in range(N):
                per_head = []
                for g in range(G):
                    qh = q[b, h * G + g].float()
                    rep = reps[b, n, h].float()
                    if kind == "minmax":
                        per_head.append(sum(max(qh[d] * rep[0, d], qh[d] * rep[1, d]) for d in range(D)))
                    else:
                        per_head.append(max(float(qh @ rep[r]) for r in range(R)))
                t = torch.tensor(per_head, dtype=torch.float32)
                out[b, h, n] = t.max() if kind == "multimean" else t.mean()
    return out


def ref_select_topk_blocks(scores: Tensor, num_blocks: Tensor, k: Tensor) -> list[list[set[int]]]:
    """Reference for :func:`select_topk_blocks`: per row and head, the set of chosen blocks."""
    out = []
    for b in range(scores.shape[0]):
        n, kb = int(num_blocks[b]), int(k[b])
        out.append(
            [set(sorted(range(n), key=lambda i, s=scores[b, h]: -float(s[i]))[:kb]) for h in range(scores.shape[1])]
        )
    return out


def ref_sparse_decode_attention(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, page_table: Tensor, page_lens: Tensor, scale: float
) -> Tensor:
    """Reference for :func:`sparse_decode_attention`, one sequence and query head at a time."""
    B, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    G = Hq // Hkv
    out = torch.empty_like(q)
    for b in range(B):
        for hq in range(Hq):
            h = hq // G
            ks, vs = [], []
            for j in range(page_table.shape[2]):
                length = int(page_lens[b, j])
                ks.append(k_cache[int(page_table[b, h, j]), :length, h].float())
                vs.append(v_cache[int(page_table[b, h, j]), :length, h].float())
            k, v = torch.cat(ks), torch.cat(vs)
            w = torch.softmax((k @ q[b, hq].float()) * scale, dim=0)
            out[b, hq] = (w @ v).to(q.dtype)
    return out

"""Attention over a paged KV cache, in PyTorch (and C++ for CPU decode).

Cache layout, per layer: ``k_cache``, ``v_cache`` are ``[P, bs, Hkv, D]``. Token ``t`` of a
sequence lives in page ``page_table[t // bs]`` at offset ``t % bs``; its slot is
``page * bs + offset``. Query head ``h`` reads KV head ``h // (Hq // Hkv)`` (Hugging Face's
``repeat_kv`` order).

Each fast kernel has a ``ref_*`` twin below: loops over sequences and tokens, float32, explicit
softmax. The tests compare the two.
"""

import torch
import torch.nn.functional as F
from torch import Tensor

from rayapp.kernels import native

# Prefill runs in chunks of query rows; each chunk leaves out the keys after its last query, and
# its float32 scores [Hq, rows, keys] stay under _MAX_SCORE_BYTES wherever they are materialized
# (the lse path; SDPA's math fallback). Row counts measured on 2 CPU cores, 2048 new tokens:
# - SDPA: 256 rows ran 270 ms over 8192 keys (64 rows: 305) and 43 ms for a fresh prompt, where
#   one masked call took 75 ms (the flash kernel computes masked blocks; is_causal: 41 ms).
# - lse path: 64 rows ran 400 ms over 8192 keys and 53 ms fresh; 256 rows 560 and 69 ms.
_SDPA_ROWS = 256
_EXPLICIT_ROWS = 64
_MAX_SCORE_BYTES = 256 * 1024**2


def store_kv(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    """Write the K/V of ``T`` new tokens into their cache slots, in place.

    k, v: [T, Hkv, D]; k_cache, v_cache: [P, bs, Hkv, D] (contiguous); slot_mapping: [T] int64.
    """
    # view, not reshape: reshape of a non-contiguous cache would copy and drop the writes.
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def paged_decode_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    page_table: Tensor,
    context_lens: Tensor,
    scale: float,
) -> Tensor:
    """One query per sequence attends to all of that sequence's cached tokens.

    q: [B, Hq, D]; page_table: [B, max_pages] (padding entries hold any valid page id);
    context_lens: [B], each >= 1, counting the current token whose K/V is already stored.
    Returns [B, Hq, D] in q.dtype. Work grows with ``page_table.shape[1]``, not with the longest
    context, so pass a table only as wide as the batch needs. Masked slots (past a context, or in
    padding pages) are still read and must hold finite values: allocate caches with zeros, since a
    NaN there, even masked, turns the whole output row NaN.

    On CPU this runs rayapp's C++ kernel where it is built (`rayapp.kernels.native`: it reads only
    each sequence's own tokens, in place), elsewhere :func:`sdpa_paged_decode_attention`.
    """
    _gqa_group(q.shape[1], k_cache.shape[2])
    if native.handles_decode(q, k_cache):
        return native.paged_decode_attention(q, k_cache, v_cache, page_table, context_lens, scale)
    return sdpa_paged_decode_attention(q, k_cache, v_cache, page_table, context_lens, scale)


def sdpa_paged_decode_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    page_table: Tensor,
    context_lens: Tensor,
    scale: float,
) -> Tensor:
    """:func:`paged_decode_attention` in plain torch: the pages gathered, then one masked SDPA call."""
    B, Hq, D = q.shape
    _, bs, Hkv, _ = k_cache.shape
    group = _gqa_group(Hq, Hkv)
    L = page_table.shape[1] * bs
    pages = page_table.reshape(-1)
    # k, v: [B, Hkv, L, D] (strided views of the gathered pages; SDPA reads them as they are)
    k = k_cache.index_select(0, pages).view(B, L, Hkv, D).transpose(1, 2)
    v = v_cache.index_select(0, pages).view(B, L, Hkv, D).transpose(1, 2)
    # mask: [B, 1, 1, L], True where the key is part of the sequence
    mask = torch.arange(L, device=q.device) < context_lens.to(q.device)[:, None]
    # The G query heads sharing a KV head become G query rows of that head, so each K/V block is
    # read once for all G; enable_gqa=True ran ~2x slower in bf16 on CPU (~10% in float32).
    # q_rows: [B, Hkv, G, D]
    q_rows = q.reshape(B, Hkv, group, D)
    # The CPU flash kernel accumulates the softmax in float32 for bf16 inputs.
    out = F.scaled_dot_product_attention(q_rows, k, v, attn_mask=mask[:, None, None, :], scale=scale)
    return out.reshape(B, Hq, D)


def paged_prefill_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    page_table: Tensor,
    query_start_loc: Tensor,
    context_lens: Tensor,
    scale: float,
    return_lse: bool = False,
    host_pages: dict[int, tuple[int, Tensor, Tensor]] | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Causal attention for a chunk of new tokens from S sequences, each after its cached prefix.

    q: [T, Hq, D], the sequences' new tokens concatenated; query_start_loc: [S+1] cu_seqlens;
    context_lens: [S] tokens in the cache after this chunk (their K/V already stored).
    Query ``i`` of sequence ``s`` sits at position ``context_lens[s] - q_len[s] + i`` and sees
    keys at positions up to its own. Returns out [T, Hq, D] in q.dtype, and with
    ``return_lse=True`` also lse [T, Hq] float32: the natural-log log-sum-exp of the scaled
    scores over the keys each query sees. ``host_pages[s] = (first, k, v)``: sequence ``s``'s pages from
    ``first`` on are not in the cache (their table entries are -1) but given, as k, v [n, bs, Hkv, D].
    """
    T, Hq, D = q.shape
    _, bs, Hkv, _ = k_cache.shape
    _gqa_group(Hq, Hkv)
    out = torch.empty_like(q)
    lse = torch.empty(T, Hq, dtype=torch.float32, device=q.device) if return_lse else None
    # Loop bounds live on the host: two small copies per step, none per sequence.
    starts = query_start_loc.tolist()
    ctx_lens = context_lens.tolist()
    # One call per sequence, not one padded batch, which gives every sequence the longest one's
    # work. On CPU (1 thread) a 1792-token chunk plus eight 32-token ones ran 200 ms looped vs
    # 2450 ms padded, and uniform steps (8x256 fresh, 4x512 after 1536, 32x16, 64x1) ran
    # looped as fast or faster (25 ms vs 81 ms for 64x1).
    for s, ctx in enumerate(ctx_lens):
        q0, q1 = starts[s], starts[s + 1]
        if q1 - q0 > ctx:
            raise ValueError(f"sequence {s} has {q1 - q0} new tokens but context_lens is {ctx}")
        if q1 == q0:
            continue
        pages = page_table[s, : -(-ctx // bs)]
        given = None if host_pages is None else host_pages.get(s)
        # k, v: [pages, bs, Hkv, D], then [ctx, Hkv, D]
        k = k_cache.index_select(0, pages if given is None else pages.clamp(min=0))
        v = v_cache.index_select(0, pages if given is None else pages.clamp(min=0))
        if given is not None:
            first, host_k, host_v = given
            k[first : first + host_k.shape[0]] = host_k
            v[first : first + host_v.shape[0]] = host_v
        k, v = k.view(-1, Hkv, D)[:ctx], v.view(-1, Hkv, D)[:ctx]
        if lse is None:
            _prefill_sdpa(q[q0:q1], k, v, scale, out[q0:q1])
        else:
            _prefill_explicit(q[q0:q1], k, v, scale, out[q0:q1], lse[q0:q1])
    return (out, lse) if lse is not None else out


def _prefill_sdpa(q: Tensor, k: Tensor, v: Tensor, scale: float, out: Tensor) -> None:
    """Fill out [n, Hq, D] for one sequence's n queries, which are the last n of its keys k, v [ctx, Hkv, D]."""
    n, Hq, _ = q.shape
    prefix = k.shape[0] - n
    # 4-D inputs: given 3-D ones, CPU SDPA falls back to its math kernel, ~3x slower here.
    # q_h: [1, Hq, n, D]; k_h, v_h: [1, Hkv, ctx, D]
    q_h, k_h, v_h = (x.transpose(0, 1)[None] for x in (q, k, v))
    rows = _rows_per_chunk(Hq, k.shape[0], _SDPA_ROWS)
    for r0 in range(0, n, rows):
        r1 = min(r0 + rows, n)
        # Keys after the chunk's last query are hidden from all its rows: leave them out.
        kv = prefix + r1
        # mask: [r1 - r0, kv], True where the key is at or before the query
        positions = torch.arange(prefix + r0, prefix + r1, device=q.device)
        mask = torch.arange(kv, device=q.device) <= positions[:, None]
        o = F.scaled_dot_product_attention(
            q_h[:, :, r0:r1], k_h[:, :, :kv], v_h[:, :, :kv], attn_mask=mask, scale=scale, enable_gqa=True
        )
        out[r0:r1] = o[0].transpose(0, 1)


def _prefill_explicit(q: Tensor, k: Tensor, v: Tensor, scale: float, out: Tensor, lse: Tensor) -> None:
    """As :func:`_prefill_sdpa`, and also fill lse [n, Hq], which SDPA does not return."""
    n, Hq, D = q.shape
    ctx, Hkv, _ = k.shape
    group = Hq // Hkv
    prefix = ctx - n
    # float32 so bf16 scores are not rounded before the softmax; the scale goes on the small side.
    q = q.float() * scale
    # k_t: [Hkv, D, ctx]; v_t: [Hkv, ctx, D]
    k_t = k.permute(1, 2, 0).to(torch.float32, memory_format=torch.contiguous_format)
    v_t = v.transpose(0, 1).to(torch.float32, memory_format=torch.contiguous_format)
    rows = _rows_per_chunk(Hq, ctx, _EXPLICIT_ROWS)
    for r0 in range(0, n, rows):
        r1 = min(r0 + rows, n)
        m, kv = r1 - r0, prefix + r1
        # Fold the G query heads of a KV head into its rows so K/V are never repeated.
        # q_rows: [Hkv, G * m, D], rows ordered (g, i)
        q_rows = q[r0:r1].reshape(m, Hkv, group, D).permute(1, 2, 0, 3).reshape(Hkv, group * m, D)
        # scores: [Hkv, G, m, kv]
        scores = torch.matmul(q_rows, k_t[:, :, :kv]).view(Hkv, group, m, kv)
        # Every row sees all keys before the chunk; only the chunk's own [m, m] square has a future.
        future = torch.ones(m, m, dtype=torch.bool, device=q.device).triu_(1)
        scores[..., prefix + r0 :].masked_fill_(future, float("-inf"))
        # peak, total: [Hkv, G, m, 1]
        peak = scores.amax(dim=-1, keepdim=True)
        weights = scores.sub_(peak).exp_()
        total = weights.sum(dim=-1, keepdim=True)
        # Normalize the [m, D] output instead of the [m, kv] weights: one pass less over the scores.
        o = torch.matmul(weights.view(Hkv, group * m, kv), v_t[:, :kv]).view(Hkv, group, m, D).div_(total)
        out[r0:r1] = o.permute(2, 0, 1, 3).reshape(m, Hq, D)
        lse[r0:r1] = (peak + total.log()).view(Hq, m).transpose(0, 1)


def _rows_per_chunk(num_heads: int, keys: int, preferred: int) -> int:
    return max(1, min(preferred, _MAX_SCORE_BYTES // (4 * num_heads * keys)))


def _gqa_group(num_q_heads: int, num_kv_heads: int) -> int:
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads do not divide into {num_kv_heads} KV heads")
    return num_q_heads // num_kv_heads


# --- references: loops, float32, explicit softmax ------------------------------------------


def ref_paged_decode_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    page_table: Tensor,
    context_lens: Tensor,
    scale: float,
) -> Tensor:
    """Reference for :func:`paged_decode_attention`, one sequence at a time."""
    out = torch.empty_like(q)
    for b in range(q.shape[0]):
        ctx = int(context_lens[b])
        k = _ref_gather(k_cache, page_table[b], ctx)
        v = _ref_gather(v_cache, page_table[b], ctx)
        o, _ = _ref_attend(q[b].float(), k, v, scale)
        out[b] = o.to(q.dtype)
    return out


def ref_paged_prefill_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    page_table: Tensor,
    query_start_loc: Tensor,
    context_lens: Tensor,
    scale: float,
    return_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Reference for :func:`paged_prefill_attention`, one query token at a time."""
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    for s in range(len(context_lens)):
        q0, q1, ctx = int(query_start_loc[s]), int(query_start_loc[s + 1]), int(context_lens[s])
        k = _ref_gather(k_cache, page_table[s], ctx)
        v = _ref_gather(v_cache, page_table[s], ctx)
        for i in range(q1 - q0):
            position = ctx - (q1 - q0) + i
            o, o_lse = _ref_attend(q[q0 + i].float(), k[: position + 1], v[: position + 1], scale)
            out[q0 + i], lse[q0 + i] = o.to(q.dtype), o_lse
    return (out, lse) if return_lse else out


def _ref_gather(cache: Tensor, pages: Tensor, ctx: int) -> Tensor:
    """The first ctx tokens of one sequence, token by token: [ctx, Hkv, D] float32."""
    bs = cache.shape[1]
    return torch.stack([cache[int(pages[t // bs]), t % bs] for t in range(ctx)]).float()


def _ref_attend(q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """One query token, q [Hq, D], over keys k, v [n, Hkv, D]; returns out [Hq, D], lse [Hq]."""
    Hq, Hkv = q.shape[0], k.shape[1]
    kv_head = torch.arange(Hq, device=q.device) // (Hq // Hkv)
    # k_h, v_h: [Hq, n, D], each query head's own KV head
    k_h, v_h = k[:, kv_head].transpose(0, 1), v[:, kv_head].transpose(0, 1)
    scores = torch.einsum("hd,hnd->hn", q, k_h) * scale
    peak = scores.max(dim=-1, keepdim=True).values
    weights = torch.exp(scores - peak)
    total = weights.sum(dim=-1, keepdim=True)
    out = torch.einsum("hn,hnd->hd", weights / total, v_h)
    return out, (peak + torch.log(total)).squeeze(-1)

"""The Triton kernels of sparse retrieval: block scoring, and split decode attention with its merge.

Written for Triton 3.9 and for triton-ascend 3.2 alike, so only what both take: plain pointer
arithmetic (no block pointers, gone in 3.9; no tensor descriptors, absent in triton-ascend 3.2).
Every load is upcast to float32 before any arithmetic: Triton's interpreter computes on the raw
bits of bfloat16 (triton issues 11584, 11604), and the compiled kernels accumulate in float32 anyway.
``tl.dot`` needs at least 16 rows and columns when compiled, so query heads are padded to
``BLOCK_G >= 16`` rows (zeros) and key tiles to ``BLOCK_T >= 16`` / ``BLOCK_N >= 16`` columns (masked).

Launching, shape checks and the choice between the compiler and the interpreter live in
:mod:`rayapp.kernels.triton.launch`; these functions assume their arguments are already checked.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Representation kinds, as the KIND constexpr of score_blocks_kernel (globals a kernel reads must be constexprs).
MEAN, MINMAX, MULTIMEAN = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)


@triton.jit
def score_blocks_kernel(
    q_ptr,  # [B, Hq, D]
    reps_ptr,  # [B, N, Hkv, R, D]
    out_ptr,  # [B, Hkv, N] float32
    num_blocks,
    stride_qb,
    stride_qh,
    stride_qd,
    stride_rb,
    stride_rn,
    stride_rh,
    stride_rr,
    stride_rd,
    stride_ob,
    stride_oh,
    stride_on,
    KIND: tl.constexpr,
    R: tl.constexpr,
    G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """One program per (sequence, KV head, BLOCK_N blocks): the scores of those blocks from the
    KV head's G query heads."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    g_ok = g < G
    d_ok = d < HEAD_DIM
    n_ok = n < num_blocks
    # q: [BLOCK_G, BLOCK_D]; padded rows are zeros, so they add 0 to every dot product.
    q_offs = b * stride_qb + (h * G + g)[:, None] * stride_qh + d[None, :] * stride_qd
    q = tl.load(q_ptr + q_offs, mask=g_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    # rep row r of each block: [BLOCK_N, BLOCK_D] at rep_offs + r * stride_rr
    rep_offs = b * stride_rb + n[:, None] * stride_rn + h * stride_rh + d[None, :] * stride_rd
    rep_mask = n_ok[:, None] & d_ok[None, :]
    if KIND == MINMAX:
        # Quest's bound, sum over channels of max(q*lo, q*hi), is (q where q<0).lo + (q where q>0).hi
        # because lo <= hi channel by channel (block_representation's min and max): two dots.
        lo = tl.load(reps_ptr + rep_offs, mask=rep_mask, other=0.0).to(tl.float32)
        hi = tl.load(reps_ptr + rep_offs + stride_rr, mask=rep_mask, other=0.0).to(tl.float32)
        scores = tl.dot(tl.minimum(q, 0.0), tl.trans(lo), input_precision="ieee")
        scores += tl.dot(tl.maximum(q, 0.0), tl.trans(hi), input_precision="ieee")
    else:
        # scores: [BLOCK_G, BLOCK_N], the best representative row of each block (mean has one).
        scores = tl.full((BLOCK_G, BLOCK_N), float("-inf"), tl.float32)
        for r in range(R):
            rep = tl.load(reps_ptr + rep_offs + r * stride_rr, mask=rep_mask, other=0.0).to(tl.float32)
            scores = tl.maximum(scores, tl.dot(q, tl.trans(rep), input_precision="ieee"))
    if KIND == MULTIMEAN:
        # The best query head; a padded row scores 0, which must not beat a real negative score.
        best = tl.max(tl.where(g_ok[:, None], scores, float("-inf")), axis=0)
    else:
        best = tl.sum(scores, axis=0) / G
    tl.store(out_ptr + b * stride_ob + h * stride_oh + n * stride_on, best, mask=n_ok)


@triton.jit
def decode_split_kernel(
    q_ptr,  # [B, Hq, D]
    k_ptr,  # [P, bs, Hkv, D], any strides
    v_ptr,  # [P, bs, Hkv, D], any strides
    table_ptr,  # [B, Hkv, n] page ids
    lens_ptr,  # [B, n] valid tokens per listed page
    max_ptr,  # [B, Hq, S] float32: running max of the split's scores (log2 units)
    sum_ptr,  # [B, Hq, S] float32: sum of exp2(score - max)
    acc_ptr,  # [B, Hq, S, D] float32: sum of exp2(score - max) * v
    scale_log2,  # softmax scale * log2(e)
    num_pages,
    pages_per_split,
    stride_qb,
    stride_qh,
    stride_qd,
    stride_kp,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vp,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_tb,
    stride_th,
    stride_tn,
    stride_lb,
    stride_ln,
    G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_T: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One program per (sequence, KV head, split): online softmax of all G query heads of the KV
    head over the split's slice of the head's page list, written as partial (max, sum, acc)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    hq = tl.num_programs(1) * G
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    t = tl.arange(0, BLOCK_T)
    g_ok = g < G
    d_ok = d < HEAD_DIM
    # q: [BLOCK_G, BLOCK_D]
    q_offs = b * stride_qb + (h * G + g)[:, None] * stride_qh + d[None, :] * stride_qd
    q = tl.load(q_ptr + q_offs, mask=g_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    row_max = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    row_sum = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), tl.float32)
    first = split * pages_per_split
    last = tl.minimum(first + pages_per_split, num_pages)
    for j in range(first, last):
        # 64-bit: page * page stride passes 2**31 elements on a large cache.
        page = tl.load(table_ptr + b * stride_tb + h * stride_th + j * stride_tn).to(tl.int64)
        length = tl.load(lens_ptr + b * stride_lb + j * stride_ln)
        k_page = k_ptr + page * stride_kp + h * stride_kh
        v_page = v_ptr + page * stride_vp + h * stride_vh
        # Padding pages (length 0) run no tile; every tile run holds at least one valid token.
        for start in range(0, length, BLOCK_T):
            tok = start + t
            kv_mask = (tok < length)[:, None] & d_ok[None, :]
            # k, v: [BLOCK_T, BLOCK_D]
            k = tl.load(k_page + tok[:, None] * stride_kt + d[None, :] * stride_kd, mask=kv_mask, other=0.0)
            scores = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision=DOT_PRECISION) * scale_log2
            scores = tl.where((tok < length)[None, :], scores, float("-inf"))  # [BLOCK_G, BLOCK_T]
            new_max = tl.maximum(row_max, tl.max(scores, axis=1))
            alpha = tl.exp2(row_max - new_max)
            p = tl.exp2(scores - new_max[:, None])
            v = tl.load(v_page + tok[:, None] * stride_vt + d[None, :] * stride_vd, mask=kv_mask, other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision=DOT_PRECISION)
            row_sum = row_sum * alpha + tl.sum(p, axis=1)
            row_max = new_max
    # A split with no valid token leaves (-inf, 0, 0), which the merge weighs 0.
    rows = (b * hq + h * G + g) * num_splits + split  # [BLOCK_G] rows of the [B, Hq, S] partials
    tl.store(max_ptr + rows, row_max, mask=g_ok)
    tl.store(sum_ptr + rows, row_sum, mask=g_ok)
    tl.store(acc_ptr + rows[:, None] * HEAD_DIM + d[None, :], acc, mask=g_ok[:, None] & d_ok[None, :])


@triton.jit
def merge_splits_kernel(
    max_ptr,  # [B, Hq, S] float32
    sum_ptr,  # [B, Hq, S] float32
    acc_ptr,  # [B, Hq, S, D] float32
    out_ptr,  # [B, Hq, D], q's dtype
    num_splits,
    stride_ob,
    stride_oh,
    stride_od,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One program per (sequence, query head): the splits' partial softmaxes rescaled to their
    common max and summed. A head with no valid token at all gets zeros (an empty weighted sum)."""
    b = tl.program_id(0)
    hq = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_ok = s < num_splits
    rows = (b * tl.num_programs(1) + hq) * num_splits + s  # [BLOCK_S]
    split_max = tl.load(max_ptr + rows, mask=s_ok, other=float("-inf"))
    split_sum = tl.load(sum_ptr + rows, mask=s_ok, other=0.0)
    top = tl.max(split_max, axis=0)
    # where(), not exp2 alone: exp2(-inf - -inf) is nan when no split saw a token.
    weight = tl.where(split_max > float("-inf"), tl.exp2(split_max - top), 0.0)  # [BLOCK_S]
    acc_mask = s_ok[:, None] & (d < HEAD_DIM)[None, :]
    acc = tl.load(acc_ptr + rows[:, None] * HEAD_DIM + d[None, :], mask=acc_mask, other=0.0)  # [BLOCK_S, BLOCK_D]
    total = tl.sum(weight * split_sum, axis=0)
    out = tl.sum(weight[:, None] * acc, axis=0) / tl.where(total > 0.0, total, 1.0)  # [BLOCK_D]
    out_offs = b * stride_ob + hq * stride_oh + d * stride_od
    tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)

"""Host side of the Triton retrieval kernels: argument checks, grids, and compiler vs interpreter.

Compiled or interpreted is fixed when ``triton.language`` is first imported: ``triton.jit``
reads ``TRITON_INTERPRET`` as it decorates, and Triton's own library (``tl.sum``, ``tl.max``) is
decorated then. A process that wants the interpreter sets ``TRITON_INTERPRET=1`` before anything
imports triton; flipping ``triton.knobs`` later cannot work, so the mode is read from the library.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.backends.compiler import GPUTarget
from triton.runtime.interpreter import InterpretedFunction

import rayapp.kernels.triton.kernels as kernels
from rayapp.kernels.retrieval import REPRESENTATIVE_ROWS

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)
KIND_IDS = {"mean": kernels.MEAN.value, "minmax": kernels.MINMAX.value, "multimean": kernels.MULTIMEAN.value}
# Split-K aims for this many decode programs (a couple of waves on a 100+ SM GPU), with at most
# MAX_SPLITS splits of a page list so the merge reads one tile.
TARGET_PROGRAMS = 256
MAX_SPLITS = 64
# Tokens per K/V tile: a whole small page, or 64-token slices of a large one (register budget).
MAX_TILE = 64
LOG2_E = 1.4426950408889634


def interpreting() -> bool:
    """Whether this process runs Triton kernels in the interpreter: triton was imported under
    ``TRITON_INTERPRET=1``, so its library functions are interpreted ones."""
    return isinstance(tl.sum, InterpretedFunction)


@functools.cache
def as_mode(kernel, interpret: bool):
    """``kernel`` (as ``triton.jit`` decorated it) wrapped for the interpreter or for the compiler."""
    wrapper = InterpretedFunction if interpret else triton.JITFunction
    return kernel if isinstance(kernel, wrapper) else wrapper(kernel.fn)


def runnable(kernel, device: torch.device):
    """``kernel`` wrapped for this process's mode, refusing CPU tensors when compiled."""
    if interpreting():
        return as_mode(kernel, True)
    if device.type == "cpu":
        raise ValueError(
            "the Triton retrieval kernels need GPU or NPU tensors; on CPU use rayapp.kernels.retrieval "
            "(PyTorch and C++), or run them in Triton's interpreter by setting TRITON_INTERPRET=1 before "
            "triton is imported (tests only)"
        )
    return as_mode(kernel, False)


def dot_precision(dtype: torch.dtype, target: GPUTarget | None) -> str:
    """``tl.dot`` precision for K/V of ``dtype`` upcast to float32 on ``target`` (None: interpreter).

    TF32 keeps 10 mantissa bits, so products of upcast float16 and bfloat16 values are exact in it and
    only the softmax weights round (no more than the usual cast to 16 bits); float32 caches stay IEEE.
    """
    if target is None or dtype == torch.float32:
        return "ieee"
    tf32 = target.backend == "cuda" or (target.backend == "hip" and target.arch == "gfx942")
    return "tf32" if tf32 else "ieee"


def score_meta(kind: str, rows: int, group: int, head_dim: int, num_blocks: int) -> dict:
    """The constexprs of :func:`kernels.score_blocks_kernel`. At most 32 blocks a program: its IEEE
    float32 dots stage through shared memory (40 KB on sm_90 at 32 blocks, 72 KB at 64)."""
    return dict(
        KIND=KIND_IDS[kind],
        R=rows,
        G=group,
        HEAD_DIM=head_dim,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_N=min(32, max(16, triton.next_power_of_2(num_blocks))),
    )


def decode_meta(group: int, head_dim: int, page_size: int, precision: str) -> dict:
    """The constexprs of :func:`kernels.decode_split_kernel`."""
    return dict(
        G=group,
        HEAD_DIM=head_dim,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_T=min(MAX_TILE, max(16, triton.next_power_of_2(page_size))),
        DOT_PRECISION=precision,
    )


def merge_meta(head_dim: int, num_splits: int) -> dict:
    """The constexprs of :func:`kernels.merge_splits_kernel`."""
    return dict(HEAD_DIM=head_dim, BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=triton.next_power_of_2(head_dim))


def default_pages_per_split(batch: int, kv_heads: int, num_pages: int) -> int:
    """Enough splits of each page list to fill about TARGET_PROGRAMS programs, at most MAX_SPLITS."""
    splits = min(num_pages, MAX_SPLITS, max(1, math.ceil(TARGET_PROGRAMS / max(1, batch * kv_heads))))
    return math.ceil(num_pages / max(1, splits))


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _check_same_device(**tensors: Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    _require(len(set(devices.values())) == 1, f"tensors on different devices: {devices}")


def score_blocks(q: Tensor, reps: Tensor, kind: str) -> Tensor:
    """Score every block for every KV head from the current queries (Triton).

    The contract of :func:`rayapp.kernels.retrieval.score_blocks`: q [B, Hq, D]; reps
    [B, N, Hkv, R, D] as :func:`~rayapp.kernels.retrieval.block_representation` writes them (R = 1
    for ``mean``, 2 for ``minmax``, with min <= max per channel). Returns [B, Hkv, N] float32.
    """
    _require(kind in KIND_IDS, f"unknown representation {kind!r}; expected one of {sorted(KIND_IDS)}")
    _require(q.dim() == 3, f"q must be [B, Hq, D], got shape {tuple(q.shape)}")
    _require(reps.dim() == 5, f"reps must be [B, N, Hkv, R, D], got shape {tuple(reps.shape)}")
    B, Hq, D = q.shape
    _, N, Hkv, rows, _ = reps.shape
    _require(reps.shape[0] == B, f"reps has {reps.shape[0]} sequences, q has {B}")
    _require(reps.shape[4] == D, f"reps has head_dim {reps.shape[4]}, q has {D}")
    _require(Hkv > 0 and Hq % Hkv == 0, f"q's {Hq} heads are not a multiple of reps' {Hkv} KV heads")
    expected_rows = REPRESENTATIVE_ROWS[kind](rows)
    _require(rows == expected_rows, f"{kind} reps hold {expected_rows} row(s) per block and head, got {rows}")
    _require(rows > 0, "reps hold no representative row")
    _require(q.dtype in FLOAT_DTYPES and reps.dtype in FLOAT_DTYPES, f"unsupported dtypes {q.dtype}, {reps.dtype}")
    _check_same_device(q=q, reps=reps)
    out = torch.empty(B, Hkv, N, dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out
    meta = score_meta(kind, rows, Hq // Hkv, D, N)
    grid = (B, Hkv, triton.cdiv(N, meta["BLOCK_N"]))
    runnable(kernels.score_blocks_kernel, q.device)[grid](
        q, reps, out, N, *q.stride(), *reps.stride(), *out.stride(), **meta
    )
    return out


def _check_decode(q: Tensor, k_cache: Tensor, v_cache: Tensor, page_table: Tensor, page_lens: Tensor) -> None:
    _require(q.dim() == 3, f"q must be [B, Hq, D], got shape {tuple(q.shape)}")
    _require(k_cache.dim() == 4, f"k_cache must be [pages, page_size, Hkv, D], got shape {tuple(k_cache.shape)}")
    _require(v_cache.shape == k_cache.shape, f"v_cache shape {tuple(v_cache.shape)} != k_cache {tuple(k_cache.shape)}")
    _require(page_table.dim() == 3, f"page_table must be [B, Hkv, n], got shape {tuple(page_table.shape)}")
    _require(page_lens.dim() == 2, f"page_lens must be [B, n], got shape {tuple(page_lens.shape)}")
    B, Hq, D = q.shape
    _, _, Hkv, Dk = k_cache.shape
    _require(Dk == D, f"k_cache has head_dim {Dk}, q has {D}")
    _require(Hkv > 0 and Hq % Hkv == 0, f"q's {Hq} heads are not a multiple of k_cache's {Hkv} KV heads")
    _require(page_table.shape[:2] == (B, Hkv), f"page_table is {tuple(page_table.shape)}, expected [{B}, {Hkv}, n]")
    _require(
        page_lens.shape == (B, page_table.shape[2]),
        f"page_lens is {tuple(page_lens.shape)}, expected [{B}, {page_table.shape[2]}] like page_table's pages",
    )
    _require(q.dtype in FLOAT_DTYPES, f"q dtype {q.dtype} is not one of {FLOAT_DTYPES}")
    _require(
        k_cache.dtype == q.dtype and v_cache.dtype == q.dtype,
        f"k_cache {k_cache.dtype} and v_cache {v_cache.dtype} must have q's dtype {q.dtype}",
    )
    _require(
        page_table.dtype in INDEX_DTYPES and page_lens.dtype in INDEX_DTYPES,
        f"page_table {page_table.dtype} and page_lens {page_lens.dtype} must be int32 or int64",
    )
    _check_same_device(q=q, k_cache=k_cache, v_cache=v_cache, page_table=page_table, page_lens=page_lens)


def sparse_decode_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    page_table: Tensor,
    page_lens: Tensor,
    scale: float,
    *,
    pages_per_split: int | None = None,
) -> Tensor:
    """One query per sequence over a chosen list of pages, chosen per KV head (Triton, split-K).

    The contract of :func:`rayapp.kernels.retrieval.sparse_decode_attention`: q [B, Hq, D];
    k_cache, v_cache [pages, page_size, Hkv, D] with any strides, so each of vLLM's layouts is a
    view (HND: ``cache.transpose(1, 2)``; K and V as channel halves: ``.split(D, -1)``);
    page_table [B, Hkv, n] page ids; page_lens [B, n] valid tokens per listed page, 0 for padding.
    Returns [B, Hq, D] in q.dtype. Page ids and lengths are not range-checked (that would sync the
    device): each must be in [0, pages) and [0, page_size].

    ``pages_per_split`` overrides how many listed pages one program reads before the merge.
    """
    _check_decode(q, k_cache, v_cache, page_table, page_lens)
    B, Hq, D = q.shape
    _, page_size, Hkv, _ = k_cache.shape
    n = page_table.shape[2]
    out = torch.empty(B, Hq, D, dtype=q.dtype, device=q.device)
    if B == 0 or n == 0:
        return out.zero_()  # no key at all: an empty weighted sum, as the reference gives
    per_split = pages_per_split or default_pages_per_split(B, Hkv, n)
    _require(per_split > 0, f"pages_per_split must be positive, got {per_split}")
    splits = math.ceil(n / per_split)
    _require(splits <= MAX_SPLITS, f"{splits} splits of {per_split} pages exceed {MAX_SPLITS}; raise pages_per_split")
    split_kernel = runnable(kernels.decode_split_kernel, q.device)  # before allocating: refuses CPU tensors
    target = None if interpreting() else triton.runtime.driver.active.get_current_target()
    # Partials: [B, Hq, S] running max and sum, [B, Hq, S, D] weighted values, float32.
    split_max = torch.empty(B, Hq, splits, dtype=torch.float32, device=q.device)
    split_sum = torch.empty_like(split_max)
    split_acc = torch.empty(B, Hq, splits, D, dtype=torch.float32, device=q.device)
    split_kernel[(B, Hkv, splits)](
        q,
        k_cache,
        v_cache,
        page_table,
        page_lens,
        split_max,
        split_sum,
        split_acc,
        scale * LOG2_E,
        n,
        per_split,
        *q.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        *page_table.stride(),
        *page_lens.stride(),
        **decode_meta(Hq // Hkv, D, page_size, dot_precision(q.dtype, target)),
    )
    runnable(kernels.merge_splits_kernel, q.device)[(B, Hq)](
        split_max, split_sum, split_acc, out, splits, *out.stride(), **merge_meta(D, splits)
    )
    return out

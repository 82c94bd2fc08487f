"""The Triton retrieval kernels, run in Triton's interpreter on CPU tensors, against the loop references.

The kernels run in a child Python started with ``TRITON_INTERPRET=1`` (the ``interpreter``
fixture); references and asserts stay here. Why a child: Triton decides interpreted or compiled
as ``triton.language`` is imported (its own ``tl.sum``, ``tl.max`` are decorated then), and in a
whole-suite pytest run another test may import triton first. Setting the variable in this process
would then be too late, or would switch every later test's Triton to the interpreter.
"""

import concurrent.futures
import multiprocessing
import os

import pytest
import torch

triton = pytest.importorskip("triton")

from rayapp.kernels.retrieval import (  # noqa: E402
    block_representation,
    ref_score_blocks,
    ref_select_topk_blocks,
    ref_sparse_decode_attention,
)
from rayapp.kernels.triton import (  # noqa: E402
    interpreting,
    score_blocks,
    select_topk_blocks,
    sparse_decode_attention,
)

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
B, HKV = 2, 2


@pytest.fixture(scope="module")
def interpreter():
    """``interpreter(fn, *args, **kwargs)`` calls ``fn`` in a child whose triton interprets; tensors
    travel by pickle with their strides (views of one storage stay views), exceptions come back."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TRITON_INTERPRET", "1")  # inherited by the child as it starts, below
        pool = concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
        assert pool.submit(_child_interprets).result(timeout=120), "TRITON_INTERPRET=1 did not reach the child"

    def call(fn, *args, **kwargs):
        return pool.submit(fn, *args, **kwargs).result(timeout=120)

    yield call
    pool.shutdown()


def _child_interprets() -> bool:
    import rayapp.kernels.triton

    return os.environ.get("TRITON_INTERPRET") == "1" and rayapp.kernels.triton.interpreting()


def _caches(layout: str, pages: int, page_size: int, head_dim: int, dtype: torch.dtype, gen: torch.Generator):
    """K and V as [pages, page_size, Hkv, D] views of the cache layout named."""
    if layout == "nhd":  # separate [num_blocks, block_size, H, D] tensors
        k, v = (torch.randn(pages, page_size, HKV, head_dim, generator=gen).to(dtype) for _ in range(2))
        return k, v
    # vLLM 0.32: one [num_blocks, H, block_size, 2 * D] tensor per layer, K and V its channel halves.
    kv = torch.randn(pages, HKV, page_size, 2 * head_dim, generator=gen).to(dtype)
    k, v = kv.transpose(1, 2).split(head_dim, -1)
    assert not k.is_contiguous() and not v.is_contiguous()
    return k, v


def _page_lens(num_pages: int, page_size: int) -> torch.Tensor:
    """Row 0: full pages then a partial last one; row 1: shorter, a partial page, then two of padding."""
    partial = page_size // 2 - 1
    return torch.tensor([[page_size] * (num_pages - 1) + [partial], [page_size] * (num_pages - 3) + [partial, 0, 0]])


DECODE_CASES = [
    # dtype, query heads per KV head, head_dim, page_size, layout, pages per split (None: the launcher's)
    pytest.param(torch.float32, 1, 64, 16, "nhd", None, id="fp32-g1-d64-p16-nhd"),
    pytest.param(torch.float32, 7, 128, 128, "hnd-split", 2, id="fp32-g7-d128-p128-hnd"),
    pytest.param(torch.float16, 3, 128, 16, "hnd-split", 2, id="fp16-g3-d128-p16-hnd"),
    pytest.param(torch.float16, 1, 64, 128, "nhd", None, id="fp16-g1-d64-p128-nhd"),
    pytest.param(torch.bfloat16, 7, 64, 16, "hnd-split", None, id="bf16-g7-d64-p16-hnd"),
    pytest.param(torch.bfloat16, 3, 128, 128, "nhd", 2, id="bf16-g3-d128-p128-nhd"),
]


@pytest.mark.parametrize("dtype,group,head_dim,page_size,layout,pages_per_split", DECODE_CASES)
def test_decode_over_per_head_pages_matches_reference(
    interpreter, dtype, group, head_dim, page_size, layout, pages_per_split
):
    gen = torch.Generator().manual_seed(group * head_dim + page_size)
    num_pages = 5 if page_size == 16 else 3
    k_cache, v_cache = _caches(layout, 12, page_size, head_dim, dtype, gen)
    # A strided query, as a slice of a larger batch would be.
    q = torch.randn(HKV * group, B, head_dim, generator=gen).to(dtype).transpose(0, 1)
    table = torch.randint(0, 12, (B, HKV, num_pages), generator=gen)
    lens = _page_lens(num_pages, page_size)
    scale = head_dim**-0.5
    got = interpreter(sparse_decode_attention, q, k_cache, v_cache, table, lens, scale, pages_per_split=pages_per_split)
    want = ref_sparse_decode_attention(q, k_cache, v_cache, table, lens, scale)
    assert got.dtype == dtype and got.shape == (B, HKV * group, head_dim)
    torch.testing.assert_close(got, want, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_how_pages_are_split_does_not_change_the_answer(interpreter):
    gen = torch.Generator().manual_seed(11)
    k_cache, v_cache = _caches("nhd", 10, 16, 64, torch.float32, gen)
    q = torch.randn(B, HKV * 3, 64, generator=gen)
    table = torch.randint(0, 10, (B, HKV, 6), generator=gen, dtype=torch.int32)
    lens = _page_lens(6, 16).to(torch.int32)
    outs = [
        interpreter(sparse_decode_attention, q, k_cache, v_cache, table, lens, 0.125, pages_per_split=s) for s in (2, 6)
    ]
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], atol=1e-6, rtol=1e-6)


def test_a_head_with_no_valid_token_gets_zeros_like_the_reference(interpreter):
    gen = torch.Generator().manual_seed(12)
    k_cache, v_cache = _caches("nhd", 4, 16, 64, torch.float32, gen)
    q = torch.randn(B, HKV, 64, generator=gen)
    table = torch.zeros(B, HKV, 2, dtype=torch.int64)
    lens = torch.tensor([[16, 3], [0, 0]])  # row 1 lists only padding
    got = interpreter(sparse_decode_attention, q, k_cache, v_cache, table, lens, 0.125, pages_per_split=1)
    torch.testing.assert_close(got, ref_sparse_decode_attention(q, k_cache, v_cache, table, lens, 0.125))
    assert (got[1] == 0).all()


SCORE_CASES = [
    # kind, representative rows, query dtype, query heads per KV head, head_dim, blocks
    pytest.param("mean", 1, torch.float32, 1, 64, 40, id="mean-g1-d64"),
    pytest.param("mean", 1, torch.float16, 7, 128, 9, id="mean-g7-d128-fp16"),
    pytest.param("minmax", 1, torch.float32, 3, 128, 9, id="minmax-g3-d128"),
    pytest.param("minmax", 1, torch.bfloat16, 7, 64, 9, id="minmax-g7-d64-bf16"),
    pytest.param("multimean", 4, torch.float32, 7, 64, 40, id="multimean4-g7-d64"),
    pytest.param("multimean", 2, torch.bfloat16, 3, 128, 9, id="multimean2-g3-d128-bf16"),
]


@pytest.mark.parametrize("kind,rows,dtype,group,head_dim,num_blocks", SCORE_CASES)
def test_block_scores_match_reference(interpreter, kind, rows, dtype, group, head_dim, num_blocks):
    gen = torch.Generator().manual_seed(num_blocks + group)
    q = torch.randn(1, HKV * group, head_dim, generator=gen).to(dtype)
    # 16-token retrieval blocks, summarized as the engine's representation store holds them.
    keys = torch.randn(num_blocks, 16, HKV, head_dim, generator=gen)
    reps = block_representation(keys, kind, rows)[None]  # [1, N, Hkv, R, D]
    got = interpreter(score_blocks, q, reps, kind)
    torch.testing.assert_close(got, ref_score_blocks(q, reps, kind), atol=1e-4, rtol=1e-4)


def test_topk_over_triton_scores_picks_the_reference_blocks(interpreter):
    gen = torch.Generator().manual_seed(13)
    q = torch.randn(B, HKV * 3, 64, generator=gen)
    reps = torch.stack([block_representation(torch.randn(12, 16, HKV, 64, generator=gen), "multimean", 4)] * B)
    scores = interpreter(score_blocks, q, reps, "multimean")
    num_blocks, k = torch.tensor([12, 7]), torch.tensor([4, 2])
    blocks, valid = select_topk_blocks(scores, num_blocks, k)
    expected = ref_select_topk_blocks(ref_score_blocks(q, reps, "multimean"), num_blocks, k)
    for b in range(B):
        for h in range(HKV):
            assert set(blocks[b, h][valid[b]].tolist()) == expected[b][h]


def _decode_args(**change):
    gen = torch.Generator().manual_seed(14)
    k_cache, v_cache = _caches("nhd", 4, 16, 64, torch.float32, gen)
    args = dict(
        q=torch.randn(B, HKV * 3, 64, generator=gen),
        k_cache=k_cache,
        v_cache=v_cache,
        page_table=torch.zeros(B, HKV, 3, dtype=torch.int64),
        page_lens=torch.full((B, 3), 16),
        scale=0.125,
    )
    return {**args, **change}


MISMATCHES = [
    pytest.param(dict(q=torch.randn(B, 5, 64)), "not a multiple", id="query-heads"),
    pytest.param(dict(q=torch.randn(B, 6, 128)), "head_dim", id="head-dim"),
    pytest.param(dict(v_cache=torch.randn(4, 16, HKV, 32)), "v_cache shape", id="v-shape"),
    pytest.param(dict(page_table=torch.zeros(B, 3, 3, dtype=torch.int64)), "page_table", id="table-heads"),
    pytest.param(dict(page_lens=torch.full((B, 4), 16)), "page_lens", id="lens-pages"),
    pytest.param(dict(q=torch.randn(B, 6, 64, dtype=torch.float16)), "dtype", id="cache-dtype"),
    pytest.param(dict(page_table=torch.zeros(B, HKV, 3)), "int32 or int64", id="float-table"),
    pytest.param(dict(page_lens=torch.full((B, 3), 16, device="meta")), "different devices", id="device"),
]


@pytest.mark.parametrize("change,message", MISMATCHES)
def test_mismatched_decode_arguments_are_refused_before_launch(change, message):
    with pytest.raises(ValueError, match=message):
        sparse_decode_attention(**_decode_args(**change))


def test_mismatched_score_arguments_are_refused_before_launch():
    q, reps = torch.randn(1, 6, 64), torch.randn(1, 5, HKV, 2, 64)
    with pytest.raises(ValueError, match="mean reps hold 1 row"):
        score_blocks(q, reps, "mean")
    with pytest.raises(ValueError, match="head_dim"):
        score_blocks(q, reps[..., :32], "minmax")
    with pytest.raises(ValueError, match="unknown representation"):
        score_blocks(q, reps, "max")


@pytest.mark.skipif(interpreting(), reason="this process interprets Triton (TRITON_INTERPRET=1)")
def test_cpu_tensors_without_the_interpreter_are_refused_with_the_way_out():
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        sparse_decode_attention(**_decode_args())
    with pytest.raises(ValueError, match="rayapp.kernels.retrieval"):
        score_blocks(torch.randn(1, 6, 64), torch.randn(1, 5, HKV, 1, 64), "mean")

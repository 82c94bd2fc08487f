"""SnapKV / PyramidKV kernels: window scores against an explicit softmax, token selection, budgets."""

from dataclasses import dataclass

import pytest
import torch
from torch import Tensor

from rayapp.kernels import snapkv
from rayapp.kernels.attention import paged_prefill_attention, store_kv
from rayapp.kernels.snapkv import pyramid_budgets, ref_snapkv_scores, select_tokens, snapkv_scores

D = 16
SCALE = D**-0.5
# Slots the prompt does not own hold a loud key: any leak into the scores swamps them.
POISON_K = 50.0
TOL = dict(atol=1e-6, rtol=1e-5)


@dataclass(frozen=True)
class PagedPrompt:
    """One prompt's queries and keys, its keys stored in shuffled pages of a larger cache."""

    q: Tensor  # [N, Hq, D]
    k_cache: Tensor  # [P, bs, Hkv, D]
    v_cache: Tensor  # [P, bs, Hkv, D]
    page_table: Tensor  # [pages + padding]


def make_prompt(
    num_tokens: int,
    num_heads: int,
    num_kv_heads: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    table_dtype: torch.dtype = torch.int64,
    seed: int = 0,
) -> PagedPrompt:
    gen = torch.Generator().manual_seed(seed)
    num_pages = -(-num_tokens // block_size)
    total_pages = num_pages + 4  # pages the prompt does not own
    shape = (total_pages, block_size, num_kv_heads, D)
    k_cache = torch.full(shape, POISON_K, dtype=dtype)
    v_cache = torch.full(shape, POISON_K, dtype=dtype)
    pages = torch.randperm(total_pages, generator=gen)[:num_pages]
    # Padding entries point at a page the prompt does not own.
    unowned = next(p for p in range(total_pages) if p not in pages.tolist())
    page_table = torch.cat([pages, torch.tensor([unowned, unowned])]).to(table_dtype)
    positions = torch.arange(num_tokens)
    slots = pages[positions // block_size] * block_size + positions % block_size  # [N]
    # A wide spread of logits makes the attention peaky, as in a real model.
    k = (2 * torch.randn(num_tokens, num_kv_heads, D, generator=gen)).to(dtype)
    v = torch.randn(num_tokens, num_kv_heads, D, generator=gen).to(dtype)
    store_kv(k, v, k_cache, v_cache, slots)
    q = (2 * torch.randn(num_tokens, num_heads, D, generator=gen)).to(dtype)
    return PagedPrompt(q, k_cache, v_cache, page_table)


def explicit_lse(prompt: PagedPrompt, num_tokens: int) -> Tensor:
    """Causal log-sum-exp of every prompt row, [N, Hq], from plain torch (no paged kernel)."""
    bs, Hkv = prompt.k_cache.shape[1], prompt.k_cache.shape[2]
    Hq = prompt.q.shape[1]
    positions = torch.arange(num_tokens)
    keys = prompt.k_cache[prompt.page_table[positions // bs].long(), positions % bs].float()  # [N, Hkv, D]
    keys = keys.repeat_interleave(Hq // Hkv, dim=1)  # [N, Hq, D]
    logits = torch.einsum("qhd,khd->hqk", prompt.q.float(), keys) * SCALE  # [Hq, N, N]
    causal = torch.ones(num_tokens, num_tokens, dtype=torch.bool).tril()
    return logits.masked_fill(~causal, float("-inf")).logsumexp(dim=-1).T  # [N, Hq]


def window_scores(prompt: PagedPrompt, num_tokens: int, window: int, kernel_size: int, lse: Tensor) -> Tensor:
    return snapkv_scores(
        prompt.q[-window:], prompt.k_cache, prompt.page_table, num_tokens, lse[-window:], SCALE, kernel_size
    )


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(9, 3), (4, 4), (6, 1)])
@pytest.mark.parametrize("num_tokens,window,kernel_size", [(37, 8, 5), (50, 16, 7), (23, 23, 3), (13, 4, 1)])
def test_window_scores_equal_the_explicit_softmax_over_the_whole_prompt(
    block_size, num_heads, num_kv_heads, num_tokens, window, kernel_size
):
    prompt = make_prompt(num_tokens, num_heads, num_kv_heads, block_size)
    lse = explicit_lse(prompt, num_tokens)

    scores = window_scores(prompt, num_tokens, window, kernel_size, lse)

    expected = ref_snapkv_scores(prompt.q, prompt.k_cache, prompt.page_table, window, SCALE, kernel_size)
    assert scores.shape == (num_kv_heads, num_tokens) and scores.dtype == torch.float32
    torch.testing.assert_close(scores, expected, **TOL)


def test_lse_from_a_chunked_prefill_scores_the_prompt_like_the_explicit_softmax():
    # SmolLM2's heads, 4-token pages, a 45-token prompt prefilled as 30 + 15 tokens: the 20-token
    # window takes lse rows from both chunks.
    num_tokens, window = 45, 20
    prompt = make_prompt(num_tokens, 9, 3, block_size=4)
    table = prompt.page_table[None]
    cache = (prompt.k_cache, prompt.v_cache, table)
    _, lse_first = paged_prefill_attention(
        prompt.q[:30], *cache, torch.tensor([0, 30]), torch.tensor([30]), SCALE, return_lse=True
    )
    _, lse_second = paged_prefill_attention(
        prompt.q[30:], *cache, torch.tensor([0, 15]), torch.tensor([num_tokens]), SCALE, return_lse=True
    )
    lse = torch.cat([lse_first, lse_second])  # [N, Hq]

    scores = window_scores(prompt, num_tokens, window, 5, lse)
    unpooled = window_scores(prompt, num_tokens, window, 1, lse)

    expected = ref_snapkv_scores(prompt.q, prompt.k_cache, prompt.page_table, window, SCALE, 5)
    torch.testing.assert_close(scores, expected, **TOL)
    # Each of the window's 20 rows in each of a KV head's 3 query heads hands out one unit of attention.
    torch.testing.assert_close(unpooled.sum(dim=-1), torch.full((3,), 20.0 * 3), **TOL)


def test_the_last_key_is_scored_only_by_the_last_query():
    num_tokens = 12
    prompt = make_prompt(num_tokens, 2, 1, block_size=4)
    lse = explicit_lse(prompt, num_tokens)

    scores = window_scores(prompt, num_tokens, 6, 1, lse)

    # The last query is the only one that sees the last key; its probability is exp(q.k - lse).
    last_logits = (prompt.q[-1].float() @ prompt.k_cache[prompt.page_table[2], 3, 0].float()) * SCALE  # [Hq]
    torch.testing.assert_close(scores[0, -1], (last_logits - lse[-1]).exp().sum(), **TOL)


def test_window_rows_split_into_chunks_give_the_same_scores(monkeypatch):
    num_tokens, window = 41, 17
    prompt = make_prompt(num_tokens, 9, 3, block_size=4)
    lse = explicit_lse(prompt, num_tokens)
    whole = window_scores(prompt, num_tokens, window, 5, lse)
    # Room for 3 rows of [Hq, N] float32 scores: chunk edges fall inside the window.
    monkeypatch.setattr(snapkv, "_MAX_SCORE_BYTES", 3 * 4 * 9 * num_tokens)

    chunked = window_scores(prompt, num_tokens, window, 5, lse)

    torch.testing.assert_close(chunked, whole, **TOL)


def test_a_bf16_cache_is_scored_in_float32():
    num_tokens, window = 30, 10
    prompt = make_prompt(num_tokens, 6, 2, block_size=8, dtype=torch.bfloat16, table_dtype=torch.int32)
    lse = explicit_lse(prompt, num_tokens)

    scores = window_scores(prompt, num_tokens, window, 5, lse)

    expected = ref_snapkv_scores(prompt.q, prompt.k_cache, prompt.page_table, window, SCALE, 5)
    assert scores.dtype == torch.float32
    torch.testing.assert_close(scores, expected, **TOL)


def test_a_one_token_prompt_scores_its_token_by_every_query_head():
    prompt = make_prompt(1, 9, 3, block_size=4)
    lse = explicit_lse(prompt, 1)

    scores = window_scores(prompt, 1, 1, 5, lse)

    # One key: each of the 3 query heads of a KV head gives it probability 1.
    torch.testing.assert_close(scores, torch.full((3, 1), 3.0), **TOL)


def test_scoring_rejects_a_window_longer_than_the_prompt_and_bad_arguments():
    prompt = make_prompt(10, 9, 3, block_size=4)
    lse = explicit_lse(prompt, 10)
    longer_window = torch.cat([prompt.q[:2], prompt.q])  # [12, Hq, D]
    with pytest.raises(ValueError, match="last min\\(window, num_tokens\\)"):
        snapkv_scores(longer_window, prompt.k_cache, prompt.page_table, 10, lse[:12], SCALE, 5)
    with pytest.raises(ValueError, match="odd size"):
        snapkv_scores(prompt.q[-4:], prompt.k_cache, prompt.page_table, 10, lse[-4:], SCALE, 4)
    with pytest.raises(ValueError, match="lse_window"):
        snapkv_scores(prompt.q[-4:], prompt.k_cache, prompt.page_table, 10, lse[-3:], SCALE, 5)
    with pytest.raises(ValueError, match="at least 3"):
        snapkv_scores(prompt.q[-4:], prompt.k_cache, prompt.page_table[:2], 10, lse[-4:], SCALE, 5)


def selected_by_loop(scores: Tensor, budget: int, window: int) -> list[list[int]]:
    """Per head: the window, plus the best earlier tokens by a full sort."""
    N = scores.shape[1]
    chosen = []
    for head in scores:
        ranked = torch.argsort(head[: N - window], descending=True)[: budget - window].tolist()
        chosen.append(sorted(ranked + list(range(N - window, N))))
    return chosen


def test_selection_keeps_each_heads_best_tokens_and_the_window_in_positional_order():
    gen = torch.Generator().manual_seed(3)
    scores = torch.rand(3, 40, generator=gen)  # distinct scores: one right answer per head
    scores[:, -6:] = -1.0  # the window scores lowest and is still kept

    kept = select_tokens(scores, budget=15, window=6)

    assert kept.dtype == torch.int64 and kept.shape == (3, 15)
    assert kept.tolist() == selected_by_loop(scores, 15, 6)
    assert (kept.diff(dim=-1) > 0).all(), "ascending, no repeats"
    assert (kept[:, -6:] == torch.arange(34, 40)).all()
    assert len({tuple(row) for row in kept.tolist()}) == 3, "each head picks its own tokens"


def test_selection_of_a_budget_no_larger_than_the_window_keeps_just_the_window():
    kept = select_tokens(torch.rand(2, 20), budget=5, window=5)

    assert kept.tolist() == [list(range(15, 20))] * 2


def test_selection_without_a_window_keeps_the_top_scores():
    scores = torch.tensor([[0.1, 0.9, 0.3, 0.8, 0.2], [0.7, 0.1, 0.2, 0.3, 0.6]])

    assert select_tokens(scores, budget=2, window=0).tolist() == [[1, 3], [0, 4]]


@pytest.mark.parametrize("budget", [20, 30])
def test_a_budget_covering_the_prompt_keeps_every_token(budget):
    kept = select_tokens(torch.rand(2, 20), budget=budget, window=8)

    assert kept.tolist() == [list(range(20))] * 2


def test_selection_rejects_a_budget_smaller_than_the_window():
    with pytest.raises(ValueError, match="raise the budget"):
        select_tokens(torch.rand(2, 20), budget=4, window=8)


def test_pyramid_budgets_shrink_with_depth_and_keep_the_total():
    budgets = pyramid_budgets(30, 3, 4000, 4, 32, "pyramid")

    assert budgets[:3] == [4000] * 3
    compressed = budgets[3:]
    assert sum(compressed) == 27 * 1000
    assert all(a > b for a, b in zip(compressed, compressed[1:])), compressed
    assert compressed[-1] >= 32 and compressed[0] <= 4000
    # PyramidKV's spread: the top layer keeps 1/20 of the average beyond the window.
    assert compressed[-1] == pytest.approx(32 + (1000 - 32) / 20, abs=1)


def test_uniform_budgets_share_the_total_equally():
    budgets = pyramid_budgets(24, 3, 2049, 4, 32, "uniform")

    assert budgets[:3] == [2049] * 3
    assert sum(budgets[3:]) == round(21 * 2049 / 4)
    assert max(budgets[3:]) - min(budgets[3:]) <= 1
    assert budgets[3:] == sorted(budgets[3:], reverse=True)


def test_a_mild_ratio_narrows_the_pyramid_so_no_layer_exceeds_the_prompt():
    budgets = pyramid_budgets(10, 2, 1000, 1.25, 32, "pyramid")

    compressed = budgets[2:]
    assert max(compressed) <= 1000 and min(compressed) >= 32
    assert sum(compressed) == 8 * 800
    assert compressed == sorted(compressed, reverse=True) and compressed[0] > compressed[-1]


@pytest.mark.parametrize("ratio", [0, 1])
@pytest.mark.parametrize("schedule", ["pyramid", "uniform"])
def test_ratio_zero_or_one_keeps_every_token_in_every_layer(ratio, schedule):
    assert pyramid_budgets(12, 3, 777, ratio, 32, schedule) == [777] * 12


@pytest.mark.parametrize("schedule", ["pyramid", "uniform"])
def test_a_short_prompt_keeps_the_window_in_every_compressed_layer(schedule):
    # 100 / 10 = 10 tokens on average, under the 32-token window.
    assert pyramid_budgets(6, 2, 100, 10, 32, schedule) == [100] * 2 + [32] * 4
    # A prompt shorter than the window keeps all of it.
    assert pyramid_budgets(6, 2, 20, 10, 32, schedule) == [20] * 6


def test_a_single_compressed_layer_gets_the_average():
    assert pyramid_budgets(4, 3, 1000, 4, 32, "pyramid") == [1000] * 3 + [250]
    assert pyramid_budgets(4, 4, 1000, 4, 32, "pyramid") == [1000] * 4


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(num_layers=0), "at least one layer"),
        (dict(full_layers=13), "use 0 to 12"),
        (dict(full_layers=-1), "use 0 to 12"),
        (dict(total_tokens=-5), "prompt length"),
        (dict(window=-1), "0 or more"),
        (dict(schedule="linear"), "'pyramid' .* or 'uniform'"),
        (dict(compression_ratio=-2), "ratio >= 1"),
        (dict(compression_ratio=0.25), "pass 4"),
    ],
)
def test_budgets_reject_bad_arguments_with_what_to_change(kwargs, message):
    args = dict(num_layers=12, full_layers=3, total_tokens=1000, compression_ratio=4, window=32, schedule="pyramid")
    with pytest.raises(ValueError, match=message):
        pyramid_budgets(**{**args, **kwargs})


def test_budgets_hold_their_invariants_across_many_models_and_prompts():
    rng = torch.Generator().manual_seed(7)
    for _ in range(300):
        num_layers = int(torch.randint(1, 40, (1,), generator=rng))
        full_layers = int(torch.randint(0, num_layers + 1, (1,), generator=rng))
        total, window = (
            int(torch.randint(0, 20000, (1,), generator=rng)),
            int(torch.randint(0, 64, (1,), generator=rng)),
        )
        ratio = 1 + 29 * float(torch.rand(1, generator=rng))
        for schedule in ("pyramid", "uniform"):
            budgets = pyramid_budgets(num_layers, full_layers, total, ratio, window, schedule)
            compressed = budgets[full_layers:]
            case = (num_layers, full_layers, total, ratio, window, schedule, budgets)
            assert len(budgets) == num_layers and budgets[:full_layers] == [total] * full_layers, case
            assert compressed == sorted(compressed, reverse=True), case
            assert all(min(window, total) <= b <= total for b in compressed), case
            if total / ratio > window:
                assert sum(compressed) == round(len(compressed) * total / ratio), case

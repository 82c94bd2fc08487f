"""The sampler picks tokens the way vLLM does, and a seed means the same thing in any batch."""

from __future__ import annotations

import pytest
import torch

from rayapp.engine.sampler import Sampler, make_generator
from rayapp.engine.sampling_params import SamplingParams

CPU = torch.device("cpu")
VOCAB = 64


def _logits(batch: int, vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, vocab, generator=torch.Generator().manual_seed(seed)) * 3.0


def _sample(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    return Sampler()(logits, params, [make_generator(p, CPU) for p in params])


def test_greedy_is_argmax_with_ties_to_lowest_id():
    logits = _logits(8)
    logits[0, [3, 7, 40]] = 100.0  # a three-way tie
    tokens = _sample(logits, [SamplingParams(temperature=0.0)] * 8)
    assert tokens.dtype == torch.int64
    assert torch.equal(tokens, logits.argmax(-1))
    assert tokens[0].item() == 3


def test_all_greedy_batch_draws_no_random_numbers():
    state = torch.get_rng_state()
    _sample(_logits(4), [SamplingParams(temperature=0.0)] * 4)
    assert torch.equal(torch.get_rng_state(), state)


def test_make_generator_only_for_seeded_sampled_requests():
    assert make_generator(SamplingParams(temperature=0.0, seed=1), CPU) is None
    assert make_generator(SamplingParams(temperature=1.0), CPU) is None
    gen = make_generator(SamplingParams(temperature=1.0, seed=1), CPU)
    assert gen is not None and gen.initial_seed() == 1


@pytest.mark.parametrize("temperature", [0.3, 1.0, 5.0])
def test_top_k_one_and_tiny_top_p_are_greedy(temperature):
    logits = _logits(32, seed=1)
    greedy = logits.argmax(-1)
    top_k = [SamplingParams(temperature=temperature, top_k=1)] * 32
    top_p = [SamplingParams(temperature=temperature, top_p=1e-6)] * 32
    assert torch.equal(_sample(logits, top_k), greedy)
    assert torch.equal(_sample(logits, top_p), greedy)


def test_greedy_rows_stay_greedy_in_a_sampled_batch():
    logits = _logits(6, seed=2)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=2.0, top_k=5)] * 3
    tokens = _sample(logits, params)
    assert torch.equal(tokens[0::2], logits[0::2].argmax(-1))


def test_sampled_tokens_stay_inside_the_top_k_set():
    row = _logits(1, seed=3)[0]
    draws = 4000
    tokens = _sample(row.expand(draws, VOCAB).clone(), [SamplingParams(temperature=2.0, top_k=5)] * draws)
    allowed = set(row.topk(5).indices.tolist())
    seen = set(tokens.tolist())
    assert seen <= allowed
    assert len(seen) == 5  # at temperature 2 every one of the five shows up in 4000 draws


def test_sampled_tokens_stay_inside_the_nucleus():
    row = _logits(1, seed=4)[0]
    top_p = 0.6
    probs, order = row.softmax(-1).sort(descending=True)
    # The nucleus: the fewest top tokens whose mass reaches top_p.
    size = int((probs.cumsum(-1) < top_p).sum().item()) + 1
    draws = 4000
    tokens = _sample(row.expand(draws, VOCAB).clone(), [SamplingParams(top_p=top_p)] * draws)
    assert set(tokens.tolist()) <= set(order[:size].tolist())


def test_top_k_and_top_p_combine():
    row = _logits(1, seed=5)[0]
    draws = 2000
    params = [SamplingParams(temperature=1.0, top_k=10, top_p=0.5)] * draws
    tokens = _sample(row.expand(draws, VOCAB).clone(), params)
    probs, order = row.topk(10).values.softmax(-1), row.topk(10).indices
    size = int((probs.cumsum(-1) < 0.5).sum().item()) + 1
    assert set(tokens.tolist()) <= set(order[:size].tolist())


def _run_seeded(row: torch.Tensor, target: SamplingParams, neighbours: list[SamplingParams], slot: int, steps: int):
    """Sample `steps` tokens for `target` sitting at `slot` among `neighbours`; return its tokens."""
    params = neighbours[:slot] + [target] + neighbours[slot:]
    generators = [make_generator(p, CPU) for p in params]
    sampler = Sampler()
    out = []
    for step in range(steps):
        logits = _logits(len(params), seed=100 + step)
        logits[slot] = row
        out.append(sampler(logits, params, generators)[slot].item())
    return out


def test_seed_reproduces_tokens_whatever_the_neighbours():
    row = _logits(1, seed=6)[0] / 3.0  # flat enough that different noise gives different tokens
    target = SamplingParams(temperature=1.0, seed=1234)
    alone = _run_seeded(row, target, [], slot=0, steps=20)
    # Neighbours that force the sort path, greedy ones, unseeded ones, other seeds.
    mixed = [
        SamplingParams(temperature=0.7, top_k=3),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, top_p=0.9, seed=7),
        SamplingParams(temperature=1.5),
    ]
    assert _run_seeded(row, target, mixed, slot=2, steps=20) == alone
    assert _run_seeded(row, target, mixed[::-1], slot=4, steps=20) == alone
    # A different seed gives a different stream (so the check above is not vacuous).
    assert _run_seeded(row, SamplingParams(temperature=1.0, seed=99), [], slot=0, steps=20) != alone


def test_seeded_top_k_reproduces_with_and_without_neighbours():
    row = _logits(1, seed=7)[0] / 3.0
    target = SamplingParams(temperature=0.8, top_k=20, top_p=0.95, seed=5)
    alone = _run_seeded(row, target, [], slot=0, steps=10)
    assert _run_seeded(row, target, [SamplingParams(), SamplingParams(temperature=0.0)], slot=1, steps=10) == alone


def _chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    expected = probs.double() * tokens.numel()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "drew a token with probability 0"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        (SamplingParams(temperature=1.0), lambda r: r.softmax(-1)),
        (SamplingParams(temperature=0.5), lambda r: (r / 0.5).softmax(-1)),
        (
            SamplingParams(temperature=1.0, top_k=3),
            lambda r: torch.where(r >= r.topk(3).values[-1], r, float("-inf")).softmax(-1),
        ),
    ],
)
def test_empirical_distribution_matches_softmax(params, expected):
    row = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0])
    draws = 20000
    logits = row.expand(draws, row.numel()).clone()
    with torch.random.fork_rng():
        torch.manual_seed(0)
        tokens = Sampler()(logits, [params] * draws, [None] * draws)
    # 7 degrees of freedom: p = 1e-6 sits near 40, so this fails only on a real bias.
    assert _chi_square(tokens, expected(row)) < 40.0


def test_seeded_rows_follow_the_distribution_too():
    row = torch.tensor([1.0, 0.0, -1.0, 0.5])
    draws = 4000
    params = [SamplingParams(temperature=1.0, seed=s) for s in range(draws)]
    tokens = _sample(row.expand(draws, 4).clone(), params)
    assert _chi_square(tokens, row.softmax(-1)) < 30.0  # 3 degrees of freedom: p = 1e-6 near 30

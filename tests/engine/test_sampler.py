"""The sampler picks tokens the way vLLM does, and a seed means the same thing in any batch."""

from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch

from rayapp.engine.logits_processors import apply_min_p, process_logits
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


# Logits processors (min_tokens, logit_bias, penalties, min_p), against per-row references written from vLLM's
# definitions.
EOS = 7


@dataclasses.dataclass
class _Seq:
    """A row's sequence, as the processors read it."""

    token_ids: list[int]
    num_prompt_tokens: int


def _history(prompt: list[int], output: list[int]) -> _Seq:
    return _Seq(prompt + output, len(prompt))


def _reference(row: torch.Tensor, p: SamplingParams, seq: _Seq) -> torch.Tensor:
    """vLLM's processors on one row, one token at a time."""
    x = row.clone()
    prompt, output = seq.token_ids[: seq.num_prompt_tokens], seq.token_ids[seq.num_prompt_tokens :]
    if len(output) < p.min_tokens:
        for t in set(p.stop_token_ids) | (set() if p.ignore_eos else {EOS}):
            x[t] = float("-inf")
    for t, bias in p.logit_bias:
        x[t] += bias
    for t in set(prompt) | set(output):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(output):
        x[t] -= p.frequency_penalty * output.count(t)
        x[t] -= p.presence_penalty
    return x


PROMPT, OUTPUT = [1, 2, 3, 3, 9, 40], [3, 9, 9, 12, 12, 12, 50]
PROCESSED = {
    "min_tokens": SamplingParams(temperature=0.0, min_tokens=10, stop_token_ids=(11,)),
    "min_tokens_ignore_eos": SamplingParams(min_tokens=10, stop_token_ids=(11,), ignore_eos=True),
    "min_tokens_reached": SamplingParams(min_tokens=len(OUTPUT), stop_token_ids=(11,)),
    "logit_bias": SamplingParams(logit_bias={5: 3.5, 9: -100.0, 63: 100.0}),
    "repetition": SamplingParams(temperature=0.0, repetition_penalty=1.7),
    "repetition_below_one": SamplingParams(repetition_penalty=0.6),
    "frequency": SamplingParams(frequency_penalty=0.8),
    "presence": SamplingParams(presence_penalty=-1.5),
    "all": SamplingParams(
        min_tokens=9, logit_bias={3: 2.0}, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=1.0
    ),
}


@pytest.mark.parametrize("name", PROCESSED)
def test_each_processor_matches_the_reference_and_leaves_plain_rows_bit_identical(name):
    params = [SamplingParams(), PROCESSED[name], SamplingParams(temperature=0.0), PROCESSED[name]]
    history = [_history(PROMPT, OUTPUT), _history(PROMPT, OUTPUT), _history(PROMPT, OUTPUT), _history([4], [])]
    logits = _logits(4, seed=8)
    out = process_logits(logits, params, history, {EOS})
    for i in (1, 3):
        torch.testing.assert_close(out[i], _reference(logits[i], params[i], history[i]), rtol=1e-6, atol=1e-6)
    assert torch.equal(out[[0, 2]], logits[[0, 2]])
    # The setting did something (so the check above is not vacuous), except past min_tokens.
    assert torch.equal(out[1], logits[1]) == (name == "min_tokens_reached")


def test_a_batch_that_asks_for_nothing_is_not_copied():
    logits = _logits(3)
    params = [SamplingParams(), SamplingParams(temperature=0.0, top_k=3), SamplingParams(min_p=0.2)]
    assert process_logits(logits, params, [], {EOS}) is logits


def test_min_tokens_holds_back_eos_and_stop_tokens_until_reached():
    logits = torch.zeros(1, VOCAB)
    logits[0, EOS], logits[0, 11], logits[0, 20] = 9.0, 8.0, 7.0
    sampler = Sampler(eos_token_ids={EOS})

    def greedy(output: list[int], **fields) -> int:
        params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=(11,), **fields)
        return sampler(logits.clone(), [params], [None], [_history([1, 2], output)]).item()

    assert greedy([]) == 20 and greedy([20, 20]) == 20
    assert greedy([20, 20, 20]) == EOS  # min_tokens reached: stops may come
    assert greedy([20], ignore_eos=True) == EOS  # ignore_eos: EOS is an ordinary token, not held back
    assert greedy([20], ignore_eos=True, logit_bias={EOS: -50.0}) == 20  # stop_token_ids stay held back


def test_min_tokens_gives_the_stop_tokens_back_to_a_row_left_with_nothing():
    logits = torch.full((2, VOCAB), float("-inf"))  # a grammar that now allows EOS only
    logits[:, EOS] = 1.0
    params = [SamplingParams(temperature=0.0, min_tokens=4)] * 2
    tokens = Sampler(eos_token_ids={EOS})(logits, params, [None] * 2, [_history([1], [])] * 2)
    assert tokens.tolist() == [EOS, EOS]


def test_logit_bias_forces_a_token_in_greedy_and_sampled_rows():
    params = [SamplingParams(temperature=0.0, logit_bias={42: 100.0}), SamplingParams(logit_bias={42: 100.0})]
    tokens = Sampler()(_logits(2, seed=9), params, [None] * 2, [_history([1], [])] * 2)
    assert tokens.tolist() == [42, 42]


def test_greedy_penalised_rows_take_the_argmax_of_the_penalised_logits():
    logits = _logits(3, seed=10)
    top = logits[1].argmax().item()
    penalised = SamplingParams(temperature=0.0, presence_penalty=2.0, frequency_penalty=2.0)
    params = [SamplingParams(temperature=0.0), penalised] * 2
    history = [_history([top], [top] * 4)] * 4
    tokens = Sampler()(torch.cat([logits, logits[:1]]), params, [None] * 4, history)
    expected = [_reference(row, p, h).argmax().item() for row, p, h in zip(logits, params, history)]
    assert tokens[:3].tolist() == expected and tokens[1].item() != top
    assert tokens[3].item() == logits[0].argmax().item()


def _min_p_reference(scaled: torch.Tensor, min_p: float) -> torch.Tensor:
    probs = scaled.softmax(-1)
    return torch.where(probs >= min_p * probs.max(), scaled, float("-inf"))


def test_min_p_matches_the_reference_and_leaves_zero_rows_bit_identical():
    scaled = _logits(3, seed=11)
    out = apply_min_p(scaled, torch.tensor([0.0, 0.1, 0.5]))
    assert torch.equal(out[0], scaled[0])
    for i, min_p in ((1, 0.1), (2, 0.5)):
        assert torch.equal(out[i], _min_p_reference(scaled[i], min_p))
    assert torch.isinf(out[2]).sum() > torch.isinf(out[1]).sum() > 0


def test_min_p_sampled_tokens_stay_above_the_threshold_after_temperature():
    row = _logits(1, seed=12)[0] / 2.0
    draws, temperature, min_p = 4000, 1.5, 0.3
    params = [SamplingParams(temperature=temperature, min_p=min_p)] * draws
    tokens = _sample(row.expand(draws, VOCAB).clone(), params)
    allowed = torch.isfinite(_min_p_reference(row / temperature, min_p)).nonzero().flatten().tolist()
    assert set(tokens.tolist()) <= set(allowed) and len(set(tokens.tolist())) > 1


def test_a_penalised_seeded_row_samples_the_same_whatever_its_neighbours():
    target = SamplingParams(temperature=1.0, seed=21, repetition_penalty=1.4, frequency_penalty=0.7, min_p=0.05)
    seq = _history(PROMPT, OUTPUT)

    def run(neighbours: list[SamplingParams]) -> list[int]:
        params = [*neighbours, target]
        generators = [make_generator(p, CPU) for p in params]
        history = [_history([5], [6, 6])] * len(neighbours) + [seq]
        out = []
        for step in range(10):
            logits = _logits(len(params), seed=200 + step)
            logits[-1] = _logits(1, seed=13)[0] / 3.0
            out.append(Sampler()(logits, params, generators, history)[-1].item())
        return out

    neighbours = [SamplingParams(temperature=0.0, presence_penalty=1.0), SamplingParams(logit_bias={1: 5.0})]
    assert run([]) == run(neighbours) == run([SamplingParams(min_tokens=5, min_p=0.5)])


@pytest.mark.parametrize(
    ("fields", "name"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3.0}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"min_p": 1.2}, "min_p"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"max_tokens": 4, "min_tokens": 5}, "min_tokens"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {3: float("nan")}}, "logit_bias"),
    ],
)
def test_bad_sampling_fields_name_themselves(fields, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**fields)


def test_logit_bias_is_stored_as_sorted_pairs_and_crosses_a_pipe():
    params = SamplingParams(logit_bias={9: 1.5, 2: -3})
    assert params.logit_bias == ((2, -3.0), (9, 1.5))
    assert SamplingParams(logit_bias=params.logit_bias) == params
    assert pickle.loads(pickle.dumps(params)) == params

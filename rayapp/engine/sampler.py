"""Picking the next token from logits: the logits processors, greedy, temperature, min-p, top-k, top-p, seeded
sampling (as vLLM)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

from rayapp.engine.logits_processors import TokenHistory, apply_min_p, process_logits
from rayapp.engine.outputs import TokenLogprob
from rayapp.engine.sampling_params import SamplingParams

# Temperatures below this are greedy, as in vLLM: dividing by them overflows float32 logits.
_SAMPLING_EPS = 1e-5


def _is_greedy(params: SamplingParams) -> bool:
    return params.temperature < _SAMPLING_EPS


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    """A generator seeded from params.seed for sampled requests with a seed; None otherwise (greedy or unseeded).

    Create it once per request and pass the same object every step: its state is the request's
    position in its random stream, which is what makes a seed reproducible.
    """
    if params.seed is None or _is_greedy(params):
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(params.seed)
    return generator


def _k(top_k: int, vocab: int) -> int:
    """top_k as a count in [1, V]; V means disabled (k <= 0 or k >= V keeps everything)."""
    return top_k if 0 < top_k < vocab else vocab


class Sampler:
    """Turns a batch of logits into next tokens, each row with its own sampling settings.

    Reproducibility contract: a seeded row's token depends only on its logits, its own settings and
    tokens, and its generator, never on its neighbours. So noise is always drawn in vocabulary order
    (one [V] draw per seeded row per step), and processors and filters only touch rows that asked
    for them.

    `eos_token_ids`: the model's EOS tokens, which `min_tokens` forbids (unless `ignore_eos`).
    """

    def __init__(self, eos_token_ids: Iterable[int] = ()) -> None:
        self.eos_token_ids = frozenset(eos_token_ids)

    def __call__(
        self,
        logits: Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        history: Sequence[TokenHistory] = (),
    ) -> Tensor:
        """logits: [B, V] float32 (one row per sequence) -> next token ids [B] int64 (same device).

        `history[i]`: row i's sequence, which min_tokens and the penalties read (may be empty when no row
        sets them).
        """
        batch, vocab = logits.shape
        if len(params) != batch or len(generators) != batch:
            raise ValueError(f"got {batch} logit rows, {len(params)} params and {len(generators)} generators")
        logits = process_logits(logits, params, history, self.eos_token_ids)
        greedy = [_is_greedy(p) for p in params]
        # argmax returns the first maximal index, so ties go to the lowest id, like Hugging Face.
        greedy_ids = logits.argmax(dim=-1)  # [B]
        if all(greedy):
            return greedy_ids

        device = logits.device
        # Greedy rows ride along with neutral settings (no filter); their sampled token is discarded.
        # One host-to-device copy per step for all per-row settings.
        rows = [
            (1.0, vocab, 1.0, 1.0, 0.0) if g else (p.temperature, _k(p.top_k, vocab), p.top_p, 0.0, p.min_p)
            for g, p in zip(greedy, params, strict=True)
        ]
        settings = torch.tensor(rows, dtype=torch.float64, device=device)  # settings: [B, 5]
        temperature = settings[:, 0].float()  # [B]
        scaled = logits.float() / temperature[:, None]  # scaled: [B, V]
        if any(row[4] > 0.0 for row in rows):
            scaled = apply_min_p(scaled, settings[:, 4].float())
        if any(k < vocab or p < 1.0 for _, k, p, _, _ in rows):
            scaled = _top_k_top_p(scaled, settings[:, 1].long(), settings[:, 2].float())
        probs = scaled.softmax(dim=-1)  # probs: [B, V]

        # Exponential race: argmax(p_i / E_i) with E_i ~ Exp(1) is an exact draw from p.
        noise = torch.empty_like(probs)  # noise: [B, V]
        seeded = [i for i, g in enumerate(generators) if g is not None and not greedy[i]]
        if len(seeded) < batch:
            noise.exponential_()
        for i in seeded:
            noise[i].exponential_(generator=generators[i])
        # An Exp(1) draw of exactly 0 would make 0/0 = NaN on a filtered token, and argmax picks NaN.
        noise.clamp_min_(torch.finfo(noise.dtype).tiny)
        sampled = (probs / noise).argmax(dim=-1)  # [B]
        return torch.where(settings[:, 3] > 0, greedy_ids, sampled)


def token_logprobs(logits: Tensor, token_ids: list[int], top: list[int]) -> list[TokenLogprob]:
    """Each row's chosen token's log-probability under log_softmax(logits), with the row's `top[i]` most likely
    tokens (logits: [B, V]; ties in the top go to the lower id, as torch.topk on CPU)."""
    logp = logits.float().log_softmax(dim=-1)  # [B, V]
    chosen = logp.gather(1, torch.tensor(token_ids, device=logp.device)[:, None])[:, 0].tolist()  # [B]
    k = max(top)
    values, ids = logp.topk(k, dim=-1) if k else (logp[:, :0], logp[:, :0].long())  # [B, k] each
    values, ids = values.tolist(), ids.tolist()
    return [
        TokenLogprob(t, c, tuple(zip(ids[i][: top[i]], values[i][: top[i]])))
        for i, (t, c) in enumerate(zip(token_ids, chosen))
    ]


def _top_k_top_p(scaled: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """Set logits outside each row's top-k set and top-p nucleus to -inf.

    scaled: [B, V]; top_k: [B] int64 in [1, V] (V disables); top_p: [B] in (0, 1] (1 disables).
    Rows with both disabled come back bit-identical.
    """
    vocab = scaled.shape[-1]
    device = scaled.device
    # Stable sort: a row's kept set at a tie never depends on the sort kernel or batch shape.
    sorted_logits, sorted_idx = scaled.sort(dim=-1, descending=True, stable=True)  # [B, V] each
    rank = torch.arange(vocab, device=device)  # rank: [V]
    remove = rank[None, :] >= top_k[:, None]  # remove: [B, V] in sorted order
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))

    sorted_probs = sorted_logits.softmax(dim=-1)  # [B, V]
    # Mass strictly before each token: the top token sees 0 < top_p, so it is always kept.
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # [B, V]
    # Rows with top_p == 1 are exempt: rounding can push the cumsum to 1.0 before the tail.
    remove_p = (mass_before >= top_p[:, None]) & (top_p < 1.0)[:, None]  # [B, V]
    sorted_logits = sorted_logits.masked_fill(remove_p, float("-inf"))

    # Back to vocabulary order, so the per-token noise means the same thing with or without a sort.
    return torch.empty_like(scaled).scatter_(-1, sorted_idx, sorted_logits)  # [B, V]

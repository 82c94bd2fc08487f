"""What changes the logits before a token is picked: min_tokens, logit_bias, the penalties and min_p, as vLLM v1.

Each processor works on the rows that ask for it only, with per-step tensors built for those rows, so a row
that asks for nothing comes back bit-identical and a batch where no row asks costs nothing.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from itertools import chain
from typing import Protocol

import torch
from torch import Tensor

from rayapp.engine.sampling_params import SamplingParams


class TokenHistory(Protocol):
    """What the processors read of a row's sequence (`rayapp.engine.sequence.Sequence` is one): its prompt's
    tokens, then its output's."""

    token_ids: list[int]
    num_prompt_tokens: int


def needs_processing(params: SamplingParams) -> bool:
    """Whether `process_logits` changes this row's logits (min_tokens, logit_bias or a penalty)."""
    return bool(params.min_tokens or params.logit_bias) or params.penalized


def process_logits(
    logits: Tensor, params: list[SamplingParams], history: Sequence[TokenHistory], eos_token_ids: Collection[int]
) -> Tensor:
    """vLLM v1's processors that can change the greedy token, in its order: min_tokens, logit_bias, then the
    repetition, frequency and presence penalties.

    logits: [B, V]; `history[i]` is row i's sequence. Returns `logits` itself when no row asks for any of them,
    else a float32 copy in which only the rows that ask differ.
    """
    if not any(needs_processing(p) for p in params):
        return logits
    if len(history) != len(params) and any(p.min_tokens or p.penalized for p in params):
        raise ValueError(f"min_tokens and the penalties read each row's history: got {len(history)} for {len(params)}")
    out = logits.float().clone()  # [B, V]; the caller's logits stay raw (logprobs are read from them, as vLLM's)
    _min_tokens(out, params, history, eos_token_ids)
    _logit_bias(out, params)
    _penalties(out, params, history)
    return out


def _min_tokens(
    logits: Tensor, params: list[SamplingParams], history: Sequence[TokenHistory], eos_token_ids: Collection[int]
) -> None:
    """Forbid the stop tokens (EOS unless ignore_eos, and stop_token_ids) of rows short of their min_tokens."""
    vocab, rows, slots, tokens = logits.shape[-1], [], [], []
    for i, p in enumerate(params):
        if not p.min_tokens or len(history[i].token_ids) - history[i].num_prompt_tokens >= p.min_tokens:
            continue
        stops = set(p.stop_token_ids) if p.ignore_eos else set(p.stop_token_ids) | set(eos_token_ids)
        stops = sorted(t for t in stops if t < vocab)
        slots += [len(rows)] * len(stops)
        rows.append(i)
        tokens += stops
    if not tokens:
        return
    device = logits.device
    index = (_ids(rows, device)[_ids(slots, device)], _ids(tokens, device))  # each [N]
    kept = logits[index]  # [N]
    logits.index_put_(index, torch.tensor(float("-inf"), device=device))
    # As vLLM: a row left with no token at all (a grammar that only allows EOS now) gets its stop tokens back.
    dead = torch.isneginf(logits[_ids(rows, device)]).all(dim=-1)  # [R]
    logits.index_put_(index, torch.where(dead[_ids(slots, device)], kept, float("-inf")))


def _logit_bias(logits: Tensor, params: list[SamplingParams]) -> None:
    rows = [i for i, p in enumerate(params) for _ in p.logit_bias]
    if not rows:
        return
    tokens = [t for p in params for t, _ in p.logit_bias]
    bias = torch.tensor([b for p in params for _, b in p.logit_bias], dtype=logits.dtype, device=logits.device)
    logits.index_put_((_ids(rows, logits.device), _ids(tokens, logits.device)), bias, accumulate=True)


def _penalties(logits: Tensor, params: list[SamplingParams], history: Sequence[TokenHistory]) -> None:
    """vLLM's repetition penalty over the tokens of the prompt and the output, then OpenAI's frequency and
    presence penalties over the output's, on the rows that set one."""
    rows = [i for i, p in enumerate(params) if p.penalized]
    if not rows:
        return
    device, vocab = logits.device, logits.shape[-1]
    seqs = [history[i] for i in rows]
    # Every row's tokens in one flat tensor: row r's token t counts in bin r * V + t.
    lengths = _ids([len(h.token_ids) for h in seqs], device)  # [R]
    ids = _ids(list(chain.from_iterable(h.token_ids for h in seqs)), device)  # [T]
    row_of = torch.repeat_interleave(torch.arange(len(rows), device=device), lengths)  # [T]
    starts = torch.cumsum(lengths, 0) - lengths  # [R]
    position = torch.arange(ids.numel(), device=device) - starts[row_of]  # [T]
    is_output = position >= _ids([h.num_prompt_tokens for h in seqs], device)[row_of]  # [T]
    bins = row_of * vocab + ids  # [T]
    seen = torch.bincount(bins, minlength=len(rows) * vocab).view(len(rows), vocab) > 0  # [R, V]
    counts = torch.bincount(bins[is_output], minlength=len(rows) * vocab).view(len(rows), vocab)  # [R, V]

    settings = torch.tensor(
        [(params[i].repetition_penalty, params[i].frequency_penalty, params[i].presence_penalty) for i in rows],
        dtype=torch.float32,
        device=device,
    )  # [R, 3]
    index = _ids(rows, device)
    x = logits[index]  # [R, V]
    # As vLLM's (its CPU op, bit for bit): positive logits divided by the penalty, the others multiplied.
    penalty = torch.where(seen, settings[:, 0:1], 1.0)  # [R, V]
    x *= torch.where(x > 0, 1.0 / penalty, penalty)
    x -= settings[:, 1:2] * counts
    x -= settings[:, 2:3] * (counts > 0)
    logits.index_copy_(0, index, x)


def apply_min_p(scaled: Tensor, min_p: Tensor) -> Tensor:
    """Set to -inf the tokens less likely than `min_p` times their row's most likely token (as vLLM, after
    temperature). scaled: [B, V]; min_p: [B] (0 leaves a row bit-identical)."""
    probs = scaled.softmax(dim=-1)  # [B, V]
    threshold = probs.amax(dim=-1, keepdim=True) * min_p[:, None]  # [B, 1]
    return scaled.masked_fill(probs < threshold, float("-inf"))


def _ids(values: list[int], device: torch.device) -> Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)

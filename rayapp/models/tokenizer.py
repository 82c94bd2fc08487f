"""Tokenizer and chat template, from the model directory (Hugging Face `tokenizers` underneath)."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

Message = dict[str, str]


def load_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(str(path))


def chat_token_ids(tokenizer: PreTrainedTokenizerBase, messages: list[Message]) -> list[int]:
    """Render a conversation with the model's chat template, ready for the assistant's turn."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"messages[{i}] must be a dict with string 'role' and 'content'")
    if tokenizer.chat_template is None:
        raise ValueError("this model has no chat template; use generate() with a plain prompt")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    return list(ids)

"""Tokenizer and chat template, from the model directory (Hugging Face `tokenizers` underneath)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase

Message = dict[str, Any]


def load_tokenizer(path: Path, chat_template: str | None = None) -> PreTrainedTokenizerBase:
    """The model's tokenizer; `chat_template`: a Jinja template file to render chats with instead of its own."""
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    if chat_template is not None:
        try:
            tokenizer.chat_template = Path(chat_template).read_text()
        except OSError as error:
            raise ValueError(f"chat_template {chat_template!r} cannot be read: {error.strerror}") from None
    return tokenizer


def chat_token_ids(
    tokenizer: PreTrainedTokenizerBase, messages: list[Message], tools: list[dict[str, Any]] | None = None
) -> list[int]:
    """Render a conversation (and the `tools` it may call) with the chat template, ready for the assistant's
    turn. Messages may carry more than role and content (`tool_calls`, `tool_call_id`) for the template."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"messages[{i}] must be a dict with string 'role' and 'content'")
    if tokenizer.chat_template is None:
        raise ValueError("this model has no chat template; use generate() with a plain prompt")
    ids = tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    return list(ids)

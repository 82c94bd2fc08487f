"""rayapp: LLM serving for long, multi-turn chat.

The public names load lazily, so a light import (`rayapp.blocks` in a router) does
not pull in torch and transformers.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "LLM": "rayapp.llm",
    "AsyncLLMEngine": "rayapp.drivers.async_engine",
    "LLMEngine": "rayapp.engine.llm_engine",
    "CompletionOutput": "rayapp.engine.outputs",
    "RequestOutput": "rayapp.engine.outputs",
    "SamplingParams": "rayapp.engine.sampling_params",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'rayapp' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)

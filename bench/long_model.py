"""The shipped SmolLM2 with its positions stretched past 8K, for speed runs at long contexts
(`bench/sparse_attention.py`, `bench/sparse_vllm.py`, `bench/device_check.sh`)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from rayapp.models.loader import prepare_default_model


def long_model_dir(max_len: int) -> Path:
    """The shipped SmolLM2's weights with the position table stretched to `max_len` (RoPE extends;
    the outputs past 8K are meaningless, the work per token is the real model's)."""
    src = prepare_default_model()
    dst = Path(tempfile.mkdtemp(prefix="rayapp-long-"))
    for f in src.iterdir():
        if f.name != "config.json":
            (dst / f.name).symlink_to(f)
    config = json.loads((src / "config.json").read_text())
    config["max_position_embeddings"] = max_len
    (dst / "config.json").write_text(json.dumps(config))
    return dst

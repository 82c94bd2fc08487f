"""Finding weights (a shipped GGUF, a user's GGUF, a local Hugging Face directory or a Hugging Face repo
id) and reading what the two engines need of them: `ModelInfo` (any architecture, for the ingress and
vLLM replicas) and `ModelSpec` (the architectures rayapp's own engine runs)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from rayapp.models import hub
from rayapp.models.gguf import SHIPPED, convert_gguf, prepare_shipped, shipped, user_gguf_dir

DEFAULT_MODEL = SHIPPED[0].name
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
# Config keys that bound a model's context, as vLLM reads them (the smallest present wins).
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_sequence_length")


def _text_config(path: Path) -> dict:
    """config.json, or its `text_config` for a model that wraps a language model (Gemma 3, Llava, ...)."""
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"model at {path}: config.json cannot be read: {error}") from None
    return {**cfg, **cfg.get("text_config", {})}


@dataclass(frozen=True)
class ModelInfo:
    """What serving any model needs besides its tokenizer, whatever its architecture."""

    architecture: str
    context_length: int
    vocab_size: int

    @classmethod
    def from_dir(cls, path: Path) -> ModelInfo:
        cfg = _text_config(path)
        lengths = [cfg[k] for k in _CONTEXT_KEYS if isinstance(cfg.get(k), int)]
        if not lengths or "vocab_size" not in cfg:
            raise ValueError(f"model at {path}: config.json names no context length or vocab_size")
        return cls((cfg.get("architectures") or ["unknown"])[0], min(lengths), cfg["vocab_size"])


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
    qk_norm: bool
    eos_token_ids: tuple[int, ...]
    dtype: torch.dtype

    @classmethod
    def from_dir(cls, path: Path) -> ModelSpec:
        cfg = _text_config(path)
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"model at {path} is {'/'.join(archs) or 'of no named architecture'}: rayapp's engine runs "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}; set engine: vllm, which serves it"
            )
        if cfg.get("use_sliding_window"):
            raise ValueError(
                f"model at {path} uses sliding-window attention, which rayapp's engine does not run; set engine: vllm"
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
            # Qwen3 normalizes each head's query and key before RoPE.
            qk_norm=arch == "Qwen3ForCausalLM",
            eos_token_ids=eos_ids,
            dtype=getattr(torch, cfg.get("dtype") or cfg.get("torch_dtype") or "float32"),
        )


def resolve_model(model: str | None, revision: str | None = None, weights: bool = True) -> Path:
    """The Hugging Face directory of a `model` setting: None or a shipped name (its GGUF prepared once), a
    `.gguf` file (converted once), a local directory with a config.json, or a Hugging Face repo id at
    `revision` (from the Hugging Face cache, downloaded if missing; `weights`: with the weights, not only
    the tokenizer and config)."""
    ship = shipped(model or DEFAULT_MODEL)
    if ship is not None:
        return prepare_shipped(ship)
    path = Path(model).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"model={model!r} is a file but not a .gguf; pass a GGUF file or a model directory")
        return convert_gguf(path, user_gguf_dir(path))
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model={model!r} is a directory without a config.json; pass a Hugging Face model folder")
        return path
    if hub.is_repo_id(model):
        return hub.snapshot(model, revision, weights)
    raise ValueError(
        f"model={model!r} does not exist here and is not a Hugging Face repo id ('org/name'); pass a model "
        f"directory, a .gguf file, a repo id, or a shipped model ({', '.join(m.name for m in SHIPPED)})"
    )


def pin_revision(model: str | None, revision: str | None) -> str | None:
    """The commit a repo id's `revision` names now, so every replica loads the same files; None for others."""
    if model is None or shipped(model) is not None or Path(model).expanduser().exists() or not hub.is_repo_id(model):
        return revision
    return hub.pin(model, revision)


def model_id(model: str | None, revision: str | None) -> str:
    """The model's identity in block hashes: every replica and the ingress must agree on it."""
    name = model or DEFAULT_MODEL
    return name if revision is None else f"{name}@{revision}"


def served_name(model: str | None) -> str:
    """The name clients send by default: a shipped model's or repo id's name, else the file or folder name."""
    ship = shipped(model or DEFAULT_MODEL)
    if ship is not None:
        return ship.name
    path = Path(model).expanduser()
    if not path.exists() and hub.is_repo_id(model):
        return model
    return path.stem if path.suffix == ".gguf" else path.name


def prepare_default_model() -> Path:
    """The shipped SmolLM2-135M-Instruct's directory, converted from its GGUF on first use."""
    return prepare_shipped(SHIPPED[0])


def load_state_dict(path: Path, dtype: torch.dtype, device: str) -> dict[str, torch.Tensor]:
    """Read every safetensors shard of a directory, cast to `dtype`, placed on `device`."""
    state: dict[str, torch.Tensor] = {}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(
            f"model at {path} has no *.safetensors files, which rayapp's engine reads; "
            "engine: vllm also reads other formats"
        )
    for file in tqdm(files, desc="Loading weights", disable=len(files) < 2):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                state[name] = f.get_tensor(name).to(dtype=dtype, device=device)
    return state

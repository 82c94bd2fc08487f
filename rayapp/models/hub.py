"""Models named by a Hugging Face repo id (`Qwen/Qwen3-8B`), resolved through the standard Hugging Face
cache: `HF_HOME` says where it is, `HF_TOKEN` opens gated models, `HF_HUB_OFFLINE=1` reads a filled cache
without the network.

The application pins a repo id to one commit when it is built (`pin`), and every replica downloads that
commit (`snapshot`), so all of them run the same files even if the repo moves on meanwhile.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

# A repo id as the Hub writes it: `org/name`, letters, digits and `-_.`.
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
# What the tokenizer, the chat template and the config need; the weights come on top where they are read.
METADATA = ["*.json", "*.jinja", "tokenizer*", "*.model", "*.tiktoken", "*.txt"]


def is_repo_id(model: str) -> bool:
    return _REPO_ID.fullmatch(model) is not None and ".." not in model


def _offline() -> bool:
    # Read at each call, not at import as huggingface_hub does: a replica's environment may set it later.
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _download(repo_id: str, revision: str | None, patterns: list[str]) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    at = f"{repo_id!r}" + ("" if revision is None else f" at revision {revision!r}")
    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=patterns, local_files_only=_offline()))
    except GatedRepoError:
        raise ValueError(f"model={at} is gated: accept its license on huggingface.co and set HF_TOKEN") from None
    except (RepositoryNotFoundError, RevisionNotFoundError) as error:
        raise ValueError(f"model={at} was not found on the Hugging Face Hub ({type(error).__name__})") from None
    except LocalEntryNotFoundError:
        raise ValueError(
            f"model={at} cannot be resolved offline: the Hugging Face cache ({_cache_dir()}) does not hold it. "
            f"Fill it once where the Hub is reachable (`hf download {repo_id}`), or pass a local directory"
        ) from None
    except (HfHubHTTPError, OSError) as error:
        raise ValueError(f"model={at} cannot be downloaded: {error}") from None


def _cache_dir() -> str:
    from huggingface_hub.constants import HF_HUB_CACHE

    return HF_HUB_CACHE


def pin(repo_id: str, revision: str | None) -> str:
    """The commit `revision` (a branch, tag or commit; None: the default branch) of `repo_id` names now.
    Only the small metadata files are fetched."""
    return _download(repo_id, revision, METADATA).name


def snapshot(repo_id: str, revision: str | None, weights: bool = True) -> Path:
    """The local snapshot directory of `repo_id` at `revision`, downloaded into the cache if missing;
    `weights`: with the safetensors weights (else pytorch .bin ones when the repo has no safetensors)."""
    path = _download(repo_id, revision, METADATA)
    if not weights:
        return path
    path = _download(repo_id, path.name, [*METADATA, "*.safetensors"])
    if not list(path.glob("*.safetensors")):
        path = _download(repo_id, path.name, [*METADATA, "*.bin"])
    return path

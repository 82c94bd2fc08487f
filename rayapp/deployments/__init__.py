"""Serve deployments: the OpenAI ingress, `LLMReplica`, and the app builder."""

import sys

# `serve run` imports the application in the Ray cluster's workers, not in its own Python: a cluster left running
# from another environment (another application's `ray start`) imports rayapp without its dependencies.
try:
    import fastapi  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401
except ImportError as error:
    raise ImportError(
        f"rayapp's application is imported by {sys.executable}, which lacks {error.name}: the Ray cluster `serve "
        "run` joined runs another Python environment (a cluster left by `ray start` there, say). Stop it (`ray "
        "stop` in that environment), or give rayapp a cluster of its own (`serve run --address local "
        "rayapp.config.yaml`), or install rayapp[serve] in that environment"
    ) from error

from rayapp.deployments.builder import build_app  # noqa: E402

__all__ = ["build_app"]

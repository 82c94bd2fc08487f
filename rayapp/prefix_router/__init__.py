"""Global prefix routing: the PrefixIndex of which replica holds which KV blocks, its actor, and the
Serve request router that uses it (`rayapp.prefix_router:PrefixAwareRouter`, loaded lazily so the
index can be used without Ray Serve)."""

from __future__ import annotations

from typing import Any

__all__ = ["PrefixAwareRouter"]


def __getattr__(name: str) -> Any:
    if name == "PrefixAwareRouter":
        from rayapp.prefix_router.router import PrefixAwareRouter

        return PrefixAwareRouter
    raise AttributeError(f"module 'rayapp.prefix_router' has no attribute {name!r}")

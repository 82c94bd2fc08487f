"""Serve deployments: the OpenAI ingress, `LLMReplica`, and the app builder."""

from rayapp.deployments.builder import build_app

__all__ = ["build_app"]

"""A real Serve application on this machine, one per test module."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import ray
from ray import serve

from rayapp.config import AppConfig
from rayapp.deployments.builder import build


@contextmanager
def _serve_app(config: AppConfig) -> Iterator[str]:
    """Start a local Ray and Serve, deploy `build(config)` as application "rayapp"; yield its base URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ray.init(address="local", num_cpus=2, include_dashboard=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        serve.run(build(config), name="rayapp", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


@pytest.fixture(scope="session")
def serve_app():
    """`with serve_app(config) as base_url:` a running application of `config` (module fixtures use it)."""
    return _serve_app

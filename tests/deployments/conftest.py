"""A real Serve application on this machine, one per test module."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import ray
import scripted
from ray import serve

from rayapp.config import AppConfig
from rayapp.deployments.builder import build

# The scripted backend is a module of the tests, which Ray's workers cannot import: it travels by value.
ray.cloudpickle.register_pickle_by_value(scripted)


@contextmanager
def _serve_app(
    free_port: Callable[[], int],
    config: AppConfig,
    apps: dict[str, str] | None = None,
    env: dict[str, str] | None = None,
    backend_cls: type | None = None,
) -> Iterator[str]:
    """Start a local Ray and Serve, deploy `build(config)` under each application name of `apps` at its route
    prefix (by default "rayapp" at "/"); yield the base URL. `env`: environment variables of every Ray worker;
    `backend_cls`: the replicas' engine backend instead of `config.engine`'s (`scripted.ScriptedBackend`)."""
    port = free_port()
    runtime_env = {"env_vars": env} if env else None
    ray.init(address="local", num_cpus=2, include_dashboard=False, runtime_env=runtime_env)
    try:  # Ray goes down whatever fails, or every later module's ray.init fails too
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        for name, route_prefix in (apps or {"rayapp": "/"}).items():
            serve.run(build(config, backend_cls, app_name=name), name=name, route_prefix=route_prefix)
        yield f"http://127.0.0.1:{port}"
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


@pytest.fixture(scope="session")
def serve_app(free_port):
    """`with serve_app(config[, apps]) as base_url:` running applications of `config` (module fixtures use it)."""
    return functools.partial(_serve_app, free_port)

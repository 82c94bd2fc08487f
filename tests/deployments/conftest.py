"""A real Serve application on this machine, one per test module."""

from __future__ import annotations

import random
import socket
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import ray
import scripted
from ray import serve

from rayapp.config import AppConfig
from rayapp.deployments.builder import build

# The scripted backend is a module of the tests, which Ray's workers cannot import: it travels by value.
ray.cloudpickle.register_pickle_by_value(scripted)

# Ray's workers listen on 10002-19999 (its default worker ports), and its other processes on ports the kernel hands
# out (32768 and up on Linux): a port between the two is still free when Serve's proxy binds it after Ray started.
# (A port the kernel handed out to the test was once taken by one of Ray's processes first: the proxy never bound.)
_PROXY_PORTS = range(20000, 32768)


def _free_port() -> int:
    for port in random.sample(_PROXY_PORTS, 100):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port in {_PROXY_PORTS}")


@contextmanager
def _serve_app(
    config: AppConfig,
    apps: dict[str, str] | None = None,
    env: dict[str, str] | None = None,
    backend_cls: type | None = None,
) -> Iterator[str]:
    """Start a local Ray and Serve, deploy `build(config)` under each application name of `apps` at its route
    prefix (by default "rayapp" at "/"); yield the base URL. `env`: environment variables of every Ray worker;
    `backend_cls`: the replicas' engine backend instead of `config.engine`'s (`scripted.ScriptedBackend`)."""
    port = _free_port()
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
def serve_app():
    """`with serve_app(config[, apps]) as base_url:` running applications of `config` (module fixtures use it)."""
    return _serve_app

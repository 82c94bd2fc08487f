"""The servers `bench/serve_multiturn.py` compares, one at a time: each system's command and environment, the server
started with a tag in its environment, and stopped with every process it started (found by that tag, which is
also how the CPU they spend is counted).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from chat_workloads import Workload

REPO = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = "SmolLM2-135M-Instruct"
# rayapp runs from the venv that runs this script.
RAYAPP_VENV = Path(sys.prefix)
TAG_VAR = "SERVE_MULTITURN_TAG"  # set in each server's environment; inherited by every process it starts
# Ray Serve LLM's app, run by the python of the venv that serves it (the anchor's, or rayapp's for rayapp-ray-llm).
ANCHOR_APP = Path(__file__).resolve().with_name("anchor_app.py")
# KV page size of each system (what a turn's reusable tokens are rounded to): vLLM's CPU default, rayapp's default.
PAGES = {
    "rayapp-vllm": 128, "rayapp": 16, "rayapp-offline": 16, "rayapp-long": 16, "rayapp-long-dense": 16, "anchor": 128,
    "anchor-kv": 128, "rayapp-ray-llm": 128,
}  # fmt: skip
# The config each rayapp system serves: rayapp.config.yaml, or for the long-documents systems the example for a
# long-context model (sparse retrieval and the tier on; `rayapp-long-dense` with sparse off).
LONG_EXAMPLE = REPO / "examples" / "long-context.config.yaml"
RAY_BUILDER = "ray.serve.llm:build_openai_app"
RAYAPP_BUILDER = "rayapp.integrations.ray_serve_llm:build_openai_app"
# Ray Serve LLM's request router at two replicas, per anchor system: its text prefix tree, and its router fed by
# the engines' KV events (Dynamo's selection service; `ai-dynamo-runtime` in the anchor's venv).
ANCHOR_ROUTERS = {
    "anchor": "ray.serve.llm.request_router:PrefixCacheAffinityRouter",
    "anchor-kv": "ray.serve.llm.request_router:KVAwareRouter",
}


@dataclass(frozen=True)
class ServerSpec:
    name: str
    command: list[str]
    cwd: Path
    venv: Path
    port: int
    env: dict[str, str]


def app_config(name: str, workload: Workload, kvtier: bool = True, model: str = DEFAULT_MODEL) -> dict:
    """rayapp.config.yaml (the long-context example for `rayapp-long*`) with the engine of system `name`, the replicas
    of `workload` and `model` (and the cluster tier off unless `kvtier`)."""
    import yaml  # a Ray dependency, present wherever rayapp is installed

    long = name.startswith("rayapp-long")
    config = yaml.safe_load((LONG_EXAMPLE if long else REPO / "rayapp.config.yaml").read_text())
    args = config["applications"][0]["args"]
    args["engine"] = "vllm" if name == "rayapp-vllm" else "rayapp"
    if name == "rayapp-long-dense":
        args["sparse"] = {"enabled": False}
    if model != DEFAULT_MODEL or long:
        args["model"] = model
    if not kvtier:
        args["kvtier"] = {"enabled": False}
    args["replicas"] = workload.replicas
    args["num_cpus"] = 1 / workload.replicas
    return config


def server_spec(system: str, port: int, args: argparse.Namespace, work_dir: Path, workload: Workload) -> ServerSpec:
    """How system `system` (any of `PAGES` but rayapp-offline) serves `workload` on `port`."""
    if system in ANCHOR_ROUTERS:
        return _anchor_spec(system, port, args, work_dir, workload)
    if system == "rayapp-ray-llm":
        return _ray_llm_spec(port, args, work_dir, workload)
    return _rayapp_spec(system, port, work_dir, workload, args)


def _rayapp_spec(name: str, port: int, work_dir: Path, workload: Workload, args: argparse.Namespace) -> ServerSpec:
    """`serve run` on a copy of rayapp.config.yaml that differs only in the HTTP port, the engine, the replicas and
    the model (and the cluster tier, with `--no-kvtier`)."""
    import yaml

    config = app_config(name, workload, args.kvtier, args.model)
    config["http_options"]["port"] = port
    config_path = work_dir / f"{name}-{workload.name}.config.yaml"
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    command = [str(RAYAPP_VENV / "bin/serve"), "run", str(config_path)]
    env = {"RAY_SERVE_ENABLE_HA_PROXY": "1"} if args.haproxy else {}
    return ServerSpec(name, command, REPO, RAYAPP_VENV, port, env)


def _anchor_app(venv: Path, port: int, args: argparse.Namespace, workload: Workload) -> list[str]:
    """`bench/anchor_app.py`'s command up to its router and builder, run by `venv`'s python."""
    return [
        str(venv / "bin/python"), str(ANCHOR_APP), str(port), str(args.model_dir), args.served,
        str(workload.max_model_len), str(workload.replicas),
    ]  # fmt: skip


def _anchor_spec(name: str, port: int, args: argparse.Namespace, work_dir: Path, workload: Workload) -> ServerSpec:
    command = _anchor_app(args.anchor_venv, port, args, workload)
    # Direct streaming makes the LLM server the ingress itself; Serve needs its HAProxy ingress for that.
    env = (
        {"RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING": "1", "RAY_SERVE_ENABLE_HA_PROXY": "1"}
        if args.direct_streaming
        else {}
    )
    return ServerSpec(
        name, [*command, ANCHOR_ROUTERS[name], RAY_BUILDER], work_dir, args.anchor_venv,
        port, env,
    )  # fmt: skip


def _ray_llm_spec(port: int, args: argparse.Namespace, work_dir: Path, workload: Workload) -> ServerSpec:
    """The anchor's config served by rayapp's builder, in rayapp's venv."""
    command = _anchor_app(RAYAPP_VENV, port, args, workload)
    env = {"RAY_SERVE_ENABLE_HA_PROXY": "1"} if args.haproxy else {}
    return ServerSpec("rayapp-ray-llm", [*command, "", RAYAPP_BUILDER], work_dir, RAYAPP_VENV, port, env)


def start_server(spec: ServerSpec, tag: str, log: IO[bytes]) -> subprocess.Popen:
    """Start `spec`'s server in a session of its own, its output to `log`, `tag` in its environment."""
    path = f"{spec.venv / 'bin'}:{os.environ.get('PATH', '')}"
    env = {**os.environ, **spec.env, "HF_HUB_OFFLINE": "1", "PATH": path, TAG_VAR: tag}
    env.pop("VIRTUAL_ENV", None)
    env.pop("PYTHONPATH", None)
    return subprocess.Popen(
        spec.command, cwd=spec.cwd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )


def _tagged(tag: str) -> set[int]:
    """Live processes whose environment carries `tag`: everything a server started, however Ray reparented it."""
    needle = f"{TAG_VAR}={tag}".encode()
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes()
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and needle in environ.split(b"\0"):
            found.add(int(entry))
    return found


def cpu_seconds(tag: str) -> dict[int, tuple[str, float]]:
    """CPU seconds (user + system) so far of each process carrying `tag`, with its name (`comm`)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for pid in _tagged(tag):
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            name = Path(f"/proc/{pid}/comm").read_text().strip()
            out[pid] = (name, (int(fields[11]) + int(fields[12])) / tick)
    return out


def cpu_breakdown(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> str:
    """CPU seconds spent between two `cpu_seconds`, summed by process name, largest first."""
    spent: dict[str, float] = {}
    for pid, (name, seconds) in after.items():
        spent[name] = spent.get(name, 0.0) + seconds - before.get(pid, (name, 0.0))[1]
    top = sorted(spent.items(), key=lambda kv: -kv[1])
    return ", ".join(f"{name} {seconds:.1f}" for name, seconds in top if seconds >= 0.1)


def _signal_all(pids: set[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def stop_server(server: subprocess.Popen, tag: str) -> None:
    """Stop one server and every process it started, found by the tag in their environment.

    Ray workers get process groups of their own, and vllm's EngineCore outlives a worker that dies first, so
    neither the process group nor the process tree finds them all. No `ray stop --force` either: it kills
    every Ray cluster on the host, including other people's.
    """
    if server.poll() is None:
        server.send_signal(signal.SIGINT)  # both servers shut Serve and Ray down on Ctrl-C
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.wait(timeout=30)
    deadline = time.monotonic() + 15
    while (left := _tagged(tag)) and time.monotonic() < deadline:
        _signal_all(left, signal.SIGTERM)
        time.sleep(1.0)
    _signal_all(_tagged(tag), signal.SIGKILL)
    server.wait()


def port_in_use(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def wait_idle(limit_s: float = 60.0) -> None:
    """Wait (bounded) until the host's CPUs are mostly idle, so a server's leftovers do not slow the next one."""

    def busy_idle() -> tuple[int, int]:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
        return sum(fields) - fields[3] - fields[4], fields[3] + fields[4]

    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        busy0, idle0 = busy_idle()
        time.sleep(2.0)
        busy1, idle1 = busy_idle()
        if (idle1 - idle0) / max(1, busy1 - busy0 + idle1 - idle0) > 0.9:
            return

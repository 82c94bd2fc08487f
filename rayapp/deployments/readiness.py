"""Why an application does not answer yet: Serve's status of its deployments, for `/health`'s 503 body.

A replica whose engine cannot start (a dtype this CPU cannot run, a model that does not load) fails its
constructor; Serve retries it a bounded number of times (`RAY_SERVE_MAX_PER_REPLICA_RETRY_COUNT`, 3 per
replica) and then marks the deployment DEPLOY_FAILED with the constructor's traceback as its message. A
replica still loading is UPDATING; one Ray cannot place says which resources it waits for.
"""

from __future__ import annotations

import asyncio
from typing import Any

from ray import serve

# Seconds `/health` waits for Serve's controller before saying it could not ask.
STATUS_TIMEOUT_S = 5.0


def _error_line(message: str) -> str:
    """The exception a traceback ends with (`RuntimeError: ...`), or "" where the message holds none."""
    if "Traceback" not in message:
        return ""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


def describe_deployments(deployments: dict[str, Any]) -> list[dict[str, str]]:
    """One entry per deployment that is not HEALTHY: its name, Serve's status, Serve's summary (the
    message's first line) and, where the message holds a traceback, the error it ended with."""
    waiting = []
    for name, overview in deployments.items():
        status = str(getattr(overview.status, "value", overview.status))  # Serve's DeploymentStatus enum
        if status == "HEALTHY":
            continue
        message = overview.message or ""
        entry = {"deployment": name, "status": status, "message": message.strip().split("\n")[0]}
        error = _error_line(message)
        if error:
            entry["error"] = error
        waiting.append(entry)
    return waiting


async def not_ready(app_name: str) -> list[dict[str, str]]:
    """The deployments of `app_name` that are not HEALTHY, as `describe_deployments` gives them."""
    try:
        # serve.status() blocks on the controller: kept off the event loop.
        status = await asyncio.wait_for(asyncio.to_thread(serve.status), timeout=STATUS_TIMEOUT_S)
    except Exception as error:
        return [{"deployment": "*", "status": "UNKNOWN", "message": f"Serve's status could not be read: {error!r}"}]
    application = status.applications.get(app_name)
    if application is None:
        return [{"deployment": "*", "status": "UNKNOWN", "message": f"Serve has no application {app_name!r}"}]
    return describe_deployments(application.deployments)

"""Why an application does not answer yet: Serve's status of its deployments, for `/health`'s 503 body.

A replica whose engine cannot start (a dtype this CPU cannot run, a model that does not load) fails its
constructor; Serve retries it a bounded number of times (`RAY_SERVE_MAX_PER_REPLICA_RETRY_COUNT`, 3 per
replica) and then marks the deployment DEPLOY_FAILED with the constructor's traceback as its message. A
replica still loading is UPDATING; one Ray cannot place says which resources it waits for.

The same entries reach the log: `report_until_ready` writes what the application waits for every
`REPORT_PERIOD_S` until it answers, so the output of `serve run` says why `/health` still answers 503.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from ray import serve

logger = logging.getLogger(__name__)

# Seconds `/health` waits for Serve's controller before saying it could not ask.
STATUS_TIMEOUT_S = 5.0
# How often a starting application says in the log what it waits for (at least once a minute, as asked of it).
REPORT_PERIOD_S = 30.0


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


def describe_waiting(waiting: list[dict[str, str]]) -> str:
    """The entries of `describe_deployments` on one line: `deployment STATUS: message (error)`, `; `-joined."""
    parts = []
    for entry in waiting:
        part = f"{entry['deployment']} {entry['status']}: {entry['message'] or 'no message from Serve yet'}"
        parts.append(f"{part} ({entry['error']})" if "error" in entry else part)
    return "; ".join(parts)


async def report_until_ready(
    waiting_for: Callable[[], Awaitable[list[dict[str, str]]]], period_s: float = REPORT_PERIOD_S
) -> None:
    """Log what `waiting_for()` names every `period_s` until it names nothing, then that the application is ready.

    Runs beside the ingress from its start; a failed deployment keeps being reported (Serve does not retry it)."""
    start = time.monotonic()
    while True:
        await asyncio.sleep(period_s)
        waiting = await waiting_for()
        elapsed = time.monotonic() - start
        if not waiting:
            logger.info("rayapp answers: every deployment is ready, %.0f s after the ingress started", elapsed)
            return
        logger.warning(
            "rayapp does not answer yet (%.0f s after the ingress started; /health answers 503): waiting for %s",
            elapsed, describe_waiting(waiting),
        )  # fmt: skip

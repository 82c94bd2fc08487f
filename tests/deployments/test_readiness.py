"""`/health`'s 503 body: what each deployment that is not healthy waits for, from Serve's own status, and the
same in the log until the application answers."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
from types import SimpleNamespace

from rayapp.deployments.readiness import describe_deployments, report_until_ready

FAILED = (
    "The deployment failed to start 3 times in a row. This may be due to a problem with its constructor or initial "
    "health check failing. See controller logs for details. Error:\n"
    "Traceback (most recent call last):\n"
    '  File "rayapp/deployments/replica.py", line 41, in __init__\n'
    "    self.engine = backend_cls.from_app_config(self.config)\n"
    "RuntimeError: rayapp's engine did not start: ValueError: dtype: bfloat16 needs a CPU where oneDNN runs bf16\n"
)
PENDING = (
    "Deployment 'LLMReplica' in application 'rayapp' has 1 replicas that have taken more than 30s to be scheduled. "
    'Resources required for each replica: {"CPU": 1}, total resources available: {}.'
)


def test_a_failed_start_reports_serves_summary_and_the_error_it_ended_with():
    deployments = {
        "OpenAIIngress": SimpleNamespace(status="HEALTHY", message=""),
        "LLMReplica": SimpleNamespace(status="DEPLOY_FAILED", message=FAILED),
    }
    (entry,) = describe_deployments(deployments)
    assert entry["deployment"] == "LLMReplica" and entry["status"] == "DEPLOY_FAILED"
    assert entry["message"].startswith("The deployment failed to start 3 times in a row.")
    assert entry["error"] == (
        "RuntimeError: rayapp's engine did not start: ValueError: dtype: bfloat16 needs a CPU where oneDNN runs bf16"
    )


def test_a_replica_waiting_for_resources_says_which_and_carries_no_error():
    (entry,) = describe_deployments({"LLMReplica": SimpleNamespace(status="UPDATING", message=PENDING)})
    assert entry == {"deployment": "LLMReplica", "status": "UPDATING", "message": PENDING}


def test_healthy_deployments_wait_for_nothing():
    assert describe_deployments({"LLMReplica": SimpleNamespace(status="HEALTHY", message="")}) == []


def test_a_starting_application_says_in_the_log_what_it_waits_for_until_it_answers(caplog):
    pending = describe_deployments({"LLMReplica": SimpleNamespace(status="UPDATING", message=PENDING)})
    failed = describe_deployments({"LLMReplica": SimpleNamespace(status="DEPLOY_FAILED", message=FAILED)})
    answers = iter([pending, failed, []])

    async def waiting_for():
        return next(answers)

    with caplog.at_level(logging.INFO, logger="rayapp.deployments.readiness"):
        asyncio.run(report_until_ready(waiting_for, period_s=0.01))
    first, second, ready = [r.getMessage() for r in caplog.records]
    assert "does not answer yet" in first and "LLMReplica UPDATING: Deployment 'LLMReplica'" in first
    assert 'Resources required for each replica: {"CPU": 1}' in first
    assert "LLMReplica DEPLOY_FAILED: The deployment failed to start 3 times in a row." in second
    assert "(RuntimeError: rayapp's engine did not start: ValueError: dtype: bfloat16" in second
    assert "rayapp answers" in ready


def test_an_application_imported_without_rayapps_dependencies_says_which_cluster_to_stop():
    """As in the workers of a Ray cluster left running from another environment, which `serve run` joins."""
    lacking_torch = "import sys; sys.modules['torch'] = None; import rayapp.deployments"
    run = subprocess.run([sys.executable, "-c", lacking_torch], capture_output=True, text=True)
    assert run.returncode != 0
    assert f"imported by {sys.executable}, which lacks torch" in run.stderr and "`ray stop`" in run.stderr

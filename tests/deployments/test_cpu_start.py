"""The shipped `rayapp.config.yaml` starts and answers on this CPU, and on one whose oneDNN has no bf16 path.

An AVX2-only CPU (AMD Zen 2/3, most desktops) is stood in for by capping oneDNN at AVX2 in every Ray worker
(`ONEDNN_MAX_CPU_ISA=AVX2`): oneDNN then refuses to pack a bf16 weight with the very error such a CPU gives
("bf16 path needs the cpu support avx_ne_convert or avx512bw, ..."), which once sent the shipped config's replica
into a restart loop. There `dtype: auto` must serve in float32, and an explicit `dtype: bfloat16` must fail its
start a bounded number of times with one error naming the setting, which `/health` reports.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import yaml
from ray import serve

from rayapp.config import AppConfig
from rayapp.deployments.builder import build
from rayapp.kernels.cpu import detect

SHIPPED = yaml.safe_load((Path(__file__).parents[2] / "rayapp.config.yaml").read_text())["applications"][0]["args"]
AVX2 = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
# Where oneDNN has no bf16 path here, this CPU is the AVX2-only case already.
CPUS = {"this CPU": None, **({"AVX2-only": AVX2} if detect().bf16_matmul else {})}


@pytest.fixture(scope="module", params=list(CPUS))
def cpu(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def base_url(serve_app, cpu):
    with serve_app(AppConfig(**SHIPPED), env=CPUS[cpu]) as url:
        yield url


def test_the_shipped_config_answers_a_chat(base_url):
    body = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 8}
    answer = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] > 0
    assert httpx.get(f"{base_url}/health", timeout=30).status_code == 200


def test_bfloat16_where_the_cpu_cannot_run_it_fails_once_with_the_setting_named(base_url, cpu):
    if CPUS[cpu] is None and detect().bf16_matmul:
        pytest.skip("this CPU runs bf16: the shipped app above already serves in it")
    config = AppConfig(**{**SHIPPED, "dtype": "bfloat16", "kvtier": {"enabled": False}})
    # serve.run waits for the application: it raises once Serve stops retrying the replica (3 starts), saying
    # only that the deployment failed; /health says why.
    with pytest.raises(RuntimeError, match="Deploying application bf16 failed"):
        serve.run(build(config, app_name="bf16"), name="bf16", route_prefix="/bf16")
    health = httpx.get(f"{base_url}/bf16/health", timeout=30)
    assert health.status_code == 503
    (replica,) = [d for d in health.json()["waiting_for"] if d["deployment"] == "LLMReplica"]
    assert replica["status"] == "DEPLOY_FAILED"
    assert "dtype: bfloat16 needs" in replica["error"] and "set dtype: auto" in replica["error"]
    serve.delete("bf16")

"""Models named the way users name them, served through the real Serve application: architectures only vLLM runs
(random-weight Mistral and Gemma 2 built here, on `engine: vllm`), and a Hugging Face repo id read from an offline
cache the test lays out (`HF_HUB_OFFLINE=1`, every Ray worker pointed at it by `HF_HOME`)."""

from __future__ import annotations

import shutil

import httpx
import pytest
from ray import serve

from rayapp.config import AppConfig
from rayapp.deployments.builder import build

pytest.importorskip("vllm", reason="engine: vllm needs vLLM")

REPO = "HuggingFaceTB/SmolLM2-135M-Instruct"
REVISION = "89ab0123456789abcdef0123456789abcdef0123"
VLLM = dict(
    engine="vllm", dtype="float32", kv_cache_memory_gb=0.25, max_model_len=1024, num_cpus=0.5,
    engine_kwargs={"enforce_eager": True},
)  # fmt: skip


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory, model_dir):
    home = tmp_path_factory.mktemp("hf-home")
    repo = home / "hub" / f"models--{REPO.replace('/', '--')}"
    shutil.copytree(model_dir, repo / "snapshots" / REVISION)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    return home


@pytest.fixture(scope="module")
def base_url(serve_app, tiny_model, hf_home):
    import huggingface_hub.constants

    mistral = AppConfig(model=str(tiny_model("mistral", sliding_window=None)), **VLLM)
    gemma = AppConfig(model=str(tiny_model("gemma2", query_pre_attn_scalar=64)), **VLLM)
    env = {"HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"}
    with pytest.MonkeyPatch.context() as patch:
        # The application is built here, in the test's process: its huggingface_hub read HF_HOME at import.
        patch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hf_home / "hub"))
        patch.setenv("HF_HUB_OFFLINE", "1")
        with serve_app(mistral, apps={"mistral": "/mistral"}, env=env) as url:
            serve.run(build(gemma, app_name="gemma"), name="gemma", route_prefix="/gemma")
            repo_id = AppConfig(model=REPO, kv_cache_memory_gb=0.25, num_cpus=0.5)
            serve.run(build(repo_id, app_name="hub"), name="hub", route_prefix="/hub")
            yield url


def _chat(url: str, model: str) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 8, "temperature": 0}
    answer = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    return answer.json()


@pytest.mark.parametrize("app", ["mistral", "gemma"])
def test_an_architecture_only_vllm_runs_is_served_on_vllm_replicas(base_url, app):
    url = f"{base_url}/{app}"
    (card,) = httpx.get(f"{url}/v1/models", timeout=30).json()["data"]
    assert card["max_model_len"] == 1024
    answer = _chat(url, card["id"])
    assert answer["usage"]["completion_tokens"] == 8 and answer["choices"][0]["finish_reason"] == "length"


def test_a_repo_id_is_served_from_the_offline_cache_under_its_own_name(base_url):
    url = f"{base_url}/hub"
    (card,) = httpx.get(f"{url}/v1/models", timeout=30).json()["data"]
    assert card["id"] == REPO and card["max_model_len"] == 8192
    assert _chat(url, REPO)["usage"]["completion_tokens"] > 0

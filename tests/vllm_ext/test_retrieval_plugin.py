"""The `retrieval` plugin in stock vLLM (`vllm.LLM`), and on rayapp's vLLM replica backend.

Settings scaled to SmolLM2's 8K context, as rayapp's own sparse tests: init 64, window 512, retrieval
blocks of 64 (vLLM pages of 64), top-k 0.2, dense boundary 1024. Stock vLLM answers first, then the
engine with the plugin answers the same prompts.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os

import pytest

pytest.importorskip("vllm")

from vllm import LLM, SamplingParams  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402
from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402

from rayapp.config import AppConfig, SparseConfig  # noqa: E402
from rayapp.drivers.backend import EngineRequest  # noqa: E402
from rayapp.engine.sampling_params import SamplingParams as RayappSamplingParams  # noqa: E402
from rayapp.kernels.cpu import cpu_plan
from rayapp.models.loader import resolve_model  # noqa: E402
from rayapp.models.tokenizer import chat_token_ids, load_tokenizer  # noqa: E402
from rayapp.sparse.evaluation import needle_case  # noqa: E402
from rayapp.vllm_ext.retrieval import (  # noqa: E402
    SETTINGS_ENV,
    WORKER_EXTENSION,
    register,
    retrieval_config,
    settings_env,
)

pytestmark = pytest.mark.slow  # vLLM engines

SCALED = {"init_tokens": 64, "local_tokens": 512, "retrieval_block_size": 64, "dense_boundary": 1024}
# The dtype rayapp runs here: bfloat16 where oneDNN has a bf16 path, else float32.
ENGINE = {
    "dtype": cpu_plan("auto").dtype_name,
    "block_size": 64,
    "kv_cache_memory_bytes": 1 << 30,
    "enforce_eager": True,
}
GREEDY = SamplingParams(temperature=0, max_tokens=16)
DEPTHS = [0.1, 0.3, 0.5, 0.7, 0.9, 0.2, 0.4, 0.6]
# What a vLLM replica backend with `sparse:` sets in its process (on CPU, its engine's one process too).
PLUGIN_ENV = ("VLLM_PLUGINS", SETTINGS_ENV, "VLLM_ENABLE_V1_MULTIPROCESSING")
SHORT = [
    "Name three rivers of Europe.",
    "Write a haiku about a lighthouse.",
    "Explain in two sentences why the sky is blue. " * 12,
    "List five prime numbers and say why they are prime. " * 30,
]


@contextlib.contextmanager
def _environment(**values: str):
    """`values` in the environment (vLLM's engine core reads it when it starts), and PLUGIN_ENV as it was after."""
    saved = {k: os.environ.get(k) for k in (*values, *PLUGIN_ENV)}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        AttentionBackendEnum.CPU_ATTN.clear_override()


async def _on_loop(fn) -> None:
    fn()


@pytest.fixture(scope="module")
def prompts():
    tok = load_tokenizer(resolve_model(None))
    short = [chat_token_ids(tok, [{"role": "user", "content": text}]) for text in SHORT]
    assert max(map(len, short)) + GREEDY.max_tokens < SCALED["dense_boundary"]
    needles = [needle_case(tok, 1200 + round(i * 4800 / 7), DEPTHS[i], seed=200 + i) for i in range(8)]
    return short, needles


def _answers(llm: LLM, token_ids: list[list[int]]) -> list[list[int]]:
    outs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in token_ids], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def stock(prompts):
    """Stock vLLM's greedy answers (the plugin installed, not named)."""
    short, needles = prompts
    with _environment(VLLM_PLUGINS=""):
        llm = LLM(str(resolve_model(None)), **ENGINE)
        answers = _answers(llm, short), _answers(llm, [c.prompt_token_ids for c in needles])
        llm.llm_engine.engine_core.shutdown()
    return answers


@pytest.fixture(scope="module")
def plugin(stock):
    with _environment(VLLM_PLUGINS="retrieval", **{SETTINGS_ENV: json.dumps(SCALED)}):
        llm = LLM(str(resolve_model(None)), worker_extension_cls=WORKER_EXTENSION, **ENGINE)
        yield llm
        llm.llm_engine.engine_core.shutdown()


def _stats(llm: LLM) -> dict[str, int]:
    return llm.collective_rpc("retrieval_stats")[0]


def test_below_the_dense_boundary_answers_equal_stock_vllm_token_for_token(prompts, stock, plugin):
    before = _stats(plugin)
    assert _answers(plugin, prompts[0]) == stock[0]
    after = _stats(plugin)
    assert after["sparse_decode_steps_sparse"] == before["sparse_decode_steps_sparse"]
    assert after["sparse_decode_steps_dense"] > before["sparse_decode_steps_dense"]


def test_needles_are_found_within_one_case_of_dense_and_the_sparse_path_ran(prompts, stock, plugin):
    tok = load_tokenizer(resolve_model(None))
    needles = prompts[1]
    before = _stats(plugin)
    answers = _answers(plugin, [c.prompt_token_ids for c in needles])
    after = _stats(plugin)
    found = sum(c.found(tok.decode(a)) for c, a in zip(needles, answers))
    dense = sum(c.found(tok.decode(a)) for c, a in zip(needles, stock[1]))
    assert found >= dense - 1, (found, dense)
    assert after["sparse_decode_steps_sparse"] - before["sparse_decode_steps_sparse"] >= len(needles)
    assert after["sparse_selected_blocks"] > before["sparse_selected_blocks"]
    assert after["sparse_blocks_represented"] > before["sparse_blocks_represented"]
    # A second turn over the same history: vLLM's prefix cache hands back its pages, and with them the
    # representations; none is computed again.
    again = _answers(plugin, [needles[-1].prompt_token_ids])
    assert again == answers[-1:]
    assert _stats(plugin)["sparse_blocks_represented"] == after["sparse_blocks_represented"]


def test_the_plugin_stays_off_unless_vllm_plugins_names_it():
    backend = AttentionBackendEnum.CPU_ATTN
    with _environment(VLLM_PLUGINS="lora_filesystem_resolver"):
        register()
        assert not backend.is_overridden()
    with _environment(VLLM_PLUGINS="lora_filesystem_resolver, retrieval"):
        register()
        assert backend.get_path() == "rayapp.vllm_ext.retrieval_backend.RetrievalCPUBackend"


def test_a_replica_with_vllm_plugins_unset_names_every_installed_plugin_and_retrieval(monkeypatch):
    # Unset, vLLM loads every installed plugin but endpoint ones; listing them keeps that and adds retrieval.
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    env = settings_env(SparseConfig(enabled=True, **SCALED))
    named = env["VLLM_PLUGINS"].split(",")
    assert "retrieval" in named and "lora_filesystem_resolver" in named
    assert json.loads(env[SETTINGS_ENV])["init_tokens"] == 64


def test_settings_are_the_seed_environment_checked_as_rayapps():
    env = {"VLLM_RETRIEVAL_INIT_TOKENS_NUM": "512", "VLLM_RETRIEVAL_TOPK_PERCENT": "0.1"}
    config = retrieval_config(env)
    assert (config.init_tokens, config.topk_percent, config.local_tokens) == (512, 0.1, None)
    # The counts left unset scale with the engine's context: the seed's own values at 128K, a quarter at 32K.
    assert config.for_context(131072).local_tokens == 7192 and config.for_context(32768).dense_boundary == 8192
    with pytest.raises(ValueError, match=r"init_tokens \+ local_tokens .* must be below dense_boundary"):
        retrieval_config({"VLLM_RETRIEVAL_DENSE_BOUNDARY": "4096"}).for_context(131072)
    with pytest.raises(ValueError, match="retrieval_stride=4 needs rayapp's engine"):
        retrieval_config({SETTINGS_ENV: json.dumps({"retrieval_stride": 4})})
    with pytest.raises(ValueError, match="VLLM_RETRIEVAL_TOPK_PERCENT='lots'"):
        retrieval_config({"VLLM_RETRIEVAL_TOPK_PERCENT": "lots"})
    # On a vLLM replica: a retrieval block is whole vLLM pages (128 on CPU unless block_size says otherwise).
    with pytest.raises(ValueError, match="retrieval_block_size=64 must be a multiple of vLLM's block_size=128"):
        AppConfig(engine="vllm", sparse={"enabled": True, **SCALED})
    AppConfig(engine="vllm", block_size=64, sparse={"enabled": True, **SCALED})
    with pytest.raises(ValueError, match="layerwise.enabled is not supported with engine: vllm"):
        AppConfig(engine="vllm", layerwise={"enabled": True})


def test_a_vllm_replica_with_sparse_enabled_runs_the_plugin_and_reports_it(prompts, stock):
    """rayapp's `engine: vllm` backend with `sparse:` set; at top-k 0.02 (one middle block in fifty) some
    greedy answers differ from dense, and the replica's stats (what /metrics shows) count the sparse steps."""
    from rayapp.deployments.engines import backend_class

    needles = prompts[1][4:]
    config = AppConfig(
        engine="vllm", block_size=64, kv_cache_memory_gb=1.0, engine_kwargs={"enforce_eager": True},
        sparse={"enabled": True, "topk_percent": 0.02, **SCALED},
    )  # fmt: skip

    async def answer(i: int, ids: list[int]) -> list[int]:
        sampling = RayappSamplingParams(temperature=0, max_tokens=GREEDY.max_tokens)
        request = EngineRequest(f"needle-{i}", ids, [], "", sampling, ids)
        return [t async for delta in backend.generate(request) for t in delta.token_ids]

    loop = asyncio.new_event_loop()
    with _environment():
        backend = backend_class(config).from_app_config(config)
        try:
            answers = [loop.run_until_complete(answer(i, c.prompt_token_ids)) for i, c in enumerate(needles)]
            stats = loop.run_until_complete(backend.stats())
        finally:
            # On its loop: vLLM's AsyncLLM closes its sockets at once there, and only schedules it from outside
            # (left open, they hang zmq's context termination when Python collects it).
            loop.run_until_complete(_on_loop(backend.shutdown))
            loop.close()
    assert answers != stock[1][4:]
    assert stats["sparse_decode_steps_sparse"] >= len(needles)
    assert stats["sparse_selected_blocks"] >= stats["sparse_decode_steps_sparse"]

"""The cluster tier as vLLM's KV connector, in `vllm.LLM`: a history computed once is loaded, not recomputed.

One engine for the module, with the tier of an embedded PostgreSQL and this node's store actor.
`reset_prefix_cache()` empties vLLM's own cache, so the next request finds the history only in the
tier, as a fresh replica would. Faults: a block corrupted in the store, a catalog that stops
answering, a catalog that is gone; each ends in recompute and the same answer.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from types import SimpleNamespace

import numpy as np
import psutil
import pytest
import ray
import torch

pytest.importorskip("vllm")

from vllm import LLM, SamplingParams  # noqa: E402

from rayapp.blocks import BlockHash, hash_blocks  # noqa: E402
from rayapp.config import KVTierConfig  # noqa: E402
from rayapp.kernels.cpu import cpu_plan
from rayapp.kvtier.catalog import Catalog  # noqa: E402
from rayapp.kvtier.codec import KVBlock, encode_block  # noqa: E402
from rayapp.kvtier.embedded import NAMESPACE, start_embedded_database, stop_embedded_database  # noqa: E402
from rayapp.kvtier.records import BlockLocation, BlockRow  # noqa: E402
from rayapp.kvtier.store import store_name  # noqa: E402
from rayapp.models.loader import DEFAULT_MODEL, resolve_model  # noqa: E402
from rayapp.vllm_ext.connector import kv_transfer_config  # noqa: E402
from rayapp.vllm_ext.tier_protocol import (  # noqa: E402
    LOADED_TOKENS_PARAM,
    MISSED_TOKENS_PARAM,
    BlockRun,
    Load,
    TierSettings,
)
from rayapp.vllm_ext.tier_scheduler import TierScheduler  # noqa: E402
from rayapp.vllm_ext.tier_worker import TierWorker  # noqa: E402

pytestmark = pytest.mark.slow  # vLLM engines, a Ray cluster and the tier's database

BLOCK = 128
HEADS, HEAD_DIM = 3, 64
GREEDY = SamplingParams(max_tokens=24, temperature=0)
HISTORY = " ".join(
    f"Log {i}: the {c} crate from dock {i * 7} was loaded onto truck {i * 13 % 50} by {n} at {i % 12 + 1} o'clock."
    for i, (c, n) in enumerate(zip(["red", "green", "blue", "amber", "white", "black"] * 12, ["Ana", "Bo", "Cy"] * 24))
)
# The dtype rayapp runs here: bfloat16 where oneDNN has a bf16 path, else float32.
DTYPE = cpu_plan("auto").dtype_name


@pytest.fixture(scope="module")
def tier(tmp_path_factory):
    ray.init(num_cpus=2, include_dashboard=False)
    config = KVTierConfig(enabled=True, data_dir=str(tmp_path_factory.mktemp("vllm-tier") / "db"))
    llm = LLM(
        str(resolve_model(None)), dtype=DTYPE, block_size=BLOCK, kv_cache_memory_bytes=1 << 30,
        enforce_eager=True, kv_transfer_config=kv_transfer_config(config, DEFAULT_MODEL),
    )  # fmt: skip
    dsn = start_embedded_database(config.data_dir)
    yield SimpleNamespace(llm=llm, dsn=dsn, catalog=Catalog(dsn, HEADS * HEAD_DIM))
    llm.llm_engine.engine_core.shutdown()
    stop_embedded_database()
    ray.shutdown()


def _prompt(llm: LLM, question: str) -> list[int]:
    messages = [{"role": "user", "content": f"{HISTORY}\n{question}"}]
    tokenizer = llm.get_tokenizer()
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)


def _hashes(tokens: list[int], salt: str = "") -> list[int]:
    return hash_blocks(tokens, BLOCK, (DEFAULT_MODEL, salt))


def _wait_in_tier(catalog: Catalog, hashes: list[int]) -> None:
    """Writes land on the worker's writer thread after the step: wait (bounded) until the catalog has them."""
    deadline = time.monotonic() + 60
    while catalog.longest_chain(hashes).num_present < len(hashes):
        assert time.monotonic() < deadline, "the history's blocks never reached the tier"
        time.sleep(0.1)


def _generate(llm: LLM, tokens: list[int], salt: str | None = None):
    prompt = {"prompt_token_ids": tokens} | ({"cache_salt": salt} if salt else {})
    return llm.generate([prompt], GREEDY, use_tqdm=False)[0]


@pytest.fixture(scope="module")
def history(tier):
    """Turn 1 computed and in the tier; turn 2's prompt, its answer from vLLM's own cache and from a recompute."""
    first = _prompt(tier.llm, "Which truck took the amber crate?")
    assert len(first) > 2048
    _generate(tier.llm, first)
    second = _prompt(tier.llm, "Who loaded the white crate?")
    reusable = (len(second) - 1) // BLOCK * BLOCK
    _wait_in_tier(tier.catalog, _hashes(second[:reusable]))
    local = _generate(tier.llm, second)
    assert local.num_cached_tokens == reusable and not local.kv_transfer_params
    recomputed = _generate(tier.llm, second, salt="recompute")  # another tenant: nothing cached, nothing loaded
    assert recomputed.num_cached_tokens == 0
    return SimpleNamespace(tokens=second, reusable=reusable, local=local.outputs[0].token_ids,
                           recomputed=recomputed.outputs[0].token_ids)  # fmt: skip


def test_history_loads_from_the_tier_into_an_empty_cache(tier, history):
    assert tier.llm.reset_prefix_cache()
    out = _generate(tier.llm, history.tokens)
    assert out.num_cached_tokens == history.reusable >= 0.9 * len(history.tokens)
    assert out.kv_transfer_params == {LOADED_TOKENS_PARAM: history.reusable}
    assert out.outputs[0].token_ids == history.local  # the loaded pages are the computed ones, bit for bit
    assert out.outputs[0].token_ids == history.recomputed


def _vllm_config() -> SimpleNamespace:
    """The parts of vLLM's config the connector's halves read, for driving them without an engine."""
    return SimpleNamespace(
        cache_config=SimpleNamespace(block_size=BLOCK),
        model_config=SimpleNamespace(get_num_kv_heads=lambda _parallel: HEADS, get_head_size=lambda: HEAD_DIM),
        parallel_config=None,
        compilation_config=SimpleNamespace(static_forward_context={}),
    )


def _store():
    return ray.get_actor(store_name(ray.get_runtime_context().get_node_id()), namespace=NAMESPACE)


def test_a_corrupted_block_is_refused_and_recomputed(tier, history):
    hashes = _hashes(history.tokens[: history.reusable])
    store, bad = _store(), hashes[5]
    (ref,) = ray.get(store.get_many.remote([bad]))
    data = np.array(ray.get(ref))
    data[-100] ^= 0xFF  # a flipped byte in V's tensor bytes: the header still parses, the CRC does not match
    assert ray.get(store.delete.remote(bad))
    assert ray.get(store.put_many.remote([data])).kept == (True,)
    assert tier.llm.reset_prefix_cache()
    out = _generate(tier.llm, history.tokens)
    # The chain ends at the bad block; vLLM counts the whole offer as cached, the connector says what was not.
    missed = history.reusable - 5 * BLOCK
    assert out.kv_transfer_params == {LOADED_TOKENS_PARAM: 5 * BLOCK, MISSED_TOKENS_PARAM: missed}
    assert out.num_cached_tokens - missed == 5 * BLOCK
    assert out.outputs[0].token_ids == history.local


def test_blocks_of_a_store_that_is_gone_are_recomputed(tier, history):
    # Catalog rows naming a store that no longer exists (its node died before its rows were pruned).
    hashes = _hashes(history.tokens[: history.reusable], salt="ghost")
    rows = [
        BlockRow(h, hashes[i - 1] if i else None, DEFAULT_MODEL, "ghost", 0, "dead-node", store_name("dead-node"),
                 1 << 20, BLOCK)
        for i, h in enumerate(hashes)
    ]  # fmt: skip
    assert tier.catalog.upsert(rows)
    out = _generate(tier.llm, history.tokens, salt="ghost")
    assert out.kv_transfer_params == {MISSED_TOKENS_PARAM: history.reusable}
    assert out.outputs[0].token_ids == history.recomputed


def test_a_block_of_another_dtype_is_refused_never_misread(tier, history):
    # A block another engine wrote for these very tokens and tenant, in another dtype: identity right, layout not.
    salt, tokens = "other-dtype-writer", history.tokens[:BLOCK]
    (block_hash,) = _hashes(tokens, salt=salt)
    other = torch.bfloat16 if DTYPE == "float32" else torch.float32
    kv = torch.zeros(30, BLOCK, HEADS, HEAD_DIM, dtype=other)
    block = KVBlock(block_hash, None, tuple(tokens), DEFAULT_MODEL, kv, kv.clone(), salt)
    assert ray.get(_store().put_many.remote([np.frombuffer(encode_block(block), np.uint8)])).kept == (True,)
    out = _generate(tier.llm, history.tokens, salt=salt)
    assert out.kv_transfer_params == {MISSED_TOKENS_PARAM: BLOCK}
    assert out.outputs[0].token_ids == history.recomputed


def test_an_engine_whose_pages_the_tier_cannot_read_serves_without_it(tier):
    settings = TierSettings(dsn=tier.dsn, model_id=DEFAULT_MODEL)
    worker = TierWorker(settings, _vllm_config())
    worker.register({"layer.0": torch.zeros(4, 1, BLOCK, 576)})  # MLA's latent cache, say
    worker.save([BlockRun((0,), (BlockHash(1),), None, tuple(range(BLOCK)), "")])  # nothing to copy: skipped
    location = BlockLocation(BlockHash(1), 0, "node", "store", 1 << 20, BLOCK)
    worker.start_loads([Load("r", None, tuple(range(BLOCK)), (location,), (3,), "")])
    deadline = time.monotonic() + 10
    while not (finished := worker.finished_loads()):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert finished == {"r"} and worker.take_failed_blocks() == {3}  # reported failed: vLLM recomputes page 3
    worker.close()


def _postgres_processes(dsn: str) -> list[psutil.Process]:
    port = int(dict(part.split("=", 1) for part in dsn.split())["port"])
    psutil.process_iter.cache_clear()  # a cached Process whose PID was reused since is skipped once
    for proc in psutil.process_iter(["name", "cmdline"]):
        if proc.info["name"] == "postgres" and f"{port}" in " ".join(proc.info["cmdline"] or []):
            return [proc, *proc.children(recursive=True)]
    raise AssertionError(f"no postgres serves port {port}")


def _signal(processes: list[psutil.Process], sig: signal.Signals) -> None:
    """`sig` to each of `processes` still there: a CI run lost one of postgres' children between SIGSTOP and SIGCONT."""
    for proc in processes:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, sig)


def test_a_frozen_catalog_costs_one_deadline_then_is_skipped(tier):
    settings = TierSettings(dsn=tier.dsn, model_id=DEFAULT_MODEL, lookup_deadline_s=0.2)
    scheduler = TierScheduler(settings, _vllm_config())
    tokens = list(range(1000, 1000 + 4 * BLOCK + 1))

    def request(n: int) -> SimpleNamespace:
        return SimpleNamespace(request_id=f"r{n}", all_token_ids=tokens, num_tokens=len(tokens), cache_salt=None)

    assert scheduler.matched_tokens(request(0), 0) == 0  # answered: nothing stored for these tokens
    frozen = _postgres_processes(tier.dsn)
    _signal(frozen, signal.SIGSTOP)
    try:
        # The first lookup gives up at its deadline (the query is still out); the second does not ask.
        assert scheduler.matched_tokens(request(1), 0) == 0
        assert scheduler.matched_tokens(request(2), 0) == 0
        assert scheduler.counters == {"lookups": 2, "lookups_timed_out": 1, "lookups_skipped": 1}
    finally:
        _signal(frozen, signal.SIGCONT)
    scheduler.close()


def test_requests_are_served_with_the_catalog_gone(tier, history):
    stop_embedded_database()
    assert tier.llm.reset_prefix_cache()
    out = _generate(tier.llm, history.tokens)
    assert out.num_cached_tokens == 0 and not out.kv_transfer_params
    assert out.outputs[0].token_ids == history.recomputed

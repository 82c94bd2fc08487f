"""Two engines sharing the cluster tier: the second resumes the first's conversation from loaded blocks.

Real embedded PostgreSQL (started by the tier itself, as `kvtier.dsn` unset does), real store actor,
the shipped SmolLM2 in float32.
"""

from __future__ import annotations

import logging

import pytest
import ray
import torch

from rayapp import LLM, SamplingParams
from rayapp.blocks import BlockStored, Tier, hash_blocks
from rayapp.kvtier.embedded import stop_embedded_database
from rayapp.models.tokenizer import chat_token_ids

pytestmark = pytest.mark.slow  # a Ray cluster and the tier's database

# A long first turn: a document to discuss (~1.2K tokens), so turn 2 is mostly history.
DOCUMENT = " ".join(
    f"Section {i}: the {animal} crossed river {i * 7} near the {place}, and the log noted {i * 13} visitors."
    for i, (animal, place) in enumerate(
        [("fox", "mill"), ("heron", "bridge"), ("otter", "dam"), ("badger", "farm"), ("lynx", "pass")] * 9
    )
)
PARAMS = SamplingParams(temperature=0.0, max_tokens=24)


@pytest.fixture(scope="module")
def tier_options(tmp_path_factory):
    ray.init(address="local", num_cpus=2, object_store_memory=400 << 20, include_dashboard=False)
    data_dir = tmp_path_factory.mktemp("kvtier-reuse")
    yield {"enabled": True, "data_dir": str(data_dir / "db")}
    stop_embedded_database()
    ray.shutdown()


@pytest.fixture(scope="module")
def engines(tier_options):
    a = LLM(dtype="float32", num_pages=512, kvtier=tier_options)
    b = LLM(dtype="float32", num_pages=512, kvtier=tier_options)
    yield a, b
    a.close()
    b.close()


def test_second_engine_resumes_the_conversation_from_the_tier(engines):
    a, b = engines
    messages = [{"role": "user", "content": f"Read this log.\n{DOCUMENT}\nWhich animal came first?"}]
    first = a.chat(messages, PARAMS)[0]
    messages += [
        {"role": "assistant", "content": first.outputs[0].text},
        {"role": "user", "content": "And which one came last?"},
    ]
    a.tier.flush()  # write-through is asynchronous; turn 2 comes after it, as a later request would

    before = b.stats()
    resumed = b.chat(messages, PARAMS)[0]
    after = b.stats()
    prompt = chat_token_ids(b.get_tokenizer(), messages)
    assert len(prompt) > 1000
    loaded = after["tier_loaded_tokens"] - before["tier_loaded_tokens"]
    assert loaded >= 0.9 * len(prompt), f"{loaded} of {len(prompt)} prompt tokens loaded from the tier"
    assert resumed.num_cached_tokens == after["cached_prompt_tokens"] - before["cached_prompt_tokens"] >= loaded
    # The tier client's own counters are the engine's stats too (so they reach /metrics): A wrote, B loaded.
    assert a.stats()["tier_written_blocks"] > 0
    assert (after["tier_loaded_blocks"] - before["tier_loaded_blocks"]) * 16 >= loaded

    # The same turn recomputed from scratch (A's cache dropped, B's not asked): identical greedy output.
    a.engine.detach_tier()  # A neither loads nor writes now
    assert a.engine.block_manager.reset_prefix_cache()
    recomputed = a.chat(messages, PARAMS)[0]
    assert recomputed.num_cached_tokens == 0
    assert resumed.outputs[0].token_ids == recomputed.outputs[0].token_ids


def test_prefill_and_decode_blocks_are_written_and_announced_for_the_router(engines):
    _, b = engines
    b.engine.take_kv_events()
    prompt = list(range(1000, 1100))
    out = b.generate(prompt_token_ids=prompt, sampling_params=PARAMS)[0]
    b.tier.flush()
    events = [e for e in b.engine.take_kv_events() if isinstance(e, BlockStored) and e.tier == Tier.CLUSTER]
    tokens = prompt + out.outputs[0].token_ids
    # Every block full of computed tokens (the last sampled token is never computed), decode-filled ones too.
    expected = hash_blocks(tokens[: (len(tokens) - 1) // 16 * 16], 16, (b.engine.model_id, ""))
    assert len(expected) > 100 // 16
    assert [h for e in events for h in e.block_hashes] == expected
    assert b.tier.catalog.longest_chain(expected).num_present == len(expected)
    # The same blocks computed again (say, by another engine after eviction) are not sent twice.
    written, skipped = b.tier.counters["written_blocks"], b.tier.counters["skipped_blocks"]
    first = events[0]
    n = len(first.block_hashes)
    pool = b.engine.runner.pool.k
    copy = torch.zeros(pool.shape[0], n, *pool.shape[2:], dtype=pool.dtype)
    b.tier.write(first, "", copy, copy)
    b.tier.flush()
    assert b.tier.counters["written_blocks"] == written and b.tier.counters["skipped_blocks"] == skipped + n
    assert b.tier.take_events() == []


def test_requests_succeed_after_the_database_stops(engines, caplog):
    a, b = engines
    stop_embedded_database()
    caplog.set_level(logging.WARNING, logger="rayapp.kvtier")
    for i in range(2):
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        out = b.generate(prompt_token_ids=list(range(2000 + i, 2100 + i)), sampling_params=params)[0]
        b.tier.flush()
        assert out.finished and len(out.outputs[0].token_ids) == 8
    disabled = [r for r in caplog.records if "cluster KV tier disabled" in r.getMessage()]
    assert len(disabled) == 1

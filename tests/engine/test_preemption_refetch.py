"""A preempted request whose blocks the local cache lost while it waited loads them back from the cluster
tier (an in-memory `TierPort` here) instead of recomputing them, and answers exactly as without preemption."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest
import torch

from rayapp import LLM, SamplingParams
from rayapp.blocks import BlockHash, BlockStored
from rayapp.drivers.async_engine import AsyncLLMEngine
from rayapp.engine.llm_engine import LLMEngine
from rayapp.engine.request import EngineRequest
from rayapp.kvtier.connector import connect

pytestmark = pytest.mark.slow  # the real model through preemptions

PARAMS = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
# Two 160-token prompts (10 pages each) growing to 224 tokens (14 pages) in a 24-page pool: the second is
# preempted, and the pages the first still needs evict the second's last blocks (freed first).
PROMPTS = [list(range(1000 + 500 * i, 1160 + 500 * i)) for i in range(2)]


@dataclass(frozen=True)
class Block:
    block_hash: BlockHash
    parent_hash: BlockHash | None
    token_ids: tuple[int, ...]
    key: torch.Tensor
    value: torch.Tensor


class MemoryTier:
    """A `TierPort` that keeps every block written to it."""

    min_load_tokens = 16

    def __init__(self) -> None:
        self.blocks: dict[BlockHash, Block] = {}
        self.fetch_starts: list[int] = []  # the first block asked for, per fetch

    def write(self, stored: BlockStored, cache_salt: str, key: torch.Tensor, value: torch.Tensor) -> None:
        bs = stored.block_size
        for i, h in enumerate(stored.block_hashes):
            parent = stored.block_hashes[i - 1] if i else stored.parent_block_hash
            tokens = tuple(stored.token_ids[i * bs : (i + 1) * bs])
            self.blocks[h] = Block(h, parent, tokens, key[:, i].clone(), value[:, i].clone())

    def fetch(self, block_hashes, token_ids, cache_salt, start_block) -> list[Block]:
        self.fetch_starts.append(start_block)
        found = []
        for h in block_hashes[start_block:]:
            if h not in self.blocks:
                break
            found.append(self.blocks[h])
        return found if len(found) * 16 >= self.min_load_tokens else []

    def take_events(self) -> list:
        return []

    def stats(self) -> dict[str, int]:
        return {}

    def metrics(self) -> tuple:
        return ()


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    llm = LLM(dtype="float32", num_pages=64)
    return [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=PARAMS)]


async def answer(engine: AsyncLLMEngine, request_id: str, prompt: list[int]) -> list[int]:
    last = None
    async for out in engine.generate(EngineRequest(request_id, prompt, sampling=PARAMS)):
        last = out
    return last.outputs[0].token_ids


def run_both(engine: LLMEngine) -> list[list[int]]:
    async_engine = AsyncLLMEngine(engine)

    async def both() -> list[list[int]]:
        return list(await asyncio.gather(*(answer(async_engine, str(i), p) for i, p in enumerate(PROMPTS))))

    try:
        return asyncio.run(both())
    finally:
        async_engine.shutdown()


def test_a_preempted_request_loads_its_lost_blocks_back_from_the_tier(reference):
    engine = LLMEngine.from_options(dtype="float32", num_pages=24)
    tier = MemoryTier()
    connect(engine, tier)
    assert run_both(engine) == reference
    stats = engine.stats()
    assert stats["num_preemptions"] >= 1
    # The blocks the running request evicted came back from the tier, not from recompute.
    assert stats["tier_reloaded_tokens"] >= 16 and tier.fetch_starts
    assert not engine.scheduler.loading and not engine.has_unfinished_requests()
    engine.block_manager.check_invariants()


def test_without_the_blocks_in_the_tier_it_recomputes_once_and_is_not_parked_again(reference):
    engine = LLMEngine.from_options(dtype="float32", num_pages=24)
    tier = MemoryTier()
    connect(engine, tier)
    tier.write = lambda *args: None  # a tier that keeps nothing
    assert run_both(engine) == reference
    stats = engine.stats()
    assert stats["num_preemptions"] == 1 and stats["tier_reloaded_tokens"] == 0
    # Each new request asks once before it is queued; the preempted one asks again only after the cache
    # lost more of it, never twice for the same local prefix.
    new, refetches = tier.fetch_starts[: len(PROMPTS)], tier.fetch_starts[len(PROMPTS) :]
    assert new == [0] * len(PROMPTS)
    assert refetches and refetches == sorted(set(refetches), reverse=True)
    assert not engine.scheduler.loading


def test_the_offline_llm_loads_a_preempted_requests_lost_blocks_back_too(reference):
    llm = LLM(dtype="float32", num_pages=24)
    tier = MemoryTier()
    connect(llm.engine, tier)
    answers = llm.generate(prompt_token_ids=PROMPTS, sampling_params=PARAMS)
    assert [o.outputs[0].token_ids for o in answers] == reference
    stats = llm.stats()
    assert stats["num_preemptions"] >= 1 and stats["tier_reloaded_tokens"] >= 16
    assert not llm.engine.has_unfinished_requests()
    llm.engine.block_manager.check_invariants()


def test_the_tier_offers_tokens_without_taking_pages_and_adopting_them_extends_the_prefix_match():
    tier = MemoryTier()
    writer = LLMEngine.from_options(dtype="float32", num_pages=64)
    connect(writer, tier)
    writer.add_request(EngineRequest("written", PROMPTS[0], sampling=SamplingParams(max_tokens=1)))
    while writer.has_unfinished_requests():
        writer.step()
    reader = LLMEngine.from_options(dtype="float32", num_pages=64)
    connector, bm = connect(reader, tier), reader.block_manager
    seq = reader.prepare_request(EngineRequest("read", PROMPTS[0], sampling=PARAMS)).seq
    local = bm.match_prefix(seq)
    pages = (bm.num_free_pages, bm.num_cached_pages)
    offered = connector.offer(seq, local)
    # The tier serves every full block but the one holding the last prompt token, and offering takes no page.
    assert local.num_tokens == 0 and offered == (len(PROMPTS[0]) - 1) // 16 * 16
    assert (bm.num_free_pages, bm.num_cached_pages) == pages and bm.fits(seq, local)
    extended = connector.adopt(seq, local)
    assert extended.num_tokens == offered and extended == bm.match_prefix(seq)
    assert bm.allocate(seq, len(PROMPTS[0]) - offered, extended) and seq.num_cached_tokens == offered

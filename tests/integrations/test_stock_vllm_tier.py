"""rayapp's cluster tier in a stock vLLM, set up as a `vllm serve` user does: the JSON `rayapp kv-transfer-config`
prints, read by vLLM's own command-line parser, in `vllm.LLM`. No rayapp ingress and no Ray cluster: the catalog
is a PostgreSQL, and `--ray-address local` has vLLM's worker start a private Ray to hold the blocks.

One request stores a history's blocks in the tier; after vLLM's own cache is emptied (as on a fresh replica), the
same prompt loads them from the tier instead of recomputing, and answers alike.
"""

from __future__ import annotations

import time

import pytest

pytest.importorskip("vllm")

from vllm import LLM, SamplingParams  # noqa: E402
from vllm.engine.arg_utils import EngineArgs  # noqa: E402
from vllm.utils.argparse_utils import FlexibleArgumentParser  # noqa: E402

from rayapp.blocks import hash_blocks  # noqa: E402
from rayapp.cli import main  # noqa: E402
from rayapp.kernels.cpu import cpu_plan  # noqa: E402
from rayapp.vllm_ext.tier_protocol import LOADED_TOKENS_PARAM  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
BLOCK = 128
HISTORY = " ".join(f"Log {i}: crate {i * 7} went onto truck {i * 13 % 50} at {i % 12 + 1} o'clock." for i in range(40))


@pytest.fixture(scope="module")
def vllm_serve_args(model_dir) -> list[str]:
    return [
        "--model",
        str(model_dir),
        "--dtype",
        cpu_plan("auto").dtype_name,
        "--block-size",
        str(BLOCK),
        "--enforce-eager",
    ]


def _wait_in_tier(catalog, hashes: list[int]) -> None:
    """The worker's writer thread records the blocks after the step: wait (bounded) until the catalog has them."""
    deadline = time.monotonic() + 60
    while catalog.longest_chain(hashes).num_present < len(hashes):
        assert time.monotonic() < deadline, "the history's blocks never reached the tier"
        time.sleep(0.1)


def test_a_stock_vllm_stores_a_history_in_the_tier_and_loads_it_back(dsn, catalog, capsys, vllm_serve_args):
    assert main(["kv-transfer-config", "--model-id", MODEL, "--dsn", dsn, "--ray-address", "local"]) == 0
    transfer_json = capsys.readouterr().out.strip()
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    cli = EngineArgs.from_cli_args(parser.parse_args([*vllm_serve_args, "--kv-transfer-config", transfer_json]))
    llm = LLM(
        cli.model, dtype=cli.dtype, block_size=cli.block_size, enforce_eager=cli.enforce_eager,
        kv_cache_memory_bytes=1 << 29, kv_transfer_config=cli.kv_transfer_config,
    )  # fmt: skip
    try:
        tokens = llm.get_tokenizer().apply_chat_template(
            [{"role": "user", "content": f"{HISTORY}\nWhich truck took crate 49?"}],
            add_generation_prompt=True, tokenize=True, return_dict=False,
        )  # fmt: skip
        reusable = (len(tokens) - 1) // BLOCK * BLOCK
        assert reusable >= 4 * BLOCK
        greedy = SamplingParams(max_tokens=8, temperature=0)
        computed = llm.generate([{"prompt_token_ids": tokens}], greedy, use_tqdm=False)[0]
        assert computed.num_cached_tokens == 0 and not computed.kv_transfer_params
        _wait_in_tier(catalog, hash_blocks(tokens[:reusable], BLOCK, (MODEL, "")))

        assert llm.reset_prefix_cache()  # vLLM's own cache is empty now: only the tier holds the history
        loaded = llm.generate([{"prompt_token_ids": tokens}], greedy, use_tqdm=False)[0]
        assert loaded.kv_transfer_params == {LOADED_TOKENS_PARAM: reusable}
        assert loaded.num_cached_tokens == reusable
        assert loaded.outputs[0].token_ids == computed.outputs[0].token_ids
    finally:
        llm.llm_engine.engine_core.shutdown()

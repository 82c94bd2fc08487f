"""Page arithmetic of a sparse sequence: modes by prompt length, init / middle / window split."""

import pytest

from rayapp.config import SparseConfig
from rayapp.sparse.policy import AttentionMode, RetrievalPolicy

SCALED = SparseConfig(
    enabled=True, init_tokens=64, local_tokens=500, retrieval_block_size=64, dense_boundary=1024, offload_boundary=2048
)


def test_mode_follows_prompt_length():
    p = RetrievalPolicy(SCALED, block_size=16)
    assert p.mode(1023) is AttentionMode.DENSE
    assert p.mode(1024) is AttentionMode.SPARSE and p.mode(2048) is AttentionMode.SPARSE
    assert p.mode(2049) is AttentionMode.OFFLOAD
    off = RetrievalPolicy(SparseConfig(enabled=False).for_context(131072), block_size=16)
    assert off.mode(10**6) is AttentionMode.DENSE


def test_the_policy_needs_the_counts_scaled_to_a_context():
    with pytest.raises(ValueError, match="for_context"):
        RetrievalPolicy(SparseConfig(enabled=True), block_size=16)


def test_local_window_is_rounded_up_to_whole_pages():
    p = RetrievalPolicy(SCALED, block_size=16)
    assert (p.init_pages, p.local_pages, p.pages_per_block) == (4, 32, 4)  # 500 tokens -> 32 pages (512)


def test_middle_grows_in_whole_blocks_as_the_window_moves():
    p = RetrievalPolicy(SCALED, block_size=16)
    # 64 init + 512 window: nothing in the middle until a whole block has left the window.
    assert p.num_middle_blocks(576) == 0
    assert p.num_middle_blocks(64 + 64 + 512) == 1
    ctx = 64 + 10 * 64 + 512 + 5
    assert p.num_middle_blocks(ctx) == 10
    start = p.window_start_page(ctx)
    assert start == 4 + 10 * 4
    pages = -(-ctx // 16)
    assert p.local_pages <= pages - start < p.local_pages + p.pages_per_block


def test_a_block_is_middle_only_once_all_its_tokens_are_computed():
    cfg = SparseConfig(
        enabled=True, init_tokens=0, local_tokens=0, retrieval_block_size=64, dense_boundary=128, offload_boundary=256
    )
    p = RetrievalPolicy(cfg, block_size=16)
    assert p.num_middle_blocks(64) == 0  # token 63 is computed in this very step
    assert p.num_middle_blocks(65) == 1


def test_selection_takes_the_top_share_and_at_least_one_block():
    p = RetrievalPolicy(SCALED, block_size=16)
    assert [p.num_selected(n) for n in (0, 1, 4, 10, 11)] == [0, 1, 1, 2, 3]

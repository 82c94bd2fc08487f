"""Which part of a context is always attended, which is retrieved, and which mode a sequence runs in.

Token layout of a sparse sequence (pages of `block_size` tokens, retrieval blocks of
`pages_per_block` pages):

    [ init pages | middle block 0 | middle block 1 | ... | window pages (incl. the current one) ]

The init region is `ceil(init_tokens / block_size)` pages. The window is the last
`ceil(local_tokens / block_size)` pages, extended back to the end of the last whole middle block,
so it holds between `local_pages` and `local_pages + pages_per_block - 1` pages. A block joins the
middle once all its pages have left the window; it never leaves the middle again.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from rayapp.config import SparseConfig


class AttentionMode(enum.Enum):
    DENSE = "dense"
    SPARSE = "sparse"  # retrieval, every page on the device
    OFFLOAD = "offload"  # retrieval, middle pages in the host pool


@dataclass(frozen=True)
class RetrievalPolicy:
    """The page arithmetic of one engine's sparse settings; pure integers, no state."""

    config: SparseConfig
    block_size: int

    def __post_init__(self) -> None:
        if not self.config.resolved:
            raise ValueError("RetrievalPolicy needs concrete token counts: pass config.for_context(max_model_len)")

    @property
    def pages_per_block(self) -> int:
        return self.config.retrieval_block_size // self.block_size

    @property
    def init_pages(self) -> int:
        return math.ceil(self.config.init_tokens / self.block_size)

    @property
    def local_pages(self) -> int:
        return math.ceil(self.config.local_tokens / self.block_size)

    def mode(self, num_prompt_tokens: int) -> AttentionMode:
        """The mode a sequence keeps for its whole life, from its prompt length."""
        c = self.config
        if not c.enabled or num_prompt_tokens < c.dense_boundary:
            return AttentionMode.DENSE
        return AttentionMode.SPARSE if num_prompt_tokens <= c.offload_boundary else AttentionMode.OFFLOAD

    def num_filled_blocks(self, num_computed_tokens: int) -> int:
        """Retrieval blocks (counted from the end of the init region) whose every token has K/V."""
        return max(0, num_computed_tokens - self.init_pages * self.block_size) // self.config.retrieval_block_size

    def num_middle_blocks(self, context_len: int) -> int:
        """Middle blocks of a decode step that attends `context_len` tokens (the current one included)."""
        pages = math.ceil(context_len / self.block_size)
        by_window = max(0, pages - self.local_pages - self.init_pages) // self.pages_per_block
        # The current token's block is never middle: its K/V is written during this very step.
        return min(by_window, self.num_filled_blocks(context_len - 1))

    def num_selected(self, num_middle: int) -> int:
        """Blocks attended out of `num_middle`: the top `topk_percent`, at least one if any."""
        return min(num_middle, math.ceil(self.config.topk_percent * num_middle))

    def window_start_page(self, context_len: int) -> int:
        """First page of the window (everything from it to the last page is attended)."""
        return self.init_pages + self.num_middle_blocks(context_len) * self.pages_per_block

    def device_cache_blocks(self, max_model_len: int, max_num_seqs: int, num_pages: int) -> int:
        """Retrieval blocks per layer and KV head that the device block cache of offloaded sequences holds (0 when
        no prompt can offload): unless `device_cache_blocks` sets it, what every offloaded sequence able to run at
        once selects in one step; each holds its init pages and window (plus a block being filled) in the pool
        of `num_pages`, and selects its top-k of the middle of a `max_model_len` context."""
        if self.config.offload_boundary >= max_model_len:
            return 0
        if self.config.device_cache_blocks:
            return self.config.device_cache_blocks
        held = self.init_pages + self.local_pages + self.pages_per_block
        running = max(1, min(max_num_seqs, num_pages // held))
        return running * max(1, self.num_selected(self.num_middle_blocks(max_model_len)))

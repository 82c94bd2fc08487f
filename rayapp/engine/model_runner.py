"""Owns the model, the KV cache tensors and the sampler; turns a ScheduledBatch into tokens."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from collections.abc import Sequence as Seq
from itertools import accumulate, chain
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from rayapp.config import DTYPES, EngineConfig
from rayapp.engine.attention import AttentionMetadata, DecodeGroup, DenseDecode, PagedAttention, StepInputs, StepPlanner
from rayapp.engine.kv_pool import KVPool
from rayapp.engine.outputs import TokenLogprob
from rayapp.engine.pages import NULL_PAGE
from rayapp.engine.sampler import Sampler, token_logprobs
from rayapp.engine.scheduler import ScheduledBatch
from rayapp.engine.sequence import Sequence
from rayapp.engine.structured import constrain
from rayapp.kernels import native
from rayapp.kernels.cpu import cpu_plan
from rayapp.models.llama import load_model
from rayapp.models.loader import ModelSpec, load_state_dict

if TYPE_CHECKING:
    from rayapp.engine.pages import PageCopy

logger = logging.getLogger(__name__)


class ModelRunner:
    """One device: the model weights, the KV pool, and the sampler."""

    def __init__(
        self,
        config: EngineConfig,
        model_path: Path,
        spec: ModelSpec,
        eos_token_ids: Iterable[int] = (),
        reserve: Callable[[int], dict[str, int]] | None = None,
    ) -> None:
        """`reserve(num_pages)`: the pool regions the extensions reserve beside the main one's `num_pages` pages,
        by name."""
        self.config = config
        self.spec = spec
        self.device = torch.device(config.model.device)
        if self.device.type == "npu":
            import torch_npu  # noqa: F401  (registers the npu device with torch)
        prepack = False
        if self.device.type == "cpu":
            plan = cpu_plan(config.model.dtype)
            self.dtype, prepack = plan.dtype, plan.prepack
        else:
            self.dtype = spec.dtype if config.model.dtype == "auto" else DTYPES[config.model.dtype]
        self.model = load_model(spec, load_state_dict(model_path, self.dtype, str(self.device)), prepack)
        self.block_size = config.cache.block_size
        self.num_pages = config.cache.num_pages or self._pages_that_fit()
        page_shape = (spec.num_layers, self.block_size, spec.num_kv_heads, spec.head_dim)
        reserved = {} if reserve is None else reserve(self.num_pages)
        self.pool = KVPool(page_shape, self.num_pages, self.dtype, self.device, reserved)
        self.scale = spec.head_dim**-0.5
        if self.device.type == "cpu" and self.dtype in native.DTYPES:
            native.available()  # build (or load) the C++ decode kernel now, not inside the first step
        self.sampler = Sampler(eos_token_ids)
        logger.info("KV cache: %d pages of %d tokens (%s)", self.num_pages, self.block_size, self.dtype)

    @property
    def page_bytes(self) -> int:
        """Bytes of K and V for one page across all layers."""
        s = self.spec
        return 2 * s.num_layers * self.block_size * s.num_kv_heads * s.head_dim * self.dtype.itemsize

    @torch.inference_mode()
    def copy_pages(self, copies: tuple[PageCopy, ...]) -> None:
        """Copy each `src_page`'s K and V, in every layer, into its `dst_page` (a fork's partial block)."""
        if copies:
            self.pool.copy([c.src_page for c in copies], [c.dst_page for c in copies])

    def _pages_that_fit(self) -> int:
        return max(1, int(self.config.cache.kv_cache_memory_gb * 2**30) // self.page_bytes)

    @torch.inference_mode()
    def run(
        self, batch: ScheduledBatch, planners: Seq[StepPlanner] = ()
    ) -> tuple[list[int | None], list[TokenLogprob | None]]:
        """Compute the batch's tokens, with the extensions' plans (`planners`, in order); return the sampled token
        of each sequence that reached its end (None for a sequence whose prefill chunk stopped short of its last
        token), and its logprobs where its SamplingParams ask for them."""
        input_ids, positions, meta, sample_rows, sample_seqs = self._prepare(batch, planners)
        attention = PagedAttention(self.pool.k, self.pool.v, meta, self.scale)
        hidden = self.model(input_ids, positions, attention)
        tokens: list[int | None] = [None] * len(batch.seqs)
        logprobs: list[TokenLogprob | None] = [None] * len(batch.seqs)
        if not sample_rows:
            return tokens, logprobs
        logits = self.model.compute_logits(hidden[torch.tensor(sample_rows, device=self.device)])
        params = [batch.seqs[i].params for i in sample_seqs]
        generators = [batch.seqs[i].generator for i in sample_seqs]
        seqs = [batch.seqs[i] for i in sample_seqs]
        constrained = constrain(logits, [seq.grammar for seq in seqs])
        sampled = self.sampler(constrained, params, generators, seqs).tolist()
        for i, tok in zip(sample_seqs, sampled):
            tokens[i] = tok
        # Logprobs of the raw logits, before any processor or filter: vLLM's default (`raw_logprobs`).
        wanted = [j for j, p in enumerate(params) if p.logprobs is not None]
        if wanted:
            top = [params[j].logprobs for j in wanted]
            for j, lp in zip(wanted, token_logprobs(logits[wanted], [sampled[j] for j in wanted], top)):
                logprobs[sample_seqs[j]] = lp
        return tokens, logprobs

    def _prepare(
        self, batch: ScheduledBatch, planners: Seq[StepPlanner]
    ) -> tuple[Tensor, Tensor, AttentionMetadata, list[int], list[int]]:
        bs, nd = self.block_size, batch.num_decodes
        starts = [seq.num_computed_tokens for seq in batch.seqs]
        ids = list(
            chain.from_iterable(s.token_ids[a : a + n] for s, a, n in zip(batch.seqs, starts, batch.num_new_tokens))
        )
        ends = list(accumulate(batch.num_new_tokens))
        # A sequence samples when this step computes its last token (decodes, and final prefill chunks).
        sample_seqs = [i for i, seq in enumerate(batch.seqs) if starts[i] + batch.num_new_tokens[i] == seq.num_tokens]
        sample_rows = [ends[i] - 1 for i in sample_seqs]
        # positions, slots: [T]; each token's page is looked up in its sequence's row of the table.
        num_new = self._tensor(batch.num_new_tokens)
        seq_of_token = torch.repeat_interleave(torch.arange(len(batch.seqs), device=self.device), num_new)
        # Row r of sequence i (its rows start at ends[i] - n) sits at position starts[i] + r - (ends[i] - n).
        offsets = self._tensor([a - e + n for a, e, n in zip(starts, ends, batch.num_new_tokens)])
        positions = torch.arange(ends[-1], device=self.device) + offsets[seq_of_token]
        tables = self._page_table(batch.seqs)
        # A sequence an extension holds in its own layout (layer-wise compression's compacted ones) may have no
        # token pages: its column names the null page here, and the extension's plan stores its K/V.
        columns = (positions // bs).clamp_(max=tables.shape[1] - 1)
        slots = tables[seq_of_token, columns] * bs + positions % bs
        prefill_lens = [a + n for a, n in zip(starts[nd:], batch.num_new_tokens[nd:])]
        meta = AttentionMetadata(
            slot_mapping=slots,
            num_decode_tokens=nd,
            prefill_page_table=tables[nd:],
            # The decodes fill the first nd rows, one token each.
            prefill_query_start_loc=self._tensor([0] + [e - nd for e in ends[nd:]]),
            prefill_context_lens=self._tensor(prefill_lens),
        )
        step = StepInputs(batch.seqs, nd, starts, batch.num_new_tokens, tables, slots, self.scale)
        dense = list(range(nd))  # decode rows no extension took
        for planner in planners:
            plan = planner.plan(step, dense)
            if plan is None:
                continue
            if plan.hooks is not None:
                meta.hooks.append(plan.hooks)
            meta.decode_groups.extend(plan.decode_groups)
            taken = set(plan.taken)
            dense = [i for i in dense if i not in taken]
        if dense:
            # Decode reads every page its table names: keep the table no wider than these rows need.
            width = max(len(batch.seqs[i].block_table) for i in dense)
            rows = None if len(dense) == nd else self._tensor(dense)
            ctx = self._tensor([batch.seqs[i].num_computed_tokens + 1 for i in dense])
            table = tables[:nd, :width] if rows is None else tables[rows, :width]
            meta.decode_groups.append(DecodeGroup(rows, DenseDecode(table, ctx, self.scale)))
        return self._tensor(ids), positions, meta, sample_rows, sample_seqs

    def _tensor(self, values: list[int]) -> Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)

    def _page_table(self, seqs: list[Sequence]) -> Tensor:
        width = max([1, *(len(s.block_table) for s in seqs)])  # one column at least: compacted rows name it
        rows = [s.block_table + [NULL_PAGE] * (width - len(s.block_table)) for s in seqs]
        return torch.tensor(rows, dtype=torch.int64, device=self.device).view(len(seqs), width)

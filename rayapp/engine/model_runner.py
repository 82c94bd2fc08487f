"""Owns the model, the KV cache tensors and the sampler; turns a ScheduledBatch into tokens."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from itertools import accumulate, chain
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from rayapp.config import DTYPES, EngineConfig
from rayapp.engine.attention import (
    AttentionMetadata,
    CompactedDecode,
    DecodeGroup,
    DenseDecode,
    PagedAttention,
    SparseDecode,
)
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
from rayapp.sparse.policy import RetrievalPolicy

if TYPE_CHECKING:
    from rayapp.engine.layerwise_kv import LayerwiseKV, LayerwisePlan
    from rayapp.engine.pages import PageCopy
    from rayapp.engine.sparse_kv import SparseKV

logger = logging.getLogger(__name__)


class ModelRunner:
    """One device: the model weights, the KV pool, and the sampler."""

    def __init__(
        self, config: EngineConfig, model_path: Path, spec: ModelSpec, eos_token_ids: Iterable[int] = ()
    ) -> None:
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
        # The device block cache of offloaded sequences: pages after the BlockManager's pool, only
        # when some prompt can be long enough to offload.
        sparse = config.sparse
        limit = config.model.max_model_len or spec.max_position_embeddings
        self.num_cache_blocks = 0
        if sparse.enabled and sparse.offload_boundary < limit:
            self.num_cache_blocks = sparse.device_cache_blocks or self.cache_blocks_needed(limit)
        cache_pages = self.num_cache_blocks * (sparse.retrieval_block_size // self.block_size)
        self.sparse: SparseKV | None = None  # set by the engine when sparse attention is enabled
        self.layerwise: LayerwiseKV | None = None  # set by the engine when layer-wise compression is enabled
        page_shape = (spec.num_layers, self.block_size, spec.num_kv_heads, spec.head_dim)
        reserved = {"sparse_cache": cache_pages} if cache_pages else {}
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

    def cache_blocks_needed(self, max_model_len: int) -> int:
        """Device block cache slots that every offloaded sequence able to run at once needs in one step: each
        holds its init pages and window (plus a block being filled) in the pool, and selects its top-k of the
        middle of a `max_model_len` context per layer and KV head."""
        policy = RetrievalPolicy(self.config.sparse, self.block_size)
        held = policy.init_pages + policy.local_pages + policy.pages_per_block
        running = max(1, min(self.config.scheduler.max_num_seqs, self.num_pages // held))
        return running * max(1, policy.num_selected(policy.num_middle_blocks(max_model_len)))

    def _pages_that_fit(self) -> int:
        return max(1, int(self.config.cache.kv_cache_memory_gb * 2**30) // self.page_bytes)

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> tuple[list[int | None], list[TokenLogprob | None]]:
        """Compute the batch's tokens; return the sampled token of each sequence that reached its end
        (None for a sequence whose prefill chunk stopped short of its last token), and its logprobs
        where its SamplingParams ask for them."""
        input_ids, positions, meta, sample_rows, sample_seqs = self._prepare(batch)
        attention = PagedAttention(self.pool.k, self.pool.v, meta, self.scale, self.sparse, self.layerwise)
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

    def _prepare(self, batch: ScheduledBatch) -> tuple[Tensor, Tensor, AttentionMetadata, list[int], list[int]]:
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
        columns = positions // bs
        # A compacted sequence (a decode row: token i is row i) has no token pages: its column names the null
        # page here, and the layer-wise plan gives its slot in each layer.
        compacted = [i for i, seq in enumerate(batch.seqs[:nd]) if seq.compacted]
        if compacted:
            columns[self._tensor(compacted)] = 0
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
        if self.sparse is not None and nd < len(batch.seqs):
            meta.sparse_capture = self.sparse.plan_capture(batch.seqs[nd:], starts[nd:], batch.num_new_tokens[nd:])
            meta.prefill_host = self.sparse.resume.plan_prefill_host(batch.seqs[nd:])
        if self.layerwise is not None:
            meta.layerwise = self.layerwise.plan(batch.seqs, nd, starts, batch.num_new_tokens, tables, slots, compacted)
        if nd:
            meta.decode_groups = self._decode_groups(batch.seqs[:nd], compacted, tables[:nd], meta.layerwise)
        return self._tensor(ids), positions, meta, sample_rows, sample_seqs

    def _decode_groups(
        self, seqs: list[Sequence], compacted: list[int], tables: Tensor, lw: LayerwisePlan | None
    ) -> list[DecodeGroup]:
        """Each decode row in one group: the `compacted` rows over their own tables; the others as sparse
        retrieval plans them (in their order), dense where it does not."""
        shared = [i for i, s in enumerate(seqs) if not s.compacted]
        groups = []
        if compacted:
            assert self.layerwise is not None and lw is not None
            groups.append(DecodeGroup(self._tensor(compacted), CompactedDecode(self.layerwise, lw, self.scale)))
        if not shared:
            return groups
        rows = None if not compacted else self._tensor(shared)
        shared_tables = tables if rows is None else tables[rows]
        plan = None if self.sparse is None else self.sparse.plan([seqs[i] for i in shared], shared_tables)
        if plan is None:
            # Decode reads every page its table names: keep the table no wider than these rows need.
            width = max(len(seqs[i].block_table) for i in shared)
            ctx = self._tensor([seqs[i].num_computed_tokens + 1 for i in shared])
            groups.append(DecodeGroup(rows, DenseDecode(shared_tables[:, :width], ctx, self.scale)))
            return groups
        assert self.sparse is not None
        shared_t = self._tensor(shared)
        if plan.dense_idx.numel():
            dense = DenseDecode(plan.dense_table, plan.dense_ctx, self.scale)
            groups.append(DecodeGroup(shared_t[plan.dense_idx], dense))
        groups.append(DecodeGroup(shared_t[plan.sparse_idx], SparseDecode(self.sparse, plan, self.scale)))
        return groups

    def _tensor(self, values: list[int]) -> Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)

    def _page_table(self, seqs: list[Sequence]) -> Tensor:
        width = max([1, *(len(s.block_table) for s in seqs)])  # one column at least: compacted rows name it
        rows = [s.block_table + [NULL_PAGE] * (width - len(s.block_table)) for s in seqs]
        return torch.tensor(rows, dtype=torch.int64, device=self.device).view(len(seqs), width)

"""The retrieval plugin's CPU backend against plain torch: which blocks each KV head selects, and the
attention over them, on pages written by vLLM's own cache kernel, for the rows the plugin's `RowPlanner` sends
sparse. Rows that stay dense run vLLM's kernel and must equal it exactly."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from vllm import _custom_ops as ops  # noqa: E402
from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.v1.attention.backend import CommonAttentionMetadata  # noqa: E402

from rayapp.config import SparseConfig  # noqa: E402
from rayapp.kernels.retrieval import ref_block_representation, ref_score_blocks, ref_select_topk_blocks  # noqa: E402
from rayapp.models.loader import resolve_model  # noqa: E402
from rayapp.sparse.policy import RetrievalPolicy  # noqa: E402
from rayapp.vllm_ext.retrieval import EPOCHS, SETTINGS_ENV  # noqa: E402
from rayapp.vllm_ext.retrieval_backend import (  # noqa: E402
    RetrievalCPUImpl,
    RetrievalMetadata,
    cpu_sparse_rows,
    plan_dense_rows,
)
from rayapp.vllm_ext.retrieval_plan import RowPlanner  # noqa: E402

HQ, H, D, BS = 9, 3, 64, 32  # the shipped SmolLM2's heads
SCALE = D**-0.5
CONFIG = SparseConfig(
    enabled=True,
    init_tokens=32,
    local_tokens=64,
    retrieval_block_size=64,
    dense_boundary=256,
    topk_percent=0.3,
    offload_boundary=1 << 20,
)
SETTINGS = json.dumps({k: getattr(CONFIG, k) for k in (
    "init_tokens", "local_tokens", "retrieval_block_size", "dense_boundary", "topk_percent")})  # fmt: skip
ISA = "vec"


def _scheduler(dtype: torch.dtype):
    def scheduler(qsl, seq_lens, heads, kv_heads):
        return ops.cpu_attn_get_scheduler_metadata(
            num_reqs=seq_lens.shape[0], num_heads=heads, num_kv_heads=kv_heads, head_dim=D, seq_lens=seq_lens,
            dtype=dtype, query_start_loc=qsl, causal=True, sliding_window_size=-1, isa=ISA, enable_kv_split=False,
        )  # fmt: skip

    return scheduler


class Batch:
    """Sequences with random K/V in scattered pages of a vLLM CPU cache, and one step's queries."""

    def __init__(self, contexts: list[int], query_lens: list[int], dtype: torch.dtype, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        pages_needed = [-(-c // BS) for c in contexts]
        self.num_pages = sum(pages_needed) + 5
        order = torch.randperm(self.num_pages, generator=gen).tolist()
        self.cache = torch.zeros(self.num_pages, H, BS, 2 * D, dtype=dtype)
        key_cache, value_cache = self.cache.view(self.num_pages, H, 2 * BS, D).chunk(2, dim=2)
        width = max(pages_needed)
        self.tables = torch.zeros(len(contexts), width, dtype=torch.int32)
        self.keys, self.values, step_slots = [], [], []
        for b, (ctx, qlen) in enumerate(zip(contexts, query_lens)):
            own = [order.pop() for _ in range(pages_needed[b])]
            self.tables[b, : len(own)] = torch.tensor(own, dtype=torch.int32)
            k = torch.randn(ctx, H, D, generator=gen).to(dtype)
            v = torch.randn(ctx, H, D, generator=gen).to(dtype)
            slots = torch.tensor([own[t // BS] * BS + t % BS for t in range(ctx)])
            ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots, ISA)
            step_slots.append(slots[ctx - qlen :])
            self.keys.append(k.float())
            self.values.append(v.float())
        self.contexts = contexts
        self.seq_lens = torch.tensor(contexts, dtype=torch.int32)
        self.qsl = torch.zeros(len(contexts) + 1, dtype=torch.int32)
        self.qsl[1:] = torch.cumsum(torch.tensor(query_lens), 0)
        self.q = torch.randn(int(self.qsl[-1]), HQ, D, generator=gen).to(dtype)
        self.dtype = dtype
        self.cm = CommonAttentionMetadata(
            query_start_loc=self.qsl, query_start_loc_cpu=self.qsl, seq_lens=self.seq_lens, num_reqs=len(contexts),
            num_actual_tokens=int(self.qsl[-1]), max_query_len=max(query_lens), max_seq_len=max(contexts),
            block_table_tensor=self.tables, slot_mapping=torch.cat(step_slots),
        )  # fmt: skip
        EPOCHS.begin_step(torch.arange(self.num_pages), self.num_pages)

    def stock(self) -> torch.Tensor:
        """vLLM's own kernel over the whole batch."""
        key_cache, value_cache = self.cache.view(self.num_pages, H, 2 * BS, D).chunk(2, dim=2)
        out = torch.empty_like(self.q)
        metadata = _scheduler(self.dtype)(self.qsl, self.seq_lens, HQ, H)
        ops.cpu_attention_with_kv_cache(
            query=self.q, key_cache=key_cache, value_cache=value_cache, output=out, query_start_loc=self.qsl,
            seq_lens=self.seq_lens, scale=SCALE, causal=True, alibi_slopes=None, sliding_window=-1,
            block_table=self.tables, softcap=0.0, scheduler_metadata=metadata, s_aux=None,
        )  # fmt: skip
        return out

    def metadata(self) -> RetrievalMetadata:
        """The step as the CPU builder splits it: `RowPlanner` picks the sparse rows, each part in the CPU kernel's
        view."""
        scheduler = _scheduler(self.dtype)
        qsl, lens, tables = self.qsl, self.seq_lens, self.tables
        step = RowPlanner(CONFIG, BS).plan(self.cm, attends=True)
        dense = None
        if step.dense:
            dense = plan_dense_rows(HQ, H, step.dense, step.query_start_loc, step.seq_lens, tables, scheduler)
        return RetrievalMetadata(
            num_actual_tokens=self.q.shape[0], max_query_len=int((qsl[1:] - qsl[:-1]).max()), query_start_loc=qsl,
            max_seq_len=max(self.contexts), seq_lens=lens, block_table=tables,
            slot_mapping=self.cm.slot_mapping, scheduler_metadata=scheduler(qsl, lens, HQ, H),
            dense_rows=dense, sparse_rows=cpu_sparse_rows(step.sparse, HQ, H, scheduler),
        )  # fmt: skip


def sparse_reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> tuple[list[set[int]], torch.Tensor]:
    """Plain torch for one sparse decode row under CONFIG, pages of BS: the blocks each KV head selects, and the
    attention output. q [HQ, D] the row's query; keys, values [ctx, H, D] float, its whole context."""
    p = RetrievalPolicy(CONFIG, BS)
    ctx, rb, q = keys.shape[0], CONFIG.retrieval_block_size, q.float()
    init, n_mid, window = p.init_pages * BS, p.num_middle_blocks(ctx), p.window_start_page(ctx) * BS
    reps = ref_block_representation(
        keys[init : init + n_mid * rb].view(n_mid, rb, H, D), CONFIG.representation, CONFIG.representative_keys
    )
    scores = ref_score_blocks(q[None], reps[None], CONFIG.representation)
    chosen = ref_select_topk_blocks(scores, torch.tensor([n_mid]), torch.tensor([p.num_selected(n_mid)]))[0]
    out = torch.empty(HQ, D)
    for hq in range(HQ):
        h = hq // (HQ // H)
        tokens = list(range(init)) + [init + j * rb + t for j in sorted(chosen[h]) for t in range(rb)]
        tokens += list(range(window, ctx))
        out[hq] = torch.softmax(keys[tokens, h] @ q[hq] * SCALE, dim=0) @ values[tokens, h]
    return chosen, out


def _impl(monkeypatch) -> RetrievalCPUImpl:
    monkeypatch.setenv(SETTINGS_ENV, SETTINGS)
    with set_current_vllm_config(VllmConfig(model_config=ModelConfig(str(resolve_model(None))))):
        return RetrievalCPUImpl(HQ, D, SCALE, H, None, None, "auto")


LAYER = SimpleNamespace(layer_name="model.layers.4.self_attn.attn", isa=ISA, _k_scale_float=1.0, _v_scale_float=1.0)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
def test_sparse_rows_select_and_attend_as_plain_torch_and_dense_rows_stay_vllms(monkeypatch, dtype, tol):
    # A prefill chunk, a decode below the boundary, and two decodes above it, in one step.
    batch = Batch([300, 200, 700, 450], [40, 1, 1, 1], dtype)
    impl = _impl(monkeypatch)
    meta = batch.metadata()
    assert meta.sparse_rows.tokens.tolist() == [int(batch.qsl[row]) for row in (2, 3)]  # the two long decodes
    out = torch.zeros_like(batch.q)
    impl.forward(LAYER, batch.q, None, None, batch.cache, meta, out)
    stock = batch.stock()
    dense_tokens = meta.dense_rows.tokens
    assert torch.equal(out[dense_tokens], stock[dense_tokens])
    blocks = impl.select(batch.q[meta.sparse_rows.tokens], batch.cache, ISA, meta.sparse_rows)
    for i, row in enumerate([2, 3]):
        token = int(batch.qsl[row])
        chosen, expected = sparse_reference(batch.q[token], batch.keys[row], batch.values[row])
        k = int(meta.sparse_rows.num_selected[i])
        assert [set(blocks[i, h, :k].tolist()) for h in range(H)] == chosen
        assert (out[token].float() - expected).abs().max() < tol
        # Sparse is not dense: the dropped middle changes the output.
        assert (stock[token].float() - expected).abs().max() > 0.1


def test_representations_are_kept_until_a_page_of_their_block_is_written_again(monkeypatch):
    batch = Batch([700], [1], torch.float32, seed=1)
    first = batch.metadata().sparse_rows
    n_mid = int(first.num_middle[0])
    assert first.stale.shape[0] == n_mid  # all computed once
    assert batch.metadata().sparse_rows.stale.shape[0] == 0  # then kept, step after step
    rewritten = int(first.middle[0, 3, 0])  # vLLM gave the first page of middle block 3 to other tokens
    EPOCHS.begin_step(torch.tensor([rewritten]), batch.num_pages)
    again = batch.metadata().sparse_rows
    assert again.stale.tolist() == [first.middle[0, 3].tolist()]
    EPOCHS.note_written([int(first.middle[0, 5, 1])])  # a KV connector filled a page outside the forward
    assert batch.metadata().sparse_rows.stale.tolist() == [first.middle[0, 5].tolist()]

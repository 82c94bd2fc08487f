"""Layer-wise KV compression in the engine (PyramidKV / SnapKV): capture, select, compact, decode.

A sequence prefills densely, every layer in the shared page table. While the last `window` prompt
positions pass through a compressed layer (every layer from `full_layers` on), their queries and
the log-sum-exp the prefill attention returns for them are kept. When the prompt's last chunk has
run, each compressed layer scores every prompt key from those rows (`snapkv_scores`, O(window x N),
no second softmax over the prompt) and picks its budget of tokens per KV head (`select_tokens`).

After that step the sequence is compacted. Every layer gets a page table of its own, made of
*slots*: one layer's share of a pool page, numbered `layer * P + page` in the cache flattened to
`[L * P, bs, Hkv, D]`. Full layers copy every token into their slots; compressed layers copy
their selected tokens, per head, in positional order. The dense prompt pages are then released:
their full blocks stay in the prefix cache, exact in every layer, so a later turn still hits them,
while the slots come from a few pool pages the sequence takes instead (its `carrier_pages`; its
`block_table` empties). Decode appends each new token to every layer's table.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from rayapp.config import EngineConfig
from rayapp.engine.attention import DecodeGroup, HostPages, StepInputs, StepPlan
from rayapp.engine.block_manager import BlockManager
from rayapp.engine.sequence import Sequence
from rayapp.kernels.attention import paged_decode_attention, paged_prefill_attention
from rayapp.kernels.snapkv import pyramid_budgets, select_tokens, snapkv_scores
from rayapp.models.loader import ModelSpec
from rayapp.observability import Metric, counters, gauges

METRICS = counters(
    {
        "layerwise_compacted_seqs": "Sequences whose KV was compressed layer-wise after their prompt",
        "layerwise_compaction_skipped": "Prompts left dense because the pool had no pages for their compacted KV",
        "layerwise_pages_saved": "KV pages given back to the pool by layer-wise compaction",
    }
) + gauges(
    {
        "layerwise_running_compacted": "Running sequences holding layer-wise compressed KV",
        "layerwise_slots_held": "Per-layer page slots the compressed sequences hold (a pool page has one per layer)",
    }
)


@dataclass
class _Capture:
    """One prefilling sequence's window rows in the compressed layers, and what they selected."""

    first: int  # position of the first window query
    budgets: list[int]  # tokens each compressed layer keeps
    q: Tensor  # [Lc, W, Hq, D] float32
    lse: Tensor  # [Lc, W, Hq]
    selected: list[Tensor | None]  # per compressed layer, token indices [Hkv, budget] once the prompt ran


@dataclass
class _Compacted:
    """A compacted sequence's per-layer tables of slot pages."""

    table: Tensor  # [L, max_pages] slot pages of each layer, in token order (the null page's slot 0 past num_pages)
    num_pages: list[int]  # slot pages each layer holds
    lens: list[int]  # tokens each layer holds
    free_slots: list[int]  # slots of the sequence's pool pages no layer uses yet


@dataclass
class CaptureBatch:
    """This step's prefill rows in some sequence's observation window, as a batch for the prefill kernel."""

    src: Tensor  # [M] rows of the step's prefill queries
    page_table: Tensor  # [S, w] the capturing sequences' pages
    query_start_loc: Tensor  # [S + 1] over src
    context_lens: Tensor  # [S] each sequence's tokens in the cache after this step
    owners: list[tuple[str, int, int, int]]  # seq_id, first window slot, rows [r0, r1) of src
    finishing: list[tuple[str, int, int]]  # seq_id, row of page_table, prompt length: prompts ending now


@dataclass
class LayerwisePlan:
    """One step's layer-wise work. Row indices refer to the step's decode rows."""

    capture: CaptureBatch | None
    compact_idx: Tensor | None = None  # [Bc] decode rows of compacted sequences
    tables: list[Tensor] | None = None  # per layer [Bc, w_l] slot pages (as wide as that layer needs)
    context_lens: Tensor | None = None  # [L, Bc] tokens per layer, this step's included
    slots: Tensor | None = None  # [L, T] flat slot of every token of the step, per layer


class _LayerwiseHooks:
    """Inside each layer of a step: compacted rows store into their own slots; compressed layers keep the
    window rows' queries and log-sum-exp after the prefill."""

    def __init__(self, layerwise: LayerwiseKV, plan: LayerwisePlan, scale: float) -> None:
        self.layerwise, self.plan, self.scale = layerwise, plan, scale

    def store(self, layer: int, k: Tensor, v: Tensor) -> bool:
        if self.plan.slots is None:
            return False
        self.layerwise.store(layer, k, v, self.plan)
        return True

    def prefill_queries(self, layer: int, q: Tensor) -> HostPages | None:
        return None

    def after_prefill(self, layer: int, q: Tensor, k_cache: Tensor, v_cache: Tensor, out: Tensor) -> None:
        if self.plan.capture is not None and layer >= self.layerwise.Lf:
            self.layerwise.capture(layer, q, k_cache, v_cache, out, self.plan.capture, self.scale)


class LayerwiseKV:
    """Layer-wise compression state of one engine's sequences; reads and writes the ModelRunner's KV pools.
    Registered as the engine extension `layerwise`."""

    @staticmethod
    def reserved_pages(config: EngineConfig, spec: ModelSpec, num_pages: int) -> dict[str, int]:
        """None: compacted sequences take their carrier pages from the BlockManager's pool."""
        return {}

    def __init__(self, config: EngineConfig, runner, block_manager: BlockManager, max_model_len: int) -> None:
        self.cfg = config.layerwise
        spec = runner.spec
        self.L, self.Hq, self.Hkv, self.D = spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim
        if self.cfg.full_layers > self.L:
            raise ValueError(
                f"layerwise.full_layers={self.cfg.full_layers} exceeds the model's {self.L} layers; use 0 to {self.L}"
            )
        self.Lf = self.cfg.full_layers
        self.runner = runner
        self.bm = block_manager
        self.bs = config.cache.block_size
        self.device = runner.device
        self.max_pages = math.ceil((config.model.max_model_len or spec.max_position_embeddings) / self.bs) + 1
        self._captures: dict[str, _Capture] = {}
        self._compacted: dict[str, _Compacted] = {}
        # With sparse retrieval on, its prompts (from dense_boundary on) are not compressed.
        self.max_prompt_tokens = config.sparse.dense_boundary if config.sparse.enabled else None
        self.counters = {"layerwise_compacted_seqs": 0, "layerwise_compaction_skipped": 0, "layerwise_pages_saved": 0}

    def compresses(self, seq: Sequence) -> bool:
        """Whether `seq` is compacted after its prompt (not when sparse retrieval takes it)."""
        return self.max_prompt_tokens is None or seq.num_prompt_tokens < self.max_prompt_tokens

    def min_recompute_tokens(self, seq: Sequence) -> int:
        """The observation window's queries score the prompt: a prefix-cache hit leaves them to compute."""
        return min(seq.num_prompt_tokens, self.cfg.window) if self.compresses(seq) else 1

    def keeps_own_layout(self, seq: Sequence) -> bool:
        """A compacted sequence's pages hold per-layer slots, not its tokens in order."""
        return seq.compacted

    def begin_step(self) -> None:
        """Nothing to prepare: the step's plan is made with the model runner's metadata."""

    def metrics(self) -> tuple[Metric, ...]:
        return METRICS

    # --- plans -----------------------------------------------------------------------------

    def plan(self, step: StepInputs, decode_rows: list[int]) -> StepPlan | None:
        """Takes the decode rows of compacted sequences, which store into and attend over their own slots; the
        prefill rows in an observation window keep their queries and log-sum-exp (None when neither happens)."""
        comp = [i for i in decode_rows if step.seqs[i].compacted]
        plan = LayerwisePlan(self._plan_capture(step.seqs, step.num_decodes, step.starts, step.num_new, step.tables))
        if comp:
            self._plan_compacted(plan, step.seqs, comp, step.slot_mapping)
        elif plan.capture is None:
            return None
        hooks = _LayerwiseHooks(self, plan, step.scale)
        if not comp:
            return StepPlan(hooks)

        def attend(layer: int, q: Tensor, k_cache: Tensor, v_cache: Tensor) -> Tensor:
            return self.attend(layer, q, plan, step.scale)  # over their own slots, not the shared pages

        return StepPlan(hooks, [DecodeGroup(plan.compact_idx, attend)], comp)

    def reserve(self, seq: Sequence, num_new_tokens: int) -> bool | None:
        """Room in every layer's slots for a compacted sequence (`grow`); None for the others, whose pages are
        the BlockManager's."""
        return self.grow(seq, num_new_tokens) if seq.compacted else None

    def _plan_compacted(self, plan: LayerwisePlan, seqs: list[Sequence], comp: list[int], slot_mapping: Tensor) -> None:
        bs = self.bs
        states = [self._compacted[seqs[i].seq_id] for i in comp]
        lens = self._tensor([st.lens for st in states])  # [Bc, L]
        table = torch.stack([st.table for st in states])  # [Bc, L, max_pages]
        # new: [Bc, L] flat slot of this step's token in each layer
        page = table.gather(2, (lens // bs)[..., None])[..., 0]
        new = page * bs + lens % bs
        ctx = lens + 1
        widths = (-(-ctx.amax(0) // bs)).tolist()
        # Every other token goes to its page in each layer: the layer's offset in the flattened cache.
        offsets = torch.arange(self.L, device=self.device)[:, None] * (self.runner.pool.num_pages * bs)
        slots = slot_mapping[None] + offsets  # [L, T]
        comp_t = self._tensor(comp)
        slots[:, comp_t] = new.T
        plan.compact_idx = comp_t
        plan.tables = [table[:, layer, : widths[layer]] for layer in range(self.L)]
        plan.context_lens = ctx.T.contiguous()
        plan.slots = slots

    def _plan_capture(
        self, seqs: list[Sequence], num_decodes: int, starts: list[int], num_new: list[int], tables: Tensor
    ) -> CaptureBatch | None:
        src: list[int] = []
        rows, qsl, ctx = [], [0], []
        owners, finishing = [], []
        offset = 0  # row of the sequence's first token among the step's prefill rows
        for i in range(num_decodes, len(seqs)):
            seq, start, n = seqs[i], starts[i], num_new[i]
            if not self.compresses(seq):
                offset += n
                continue
            end, total = start + n, seq.num_tokens
            cap = self._captures.get(seq.seq_id)
            first = total - min(self.cfg.window, total)
            lo = max(start, first)
            if lo < end:
                if cap is None:
                    cap = self._captures[seq.seq_id] = self._new_capture(total)
                r0 = len(src)
                src.extend(range(offset + lo - start, offset + n))
                owners.append((seq.seq_id, lo - first, r0, len(src)))
                if end == total:
                    finishing.append((seq.seq_id, len(rows), total))
                rows.append(i)
                qsl.append(len(src))
                ctx.append(end)
            offset += n
        if not rows:
            return None
        return CaptureBatch(
            self._tensor(src), tables[self._tensor(rows)], self._tensor(qsl), self._tensor(ctx), owners, finishing
        )

    def _new_capture(self, num_tokens: int) -> _Capture:
        cfg, lc = self.cfg, self.L - self.Lf
        w = min(cfg.window, num_tokens)
        budgets = pyramid_budgets(self.L, self.Lf, num_tokens, cfg.compression_ratio, cfg.window, cfg.schedule)
        q = torch.zeros(lc, w, self.Hq, self.D, device=self.device)
        lse = torch.zeros(lc, w, self.Hq, device=self.device)
        return _Capture(num_tokens - w, budgets[self.Lf :], q, lse, [None] * lc)

    # --- per layer ---------------------------------------------------------------------------

    def store(self, layer: int, k: Tensor, v: Tensor, plan: LayerwisePlan) -> None:
        """Write the step's K/V of `layer` (k, v: [T, Hkv, D]) into the flattened cache at `plan.slots[layer]`."""
        assert plan.slots is not None
        kc, vc = (c.view(-1, self.Hkv, self.D) for c in self.runner.pool.slots())
        kc.index_copy_(0, plan.slots[layer], k.to(kc.dtype))
        vc.index_copy_(0, plan.slots[layer], v.to(vc.dtype))

    def attend(self, layer: int, q: Tensor, plan: LayerwisePlan, scale: float) -> Tensor:
        """Attention of the compacted decode rows at `layer` over their own slots. q: [Bc, Hq, D]."""
        assert plan.tables is not None and plan.context_lens is not None
        kc, vc = self.runner.pool.slots()
        return paged_decode_attention(q, kc, vc, plan.tables[layer], plan.context_lens[layer], scale)

    def capture(
        self, layer: int, q: Tensor, k_cache: Tensor, v_cache: Tensor, out: Tensor, cap: CaptureBatch, scale: float
    ) -> None:
        """Keep the window rows of compressed `layer`, and select its tokens for prompts that end this step.

        q, out: [T, Hq, D], the step's prefill queries and their attention output. The window rows go
        through the prefill kernel's log-sum-exp path, and `out` takes that path's rows.
        """
        cl = layer - self.Lf
        # qw, lse: [M, Hq, D], [M, Hq]
        qw = q[cap.src]
        ow, lse = paged_prefill_attention(
            qw, k_cache, v_cache, cap.page_table, cap.query_start_loc, cap.context_lens, scale, return_lse=True
        )
        out[cap.src] = ow
        for seq_id, slot, r0, r1 in cap.owners:
            c = self._captures[seq_id]
            c.q[cl, slot : slot + r1 - r0] = qw[r0:r1].float()
            c.lse[cl, slot : slot + r1 - r0] = lse[r0:r1]
        for seq_id, row, total in cap.finishing:
            c = self._captures[seq_id]
            scores = snapkv_scores(c.q[cl], k_cache, cap.page_table[row], total, c.lse[cl], scale, self.cfg.kernel_size)
            c.selected[cl] = select_tokens(scores, c.budgets[cl], c.q.shape[1])

    # --- between steps -------------------------------------------------------------------------

    @torch.inference_mode()
    def after_step(self, seqs: list[Sequence]) -> None:
        """Count the token each compacted sequence stored; compact the sequences whose prompt just ran."""
        for seq in seqs:
            st = self._compacted.get(seq.seq_id)
            if st is not None:
                st.lens = [n + 1 for n in st.lens]
                continue
            cap = self._captures.get(seq.seq_id)
            if cap is not None and seq.num_computed_tokens == cap.first + cap.q.shape[1]:
                self._compact(seq, self._captures.pop(seq.seq_id))

    @torch.inference_mode()
    def grow(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Give compacted `seq` the slots for `num_new_tokens` more tokens in every layer, taking pool pages
        as needed; False (nothing taken) when the pool has too few free pages."""
        st = self._compacted[seq.seq_id]
        need = [-(-(n + num_new_tokens) // self.bs) - have for n, have in zip(st.lens, st.num_pages)]
        short = sum(need) - len(st.free_slots)
        if short > 0:
            pages = self.bm.allocate_carriers(seq, -(-short // self.L))
            if pages is None:
                return False
            st.free_slots.extend(self.runner.pool.slot_ids(pages))
        for layer, n in enumerate(need):
            for _ in range(n):
                st.table[layer, st.num_pages[layer]] = st.free_slots.pop()
                st.num_pages[layer] += 1
        return True

    def drop(self, seq: Sequence) -> None:
        """Forget `seq` (finished, aborted or preempted; its pages are freed by the scheduler)."""
        self._captures.pop(seq.seq_id, None)
        self._compacted.pop(seq.seq_id, None)

    def _compact(self, seq: Sequence, cap: _Capture) -> None:
        total, bs, L = seq.num_computed_tokens, self.bs, self.L
        lens = [total] * self.Lf + [sel.shape[1] for sel in cap.selected if sel is not None]
        assert len(lens) == L, "a compressed layer selected no tokens for a finished prompt"
        num_pages = [-(-n // bs) for n in lens]
        # keys, values: [L, total, Hkv, D], the prompt in every layer; kept: each layer's tokens to keep.
        keys, values = (
            kv.view(L, -1, self.Hkv, self.D)[:, :total]
            for kv in self.runner.pool.gather(seq.block_table[: -(-total // bs)])
        )
        kept = []
        for layer in range(L):
            if layer < self.Lf:
                kept.append((keys[layer], values[layer]))
                continue
            sel = cap.selected[layer - self.Lf]
            assert sel is not None
            # index: [budget, Hkv, D], head h of row j takes token sel[h, j]
            index = sel.T[..., None].expand(-1, -1, self.D)
            kept.append((keys[layer].gather(0, index), values[layer].gather(0, index)))
        num_released = len(seq.block_table)
        carriers = self.bm.allocate_carriers(seq, -(-sum(num_pages) // L))
        if carriers is None:
            self.counters["layerwise_compaction_skipped"] += 1
            return
        free = self.runner.pool.slot_ids(carriers)
        table = torch.zeros(L, self.max_pages, dtype=torch.int64, device=self.device)
        kc, vc = (c.view(-1, self.Hkv, self.D) for c in self.runner.pool.slots())
        for layer, (k, v) in enumerate(kept):
            slots = self._tensor([free.pop() for _ in range(num_pages[layer])])
            table[layer, : len(slots)] = slots
            # dest: [lens[layer]] flat token rows of the layer's slots, in order
            dest = (slots[:, None] * bs + torch.arange(bs, device=self.device)).view(-1)[: lens[layer]]
            kc.index_copy_(0, dest, k)
            vc.index_copy_(0, dest, v)
        self._compacted[seq.seq_id] = _Compacted(table, num_pages, lens, free)
        self.counters["layerwise_compacted_seqs"] += 1
        self.counters["layerwise_pages_saved"] += num_released - len(carriers)

    def stats(self) -> dict[str, int]:
        """Counters since start, and the compacted sequences and the pool pages they hold now."""
        running = [s for s in self._compacted.values()]
        return {
            **self.counters,
            "layerwise_running_compacted": len(running),
            "layerwise_slots_held": sum(sum(st.num_pages) + len(st.free_slots) for st in running),
        }

    def _tensor(self, values: list) -> Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)

"""One replica's engine: requests in, a step at a time, outputs out."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

from rayapp.blocks import AllCleared, BlockHash, KVEvent
from rayapp.config import EngineConfig, LayerwiseConfig, SparseConfig
from rayapp.engine.block_manager import BlockManager
from rayapp.engine.detokenizer import IncrementalDetokenizer
from rayapp.engine.extension import build_extensions
from rayapp.engine.kv_transfer import KVTransfer, TierBlock, TierPlan, TierPort
from rayapp.engine.layerwise_kv import LayerwiseKV
from rayapp.engine.model_runner import ModelRunner
from rayapp.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput, TokenLogprob
from rayapp.engine.request import Request, RequestGroup
from rayapp.engine.sampler import make_generator
from rayapp.engine.sampling_params import SamplingParams
from rayapp.engine.scheduler import Scheduler
from rayapp.engine.sequence import Sequence
from rayapp.engine.sparse_kv import SparseKV
from rayapp.engine.structured import Grammars, accept
from rayapp.models.loader import DEFAULT_MODEL, ModelSpec, resolve_model
from rayapp.models.tokenizer import load_tokenizer
from rayapp.observability import Metric, counters, gauges

METRICS = counters(
    {
        "prompt_tokens": "Prompt tokens received",
        "cached_prompt_tokens": "Prompt tokens served from the prefix cache instead of computed",
        "tier_loaded_tokens": "Of the cached prompt tokens, those loaded from the cluster KV tier",
        "tier_reloaded_tokens": "Tokens preempted sequences loaded back from the cluster KV tier, not recomputed",
        "generation_tokens": "Tokens generated",
        "num_preemptions": "Sequences preempted (recomputed later) because KV pages ran out",
    }
) + gauges(
    {
        "pages_free": "KV pages no sequence holds (cached ones included)",
        "pages_total": "KV pages in the pool",
        "pages_cached": "Free KV pages still holding a reusable prefix block",
        "num_running": "Sequences in the running batch",
        "num_waiting": "Sequences queued for admission",
    }
)


class LLMEngine:
    """Continuous-batching engine over a paged, prefix-shared KV cache.

    `step()` fits on a screen: schedule, run the model, append the sampled tokens, retire the
    finished. It is not thread-safe; `EngineLoop` drives it from one thread.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        model_path = resolve_model(config.model.model)
        self.spec = ModelSpec.from_dir(model_path)
        self.model_id = config.model.model or DEFAULT_MODEL
        limit = self.spec.max_position_embeddings
        if config.model.max_model_len is not None and config.model.max_model_len > limit:
            raise ValueError(f"max_model_len={config.model.max_model_len} exceeds the model's context length {limit}")
        self.max_model_len = config.model.max_model_len or limit
        self.tokenizer = load_tokenizer(model_path)
        self.runner = ModelRunner(config, model_path, self.spec)
        self.block_manager = BlockManager(
            self.runner.num_pages, config.cache.block_size, self.model_id, config.cache.enable_prefix_caching
        )
        self.scheduler = Scheduler(config.scheduler, self.block_manager)
        self.extensions = build_extensions(config, self.runner, self.block_manager, self.scheduler, self.max_model_len)
        self.eos_token_ids = set(self.spec.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self.grammars = Grammars(self.tokenizer, self.spec.vocab_size)
        self._requests: dict[str, Request] = {}
        # Requests with n > 1, by request id, until their last answer finishes.
        self._groups: dict[str, RequestGroup] = {}
        self._counters = {"num_requests": 0, "prompt_tokens": 0, "cached_prompt_tokens": 0, "generation_tokens": 0}
        self._counters["tier_loaded_tokens"] = 0  # of the cached prompt tokens, those loaded from the cluster tier
        self._counters["tier_reloaded_tokens"] = 0  # tokens preempted requests loaded back from the tier
        self._num_preemptions = 0
        # Set by `attach_tier`: the cluster KV tier, given by the caller (the engine does not import Ray).
        self.kv_transfer: KVTransfer | None = None
        # Set by a driver that fetches off the engine thread (`EngineLoop`): called with a parked preempted
        # request (`_park_for_tier`), which it hands back with `requeue`. Unset (the offline `LLM`), preempted
        # requests recompute what the local cache lost.
        self.fetch_parked: Callable[[Request, TierPlan], None] | None = None
        self.scheduler.park_before_admit = self._park_for_tier

    @property
    def sparse(self) -> SparseKV | None:
        """The sparse retrieval extension, when `sparse.enabled`."""
        return self.runner.sparse

    @property
    def layerwise(self) -> LayerwiseKV | None:
        """The layer-wise compression extension, when `layerwise.enabled`."""
        return self.runner.layerwise

    def use_sparse_config(self, sparse: SparseConfig) -> None:
        """Switch the sparse settings between requests (the engine must be idle).

        For evaluation: one prefill, many scorers, each run after the first hitting the prefix
        cache. The device block cache keeps the size the engine was built with.
        """
        self._reconfigure("use_sparse_config", dataclasses.replace(self.config, sparse=sparse))

    def use_layerwise_config(self, layerwise: LayerwiseConfig) -> None:
        """Switch the layer-wise compression settings between requests (the engine must be idle).

        For evaluation: prompts prefilled once stay in the prefix cache, in every layer, so each
        setting after the first recomputes only the observation window.
        """
        self._reconfigure("use_layerwise_config", dataclasses.replace(self.config, layerwise=layerwise))

    def _reconfigure(self, caller: str, config: EngineConfig) -> None:
        """Build the extensions anew for `config` (their counters restart)."""
        if self.has_unfinished_requests():
            raise RuntimeError(f"{caller} needs an idle engine: finish or abort the running requests first")
        self.config = config
        self.extensions = build_extensions(config, self.runner, self.block_manager, self.scheduler, self.max_model_len)

    @classmethod
    def from_options(cls, **options: Any) -> LLMEngine:
        return cls(EngineConfig.from_options(**options))

    def add_request(
        self,
        request_id: str,
        prompt: str | None = None,
        params: SamplingParams | None = None,
        prompt_token_ids: list[int] | None = None,
        cache_salt: str = "",
        block_hashes: list[BlockHash] | None = None,
    ) -> None:
        """Queue a request; it joins the running batch at the next step boundary.

        Raises ValueError, saying what to change, for an empty or too long prompt or one that
        cannot fit in the KV pool.
        """
        self.enqueue(self.prepare_request(request_id, prompt, params, prompt_token_ids, cache_salt, block_hashes))

    def enqueue(self, request: Request) -> None:
        """Hand a prepared request to the scheduler (engine thread only)."""
        self._requests[request.seq.seq_id] = request
        if request.group is not None:
            self._groups[request.group.request_id] = request.group
        self.scheduler.add(request.seq)
        self._counters["num_requests"] += 1
        self._counters["prompt_tokens"] += request.seq.num_prompt_tokens

    def prepare_request(
        self,
        request_id: str,
        prompt: str | None = None,
        params: SamplingParams | None = None,
        prompt_token_ids: list[int] | None = None,
        cache_salt: str = "",
        block_hashes: list[BlockHash] | None = None,
        delivered_tokens: int = 0,
        delivered_chars: int | None = None,
    ) -> Request:
        """Validate and tokenize without touching the scheduler (safe from any thread).

        `block_hashes`, when given, are the prompt's full-block hashes as `rayapp.blocks.hash_blocks`
        computes them with this engine's model id and `cache_salt` (the ingress hashes once).
        `delivered_tokens`: the prompt's last tokens are an answer's output that another engine already
        streamed (a moved request), with `delivered_chars` of their text (None: all of it); their text is read
        again for the detokenizer, and only what the client has not seen is sent.
        """
        if request_id in self._requests or request_id in self._groups:
            raise ValueError(f"request_id {request_id!r} is already in use")
        params = params or SamplingParams()
        if params.n > 1 and delivered_tokens:
            raise ValueError("a moved answer (delivered_tokens) continues one answer: give it n=1")
        if (prompt is None) == (prompt_token_ids is None):
            raise ValueError("give exactly one of prompt or prompt_token_ids")
        if prompt is not None:
            if not isinstance(prompt, str):
                raise ValueError(f"prompt must be a string, got {type(prompt).__name__}")
            prompt_token_ids = self.tokenizer.encode(prompt)
        ids = list(prompt_token_ids or [])
        if not ids:
            raise ValueError("prompt is empty: give at least one token")
        vocab = self.spec.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt_token_ids must be integers in [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(ids)} tokens; max_model_len is {self.max_model_len}, which must also leave "
                f"room for at least one generated token"
            )
        room = self.max_model_len - len(ids)
        max_new = room if params.max_tokens is None else min(params.max_tokens, room)
        bs = self.block_manager.block_size
        pages = math.ceil((len(ids) + max_new - 1) / bs)
        if pages > self.block_manager.num_pages:
            raise ValueError(
                f"prompt ({len(ids)} tokens) plus max_tokens ({max_new}) needs {pages} KV pages but the pool has "
                f"{self.block_manager.num_pages}; lower max_tokens or raise num_pages / kv_cache_memory_gb"
            )
        if block_hashes is not None and len(block_hashes) > len(ids) // self.block_manager.block_size:
            raise ValueError(f"got {len(block_hashes)} block hashes for a {len(ids)}-token prompt")
        if not 0 <= delivered_tokens < len(ids):
            raise ValueError(f"delivered_tokens={delivered_tokens} must be in [0, {len(ids)}) for this prompt")
        seq = self._sequence(request_id, ids, params, cache_salt, block_hashes)
        cut = len(ids) - delivered_tokens
        detok = IncrementalDetokenizer(
            self.tokenizer, ids[:cut], params.stop, delivered_ids=ids[cut:], delivered_chars=delivered_chars
        )
        request = Request(seq, prompt, ids, detok, max_new, [] if params.logprobs is not None else None)
        if params.n > 1:
            request.group = RequestGroup(request_id, params.n, [request])
        return request

    def _sequence(
        self, seq_id: str, ids: list[int], params: SamplingParams, cache_salt: str, block_hashes: list[BlockHash] | None
    ) -> Sequence:
        seq = Sequence(seq_id, ids, params, cache_salt=cache_salt, block_hashes=block_hashes)
        seq.generator = make_generator(params, self.runner.device)
        if params.structured is not None:
            seq.grammar = self.grammars.matcher(params.structured)
        seq.min_recompute_tokens = max((e.min_recompute_tokens(seq) for e in self.extensions), default=1)
        return seq

    def _fork(self, parent: Request) -> None:
        """Start the other answers of `parent`'s request, which has just computed its prompt (engine thread).

        Each shares the prompt's pages, its partial last block copied, and computes the prompt's last token
        again to sample a first token of its own. Where pages cannot be shared (no free page for the copy,
        a prompt sparse retrieval or layer-wise compression keeps in its own layout, a full batch), the
        answer queues at the front instead and its prefix match finds the prompt's blocks in the cache.
        """
        group, seq, bm = parent.group, parent.seq, self.block_manager
        group.forked = True
        ids = parent.prompt_token_ids
        shared = not any(e.keeps_own_layout(seq) for e in self.extensions)
        queued = []
        for i in range(1, group.n):
            params = seq.params
            if params.seed is not None:
                params = dataclasses.replace(params, seed=params.seed + i)
            hashes = seq.block_hashes[: len(ids) // bm.block_size]
            child = Request(
                self._sequence(f"{group.request_id}#{i}", ids, params, seq.cache_salt, hashes), parent.prompt, ids,
                IncrementalDetokenizer(self.tokenizer, ids, params.stop), parent.max_new_tokens,
                None if parent.logprobs is None else [], counted_cached=True, index=i, group=group,
            )  # fmt: skip
            group.members.append(child)
            self._requests[child.seq.seq_id] = child
            if shared and not self.scheduler.is_full:
                fork = bm.fork(seq, child.seq, len(ids) - 1)
                if fork.ok:
                    self.runner.copy_pages(fork.copies)
                    self.scheduler.add_running(child.seq)
                    continue
            queued.append(child.seq)
        for child_seq in reversed(queued):
            self.scheduler.add(child_seq, front=True)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request (all of its answers) and free its pages; returns its last output, or None if it is
        unknown or done."""
        group = self._groups.pop(request_id, None)
        members = [request_id] if group is None else [m.seq.seq_id for m in group.members]
        aborted = [req for req in (self._requests.pop(seq_id, None) for seq_id in members) if req is not None]
        for req in aborted:
            self.scheduler.finish(req.seq, "abort")
            self._forget(req.seq)
        if not aborted:
            return None
        if group is not None:
            group.unfinished = 0
        return self._output(aborted[-1], [], "")

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work() or bool(self.scheduler.parked)

    def has_runnable_requests(self) -> bool:
        """Whether `step` has work now (parked requests wait for their tier fetch)."""
        return self.scheduler.has_work()

    def step(self) -> list[RequestOutput]:
        """Run one scheduling step; return an output for every request that made progress."""
        batch = self.scheduler.schedule()
        self._num_preemptions += len(batch.preempted)
        for seq in batch.preempted:  # recomputed from scratch when readmitted
            self._forget(seq)
        for extension in self.extensions:
            extension.begin_step()
        if not batch.seqs:
            return []
        tokens, logprobs = self.runner.run(batch)
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += n
            self.block_manager.cache_full_blocks(seq)
        for extension in self.extensions:  # before tokens are appended: one that finishes now frees its pages
            extension.after_step(batch.seqs)
        outputs = []
        for seq, token, logprob in zip(batch.seqs, tokens, logprobs):
            req = self._requests[seq.seq_id]
            self._count_cached(req)
            if token is not None:
                if req.group is not None and not req.group.forked:
                    self._fork(req)
                outputs.append(self._append(req, token, logprob))
        return outputs

    def _count_cached(self, req: Request) -> None:
        """At a request's first step (and first step after a reload from the tier): its cached prompt tokens."""
        seq = req.seq
        if not req.counted_cached:
            req.counted_cached = True
            self._counters["cached_prompt_tokens"] += seq.num_cached_tokens
            start, end = req.tier_tokens
            self._counters["tier_loaded_tokens"] += max(0, min(end, seq.num_cached_tokens) - start)
        if req.tier_reloaded is not None:  # readmitted after a reload: what its prefix match used
            (start, end), req.tier_reloaded = req.tier_reloaded, None
            self._counters["tier_reloaded_tokens"] += max(0, min(end, seq.num_cached_tokens) - start)

    def _append(self, req: Request, token: int, logprob: TokenLogprob | None = None) -> RequestOutput:
        seq = req.seq
        seq.append_token(token)
        if req.logprobs is not None:
            req.logprobs.append(logprob)
        self._counters["generation_tokens"] += 1
        delta = req.detokenizer.add_token(token)
        reason: str | None = None
        stop_reason: str | int | None = None
        if token in self.eos_token_ids and not seq.params.ignore_eos:
            reason = "stop"
        elif token in seq.params.stop_token_ids:
            reason, stop_reason = "stop", token
        elif req.detokenizer.stop_matched is not None:
            reason, stop_reason = "stop", req.detokenizer.stop_matched
        elif seq.grammar is not None and accept(seq.grammar, token):
            reason = "stop"  # the JSON value is complete
        elif seq.num_output_tokens >= req.max_new_tokens:
            reason = "length"
        if reason is not None:
            delta += req.detokenizer.flush()
            self.scheduler.finish(seq, reason)
            self._forget(seq)
            del self._requests[seq.seq_id]
            if req.group is not None:
                req.group.unfinished -= 1
                if req.group.unfinished == 0:
                    del self._groups[req.group.request_id]
        return self._output(req, [token], delta, stop_reason, [logprob])

    def _forget(self, seq: Sequence) -> None:
        """Drop the extensions' state of `seq` (its pages were released by the scheduler)."""
        for extension in self.extensions:
            extension.drop(seq)

    def _output(
        self,
        req: Request,
        delta_ids: list[int],
        delta_text: str,
        stop_reason: str | int | None = None,
        delta_logprobs: list[TokenLogprob | None] = (),
    ) -> RequestOutput:
        seq = req.seq
        completion = CompletionOutput(
            index=req.index,
            text=req.detokenizer.text,
            token_ids=seq.output_token_ids,
            finish_reason=seq.finish_reason,
            stop_reason=stop_reason,
            delta_text=delta_text,
            delta_token_ids=delta_ids,
            logprobs=req.logprobs,
            delta_logprobs=None if req.logprobs is None else list(delta_logprobs),
        )
        group, first = req.group, req if req.group is None else req.group.members[0]
        return RequestOutput(
            request_id=seq.seq_id if group is None else group.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=[completion],
            finished=seq.is_finished if group is None else group.unfinished == 0,
            num_cached_tokens=first.seq.num_cached_tokens,
            metrics=RequestMetrics(first.seq.arrival_time, first.seq.first_token_time),
        )

    def take_kv_events(self) -> list[KVEvent]:
        """KV cache events since the last call (for the prefix router), blocks written to the cluster tier last."""
        events = self.block_manager.take_events()
        return events if self.kv_transfer is None else [*events, *self.kv_transfer.take_events()]

    def kv_snapshot(self) -> list[KVEvent]:
        """`AllCleared`, then one `BlockStored` per cached block: the whole cache as events.

        Replaces the pending events (dropped here), so a consumer that lost some starts over from this.
        """
        self.block_manager.take_events()
        return [AllCleared(), *self.block_manager.snapshot()]

    def metrics(self) -> tuple[Metric, ...]:
        """What `stats` reports on `/metrics`: the engine's numbers and its extensions'."""
        return METRICS + tuple(m for e in self.extensions for m in e.metrics())

    def stats(self) -> dict[str, int]:
        """Cumulative counters since start, the current state of the page pool, and the extensions' numbers."""
        bm = self.block_manager
        return {
            **{k: v for e in self.extensions for k, v in e.stats().items()},
            **self._counters,
            "num_preemptions": self._num_preemptions,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting) + len(self.scheduler.parked),
            "pages_total": bm.num_pages,
            "pages_free": bm.num_free_pages,
            "pages_cached": bm.num_cached_pages,
            "pages_used": bm.num_used_pages,
            "page_size": bm.block_size,
        }

    def attach_tier(self, tier: TierPort) -> None:
        """Share KV blocks with a cluster tier: write full blocks through to it, load from it on a local miss."""
        self.kv_transfer = KVTransfer(self.runner, self.block_manager, tier)

    def plan_tier_load(self, request: Request) -> TierPlan | None:
        """Engine thread: how much of the prompt the local cache serves; None without a tier."""
        return None if self.kv_transfer is None else self.kv_transfer.plan(request.seq)

    def fetch_from_tier(self, request: Request, plan: TierPlan | None) -> list[TierBlock]:
        """Any thread (blocking): the tier blocks that continue the local prefix, when loading beats recompute."""
        if self.kv_transfer is None or plan is None:
            return []
        return self.kv_transfer.fetch(request.seq, plan)

    def install_from_tier(self, request: Request, plan: TierPlan | None, blocks: list[TierBlock]) -> None:
        """Engine thread, right before `enqueue`: put fetched blocks into cached pages the prefix match hits."""
        if self.kv_transfer is not None and plan is not None and blocks:
            request.tier_tokens = self.kv_transfer.install(request.seq, plan, blocks)

    def requeue(self, request: Request, plan: TierPlan, blocks: list[TierBlock]) -> None:
        """Engine thread: give a parked request back to the scheduler, at the front of the queue, with the
        tier blocks fetched for it; they are installed once the pool has room to readmit it. A no-op for a
        request that finished (was aborted) meanwhile."""
        if request.seq.seq_id not in self.scheduler.parked:
            return
        request.tier_fetched = (plan, blocks) if blocks else None
        self.scheduler.unpark(request.seq)

    def _park_for_tier(self, seq: Sequence) -> bool:
        """The scheduler's check before admitting `seq` (True: not now). A preempted sequence whose blocks the
        local cache lost meanwhile is parked while the driver fetches them back from the tier, off the engine
        thread; asked again only once the cache lost more of it, so a tier lacking them is not asked in a
        loop. Fetched blocks wait, holding the queue, until the pool has room for the whole sequence: the
        pages they are installed into must not be evicted before the admission that uses them."""
        if self.fetch_parked is None or self.kv_transfer is None or seq.num_preemptions == 0:
            return False
        request = self._requests[seq.seq_id]
        if request.tier_fetched is not None:
            bm, (plan, blocks) = self.block_manager, request.tier_fetched
            local = bm.match_prefix(seq)
            reviving = sum(1 for pid in local.page_ids if bm.page_info(pid).ref_count == 0)
            if bm.num_free_pages - reviving < -(-seq.num_tokens // bm.block_size) - len(local.page_ids):
                return True
            request.tier_fetched = None
            request.tier_reloaded = self.kv_transfer.install(seq, plan, blocks)
        plan = self.kv_transfer.plan(seq)
        last = request.tier_refetched
        if not plan.worth_asking:
            return False
        if last is not None and last[0] == seq.num_preemptions and plan.local_blocks >= last[1]:
            return False  # asked since this preemption, and the cache has lost nothing more since
        request.tier_refetched = (seq.num_preemptions, plan.local_blocks)
        self.scheduler.park(seq)
        self.fetch_parked(request, plan)
        return True

    def load_from_tier(self, request: Request) -> None:
        """`plan_tier_load`, `fetch_from_tier` and `install_from_tier` in one go, for the engine's own thread."""
        plan = self.plan_tier_load(request)
        self.install_from_tier(request, plan, self.fetch_from_tier(request, plan))

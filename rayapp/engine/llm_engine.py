"""One replica's engine: requests in, a step at a time, outputs out."""

from __future__ import annotations

import dataclasses
from typing import Any

from rayapp.blocks import AllCleared, BlockHash, KVEvent
from rayapp.config import EngineConfig
from rayapp.engine.block_manager import BlockManager
from rayapp.engine.detokenizer import IncrementalDetokenizer
from rayapp.engine.extension import KVConnector, KVExtension, build_extensions, extension_classes
from rayapp.engine.model_runner import ModelRunner
from rayapp.engine.outputs import RequestOutput, TokenLogprob
from rayapp.engine.request import EngineRequest, Request, RequestGroup, RequestLimits
from rayapp.engine.sampler import make_generator
from rayapp.engine.sampling_params import SamplingParams
from rayapp.engine.scheduler import Scheduler
from rayapp.engine.sequence import Sequence
from rayapp.engine.structured import Grammars, accept
from rayapp.models.loader import ModelSpec, model_id, resolve_model
from rayapp.models.tokenizer import load_tokenizer
from rayapp.observability import Metric, counters, gauges

METRICS = counters(
    {
        "prompt_tokens": "Prompt tokens received",
        "cached_prompt_tokens": "Prompt tokens served from the prefix cache instead of computed",
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
        model_path = resolve_model(config.model.model, config.model.revision)
        self.spec = ModelSpec.from_dir(model_path)
        self.model_id = model_id(config.model.model, config.model.revision)
        limit = self.spec.max_position_embeddings
        if config.model.max_model_len is not None and config.model.max_model_len > limit:
            raise ValueError(f"max_model_len={config.model.max_model_len} exceeds the model's context length {limit}")
        self.max_model_len = config.model.max_model_len or limit
        # The sparse token counts left unset scale with this engine's context.
        config = dataclasses.replace(config, sparse=config.sparse.for_context(self.max_model_len))
        self.config = config
        self.tokenizer = load_tokenizer(model_path)
        self.eos_token_ids = set(self.spec.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        classes = extension_classes(config)
        self.runner = ModelRunner(
            config, model_path, self.spec, self.eos_token_ids,
            reserve=lambda num_pages: {
                k: v for c in classes.values() for k, v in c.reserved_pages(config, self.spec, num_pages).items()
            },
        )  # fmt: skip
        self.block_manager = BlockManager(
            self.runner.num_pages, config.cache.block_size, self.model_id, config.cache.enable_prefix_caching
        )
        # The extensions by name, in the order they run; the scheduler asks them to reserve pages.
        self.extensions: dict[str, KVExtension] = {}
        self.scheduler = Scheduler(config.scheduler, self.block_manager, self.extensions.values())
        self.limits = RequestLimits(
            self.max_model_len, self.spec.vocab_size, self.block_manager.num_pages, config.cache.block_size
        )
        self.extensions.update(build_extensions(config, self.runner, self.block_manager, self.max_model_len))
        self.grammars = Grammars(self.tokenizer, self.spec.vocab_size)
        self._requests: dict[str, Request] = {}
        # Requests with n > 1, by request id, until their last answer finishes.
        self._groups: dict[str, RequestGroup] = {}
        self._counters = {"num_requests": 0, "prompt_tokens": 0, "cached_prompt_tokens": 0, "generation_tokens": 0}
        self._num_preemptions = 0
        # Set by `attach_tier`: the cluster KV tier's connector (built by the caller: the engine does not import
        # Ray or the tier). It is an extension too, the last of them.
        self.tier: KVConnector | None = None

    def extension(self, name: str) -> KVExtension | None:
        """The extension registered as `name` (`rayapp.engine.extension.EXTENSIONS`; `kvtier` for the cluster
        tier's connector), when it is on."""
        return self.extensions.get(name)

    def reconfigure(self, **sections: Any) -> None:
        """Switch settings of the extensions between requests (the engine must be idle), as
        `reconfigure(sparse=SparseConfig(...))` or `reconfigure(layerwise=...)`; their counters restart.

        For evaluation: prompts prefilled once stay in the prefix cache, so each setting after the first
        recomputes only what the extensions read again (the scoring queries, the observation window). The
        sparse device block cache keeps the size the engine was built with.
        """
        if self.has_unfinished_requests():
            raise RuntimeError("reconfigure needs an idle engine: finish or abort the running requests first")
        if "sparse" in sections:
            sections["sparse"] = sections["sparse"].for_context(self.max_model_len)
        self.config = dataclasses.replace(self.config, **sections)
        built = build_extensions(self.config, self.runner, self.block_manager, self.max_model_len)
        self.extensions.clear()
        self.extensions.update(built)
        if self.tier is not None:
            self.extensions["kvtier"] = self.tier

    @classmethod
    def from_options(cls, **options: Any) -> LLMEngine:
        return cls(EngineConfig.from_options(**options))

    def add_request(self, request: EngineRequest) -> None:
        """Queue a request; it joins the running batch at the next step boundary.

        Raises ValueError (a `LimitError` naming the field), saying what to change, for an empty or too long
        prompt or one that cannot fit in the KV pool.
        """
        self.enqueue(self.prepare_request(request))

    def enqueue(self, request: Request) -> None:
        """Hand a prepared request to the scheduler (engine thread only)."""
        self._requests[request.seq.seq_id] = request
        if request.group is not None:
            self._groups[request.group.request_id] = request.group
        self.scheduler.add(request.seq)
        self._counters["num_requests"] += 1
        self._counters["prompt_tokens"] += request.seq.num_prompt_tokens

    def prepare_request(self, request: EngineRequest) -> Request:
        """Validate without touching the scheduler (safe from any thread).

        A moved request (`delivered_tokens`) has its delivered output's text read again for the detokenizer,
        and only what the client has not seen is sent.
        """
        request_id, ids, params = request.request_id, list(request.prompt_token_ids), request.sampling
        if request_id in self._requests or request_id in self._groups:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if params.n > 1 and request.delivered_tokens:
            raise ValueError("a moved answer (delivered_tokens) continues one answer: give it n=1")
        max_new = self.limits.check(ids, params.max_tokens, request.block_hashes, request.delivered_tokens)
        self.limits.check_logit_bias(params.logit_bias)
        seq = self._sequence(request_id, ids, params, request.cache_salt, request.block_hashes)
        cut = len(ids) - request.delivered_tokens
        detok = IncrementalDetokenizer(
            self.tokenizer, ids[:cut], params.stop, delivered_ids=ids[cut:], delivered_chars=request.delivered_chars,
            min_tokens=params.min_tokens,
        )  # fmt: skip
        text = request.prompt if isinstance(request.prompt, str) else None
        prepared = Request(seq, text, ids, detok, max_new, [] if params.logprobs is not None else None)
        if params.n > 1:
            prepared.group = RequestGroup(request_id, params.n, [prepared])
        return prepared

    def request(self, request_id: str, prompt: str, params: SamplingParams | None = None) -> EngineRequest:
        """An `EngineRequest` for a text prompt, tokenized with this engine's tokenizer (ValueError for one that
        is not a string)."""
        if not isinstance(prompt, str):
            raise ValueError(f"prompt must be a string, got {type(prompt).__name__}")
        ids = self.tokenizer.encode(prompt)
        return EngineRequest(request_id, ids, sampling=params or SamplingParams(), prompt=prompt)

    def _sequence(
        self, seq_id: str, ids: list[int], params: SamplingParams, cache_salt: str, block_hashes: list[BlockHash] | None
    ) -> Sequence:
        seq = Sequence(seq_id, ids, params, cache_salt=cache_salt, block_hashes=block_hashes)
        seq.generator = make_generator(params, self.runner.device)
        if params.structured is not None:
            seq.grammar = self.grammars.matcher(params.structured)
        seq.min_recompute_tokens = max((e.min_recompute_tokens(seq) for e in self.extensions.values()), default=1)
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
        shared = not any(e.keeps_own_layout(seq) for e in self.extensions.values())
        queued = []
        for i in range(1, group.n):
            params = seq.params
            if params.seed is not None:
                params = dataclasses.replace(params, seed=params.seed + i)
            hashes = seq.block_hashes[: len(ids) // bm.block_size]
            child = Request(
                self._sequence(f"{group.request_id}#{i}", ids, params, seq.cache_salt, hashes), parent.prompt, ids,
                IncrementalDetokenizer(self.tokenizer, ids, params.stop, min_tokens=params.min_tokens),
                parent.max_new_tokens,
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
        return aborted[-1].output([], "")

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work() or bool(self.scheduler.loading)

    def has_runnable_requests(self) -> bool:
        """Whether `step` has work now (requests loading from the tier come back when their blocks are in)."""
        return self.scheduler.has_work()

    def step(self) -> list[RequestOutput]:
        """Run one scheduling step; return an output for every request that made progress."""
        batch = self.scheduler.schedule()
        self._num_preemptions += len(batch.preempted)
        for seq in batch.preempted:  # recomputed from scratch when readmitted
            self._forget(seq)
        for extension in self.extensions.values():
            extension.begin_step()
        if not batch.seqs:
            return []
        tokens, logprobs = self.runner.run(batch, self.extensions.values())
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += n
            self.block_manager.cache_full_blocks(seq)
        for extension in self.extensions.values():  # before tokens are appended: one that finishes now frees its pages
            extension.after_step(batch.seqs)
        outputs = []
        for seq, token, logprob in zip(batch.seqs, tokens, logprobs):
            req = self._requests[seq.seq_id]
            if not req.counted_cached:  # its first step: what its prefix match served
                req.counted_cached = True
                self._counters["cached_prompt_tokens"] += seq.num_cached_tokens
            if token is not None:
                if req.group is not None and not req.group.forked:
                    self._fork(req)
                outputs.append(self._append(req, token, logprob))
        return outputs

    def _append(self, req: Request, token: int, logprob: TokenLogprob | None = None) -> RequestOutput:
        seq = req.seq
        seq.append_token(token)
        if req.logprobs is not None:
            req.logprobs.append(logprob)
        self._counters["generation_tokens"] += 1
        # Before min_tokens, stop tokens do not stop (as vLLM's): the sampler forbids them, unless a grammar
        # left nothing else.
        may_stop = seq.num_output_tokens >= seq.params.min_tokens
        eos = may_stop and token in self.eos_token_ids and not seq.params.ignore_eos
        stop_token = may_stop and token in seq.params.stop_token_ids
        # As vLLM's, the token that stops the answer adds no text.
        delta = "" if eos or stop_token else req.detokenizer.add_token(token)
        reason: str | None = None
        stop_reason: str | int | None = None
        if eos:
            reason = "stop"
        elif stop_token:
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
        return req.output([token], delta, stop_reason, [logprob])

    def _forget(self, seq: Sequence) -> None:
        """Drop the extensions' state of `seq` (its pages were released by the scheduler)."""
        for extension in self.extensions.values():
            extension.drop(seq)

    def take_kv_events(self) -> list[KVEvent]:
        """KV cache events since the last call (for the prefix router), blocks written to the cluster tier last."""
        events = self.block_manager.take_events()
        return events if self.tier is None else [*events, *self.tier.take_events()]

    def kv_snapshot(self) -> list[KVEvent]:
        """`AllCleared`, then one `BlockStored` per cached block: the whole cache as events.

        Replaces the pending events (dropped here), so a consumer that lost some starts over from this.
        """
        self.block_manager.take_events()
        return [AllCleared(), *self.block_manager.snapshot()]

    def cached_blocks(self) -> list[BlockHash]:
        """The hash of every block the prefix cache holds: what `kv_snapshot` announces, the pending events kept."""
        return [stored.block_hashes[0] for stored in self.block_manager.snapshot()]

    def metrics(self) -> tuple[Metric, ...]:
        """What `stats` reports on `/metrics`: the engine's numbers and its extensions'."""
        return METRICS + tuple(m for e in self.extensions.values() for m in e.metrics())

    def stats(self) -> dict[str, int]:
        """Cumulative counters since start, the current state of the page pool, and the extensions' numbers."""
        bm = self.block_manager
        return {
            **{k: v for e in self.extensions.values() for k, v in e.stats().items()},
            **self._counters,
            "num_preemptions": self._num_preemptions,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting) + len(self.scheduler.loading),
            "pages_total": bm.num_pages,
            "pages_free": bm.num_free_pages,
            "pages_cached": bm.num_cached_pages,
            "pages_used": bm.num_used_pages,
            "page_size": bm.block_size,
        }

    def attach_tier(self, connector: KVConnector) -> None:
        """Share KV blocks with a cluster tier through `connector` (`rayapp.kvtier.connector.connect` builds one):
        it writes full blocks through and is asked at every admission."""
        self.detach_tier()
        connector.attach()
        self.tier = connector
        self.scheduler.connector = connector
        self.extensions["kvtier"] = connector

    def detach_tier(self) -> KVConnector | None:
        """Go on without the cluster tier (no writes, no loads); returns its connector, to attach again (engine
        idle)."""
        if self.tier is None:
            return None
        if self.scheduler.loading:
            raise RuntimeError("detach_tier needs no request loading from the tier: wait for them first")
        connector, self.tier = self.tier, None
        connector.detach()
        self.scheduler.connector = None
        del self.extensions["kvtier"]
        return connector

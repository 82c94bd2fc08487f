"""The OpenAI-compatible HTTP front: validation, tokenization, admission, SSE streaming, metrics.

Tokenization happens here, once: chat template -> token ids -> block hashes (salted by
tenant), so the replicas do not redo it and the prefix router can route on the hashes.

No `from __future__ import annotations` here: FastAPI must see the real `Request` annotation
after Serve rewrites the route methods' signatures.
"""

import asyncio
import hashlib
import hmac
import logging
import os
import time
import uuid
import weakref
from collections import Counter
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.serve.handle import DeploymentHandle

from rayapp.blocks import BlockHash, hash_blocks
from rayapp.config import AppConfig
from rayapp.deployments.generation import Generation, InFlight
from rayapp.deployments.metrics import render_prometheus
from rayapp.deployments.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    check_sizes,
    check_token_fields,
    decode_json,
    parse,
    read_body,
)
from rayapp.deployments.readiness import not_ready, report_until_ready
from rayapp.deployments.responses import LogprobsFormat, event, full_response, stream_chunk, usage_body
from rayapp.deployments.tools import ToolAnswer, template_problem
from rayapp.drivers.backend import GenerateDelta
from rayapp.engine.request import EngineRequest, LimitError, RequestLimits
from rayapp.models.loader import ModelInfo, model_id, resolve_model, served_name
from rayapp.models.tokenizer import chat_token_ids, load_tokenizer
from rayapp.observability.hub import HubClient
from rayapp.prefix_router.shards import IndexShards

logger = logging.getLogger(__name__)

# Seconds a client told 429 (requests in flight at their limit) is asked to wait before retrying (Retry-After,
# which OpenAI's clients honour): the limit frees up as answers finish, not at a time the ingress knows.
RETRY_AFTER_S = 1
# Bodies longer than this are parsed, templated and tokenized on a thread of their own, so the event
# loop goes on answering `/health` and small requests meanwhile.
OFF_LOOP_BYTES = 64 << 10
# More accepted API keys, comma-separated, from the ingress' environment (a Kubernetes Secret, say).
API_KEYS_ENV = "RAYAPP_API_KEYS"
# The `endpoint` label values of rayapp_http_requests_total: the routes, and one value for any other path.
ROUTES = frozenset({"/health", "/metrics", "/v1/models", "/v1/chat/completions", "/v1/completions"})
OTHER_PATH = "other"

app = FastAPI(title="rayapp")
# Requests by (endpoint, status). Kept on the app's state: serve.ingress serves a frozen copy of
# `app`, so a module global would not be the object the middleware and routes share.
app.state.http_requests = Counter()


@app.middleware("http")
async def _count(request: Request, call_next):
    endpoint = request.url.path if request.url.path in ROUTES else OTHER_PATH
    try:
        response = await call_next(request)
    except Exception:  # answered 500 by the handler below, outside this middleware
        request.app.state.http_requests[(endpoint, "500")] += 1
        raise
    request.app.state.http_requests[(endpoint, str(response.status_code))] += 1
    return response


@app.exception_handler(APIError)
async def _api_error(_: Request, error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


@app.exception_handler(Exception)
async def _internal_error(_: Request, error: Exception) -> JSONResponse:
    # Not the client's fault (a replica died, a bug): said in the same shape, never a bare 500 page, and
    # without the exception's text (it can hold addresses, paths or data); the log has it, under the incident.
    incident = uuid.uuid4().hex[:12]
    logger.error("internal error, incident %s", incident, exc_info=error)
    message = f"internal error (incident {incident}; the server's log has the details)"
    return JSONResponse(APIError(500, message, type_="internal_error").body(), status_code=500)


def _api_keys(config: AppConfig) -> tuple[str, ...]:
    """Every accepted key: `api_keys`, the lines of `api_keys_file`, and `RAYAPP_API_KEYS` (comma-separated)."""
    keys = list(config.api_keys)
    if config.api_keys_file is not None:
        try:
            lines = Path(config.api_keys_file).read_text().splitlines()
        except OSError as error:
            raise ValueError(f"api_keys_file {config.api_keys_file!r} cannot be read: {error.strerror}") from None
        keys += [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    keys += [k.strip() for k in os.environ.get(API_KEYS_ENV, "").split(",") if k.strip()]
    return tuple(keys)


def _tool_answers(body: Any) -> list[ToolAnswer] | None:
    """How each of a chat request's answers holds tool calls; None without tools."""
    mode = getattr(body, "tool_mode", None)
    return None if mode is None else [ToolAnswer(mode, body.parallel_calls) for _ in range(body.n)]


# Defined after the helpers above: serve.ingress freezes a copy of the routes, with the module
# globals that exist at that moment.
@serve.ingress(app)
class OpenAIIngress:
    """Serve ingress body; the builder makes it a deployment."""

    def __init__(self, replica: DeploymentHandle, app_config: dict[str, Any]) -> None:
        self.config = AppConfig(**app_config)
        # The tokenizer and config only: the replicas load the weights (the builder pinned a repo id's revision).
        path = resolve_model(self.config.model, self.config.revision, weights=False)
        info = ModelInfo.from_dir(path)
        self.tokenizer = load_tokenizer(path, self.config.chat_template)
        # Large requests are prepared on one thread with a tokenizer of its own: a fast tokenizer must not be
        # used by two threads at once.
        self._bulk_tokenizer = load_tokenizer(path, self.config.chat_template)
        self._bulk = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rayapp-ingress-bulk")
        self.api_keys = _api_keys(self.config)
        self.logprobs = LogprobsFormat(self.tokenizer)
        # The engine's model id: block hashes computed here must equal the replicas' own.
        self.model_id = model_id(self.config.model, self.config.revision)
        self.served_name = self.config.served_model_name or served_name(self.config.model)
        self.max_model_len = self.config.context_length(info.context_length)
        self.block_size = self.config.kv_block_size()
        self.limits = RequestLimits(self.max_model_len, info.vocab_size, None, self.block_size)
        self.replica = replica
        self.inflight = InFlight()
        self.app_name = serve.get_replica_context().app_name
        self.hub = HubClient(self.app_name)
        self.prefix_index = IndexShards.connect(self.app_name, self.config.router)
        self._start_report = asyncio.get_event_loop().create_task(report_until_ready(self._waiting_for))

    async def _waiting_for(self) -> list[dict[str, str]]:
        """Nothing when a replica answers; else what the application waits for: a replica still loading, one
        Ray cannot place, or one whose engine cannot start (Serve's last error for it)."""
        try:
            await asyncio.wait_for(self.replica.stats.remote(), timeout=5)
        except Exception:
            return await not_ready(self.app_name) or [
                {"deployment": "LLMReplica", "status": "HEALTHY", "message": "no replica answered within 5 s"}
            ]
        return []

    @app.get("/health")
    async def health(self) -> Response:
        waiting = await self._waiting_for()
        if waiting:
            return JSONResponse({"status": "unavailable", "waiting_for": waiting}, status_code=503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics(self, request: Request) -> Response:
        if self.config.authenticate_metrics:
            self._authenticate(request)
        try:
            replicas, routers = await asyncio.gather(self.hub.call("snapshots"), self.hub.call("routers"))
        except Exception:  # the hub is being replaced: the ingress' own series answer meanwhile
            replicas, routers = {}, {}
        try:
            index = await asyncio.wait_for(self.prefix_index.stats(), timeout=1)
        except Exception:  # the index is restarting: its gauges are left out this time
            index = None
        http = dict(request.app.state.http_requests)
        body = render_prometheus(replicas, routers, index, http, self.inflight.requests, self.inflight.moved)
        return Response(body, media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(self, request: Request) -> dict[str, Any]:
        self._authenticate(request)
        card = {
            "id": self.served_name,
            "object": "model",
            "created": 0,
            "owned_by": "rayapp",
            "max_model_len": self.max_model_len,
        }
        return {"object": "list", "data": [card]}

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        tenant = self._authenticate(request)
        body, ids, messages = await self._prepare(request, self._prepare_chat)
        return await self._serve(body, ids, tenant, "chat.completion", messages)

    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        tenant = self._authenticate(request)
        body, ids = await self._prepare(request, self._prepare_completion)
        return await self._serve(body, ids, tenant, "text_completion", body.prompt)

    async def _prepare(self, request: Request, prepare: Callable[[bytes, Any], Any]) -> Any:
        """`prepare(body bytes, tokenizer)`, on the event loop for a small body, on the bulk thread for a large one."""
        raw = await read_body(request, self.config.limits.max_request_bytes)
        if len(raw) <= OFF_LOOP_BYTES:
            return prepare(raw, self.tokenizer)
        return await asyncio.get_running_loop().run_in_executor(self._bulk, prepare, raw, self._bulk_tokenizer)

    def _prepare_chat(self, raw: bytes, tokenizer: Any) -> tuple[ChatCompletionRequest, list[int], list[dict]]:
        body = parse(ChatCompletionRequest, decode_json(raw))
        self._check_model(body.model)
        messages = [m.for_template() for m in body.messages]
        check_sizes(body, self.config.limits, sum(len(m["content"]) for m in messages))
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
        if tools or any(m.role == "tool" or m.tool_calls for m in body.messages):
            problem = template_problem(tokenizer.chat_template)
            if problem is not None:
                raise APIError(
                    400, f"{problem}, so tools and tool messages cannot be served; set chat_template in the app's "
                    "config to a template that renders them", param="tools" if tools else "messages",
                )  # fmt: skip
        try:
            ids = chat_token_ids(tokenizer, messages, tools)
        except ValueError as error:  # e.g. a model without a chat template
            raise APIError(400, str(error), param="messages") from None
        self._check_limits(body, ids)
        return body, ids, messages

    def _prepare_completion(self, raw: bytes, tokenizer: Any) -> tuple[CompletionRequest, list[int]]:
        body = parse(CompletionRequest, decode_json(raw))
        self._check_model(body.model)
        check_sizes(body, self.config.limits, len(body.prompt) if isinstance(body.prompt, str) else 0)
        ids = tokenizer.encode(body.prompt) if isinstance(body.prompt, str) else list(body.prompt)
        self._check_limits(body, ids)
        return body, ids

    def _check_limits(self, body: ChatCompletionRequest | CompletionRequest, ids: list[int]) -> None:
        """The engine's own check, so the two cannot disagree, except that a max_tokens past the context is a 400
        (as OpenAI's and vLLM's servers answer) rather than lowered to fit."""
        try:
            self.limits.check(ids, body.requested_max_tokens, fit_max_tokens=False)
        except LimitError as error:
            chat = isinstance(body, ChatCompletionRequest)
            param = "messages" if chat and error.param == "prompt" else error.param
            raise APIError(400, str(error), param=param, code=error.code) from None
        check_token_fields(body, self.limits)

    def _authenticate(self, request: Request) -> str:
        """Check the API key when keys are configured; return the tenant (the key, or else `user`)."""
        if not self.api_keys:
            return ""
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        # Every key compared, each in constant time: the answer's timing says nothing about how close a guess was.
        matches = [hmac.compare_digest(key.encode(), known.encode()) for known in self.api_keys]
        if scheme.lower() != "bearer" or not any(matches):
            raise APIError(
                401, "missing or incorrect API key: send 'Authorization: Bearer <key>'", code="invalid_api_key"
            )
        return key

    def _check_model(self, model: str) -> None:
        if model != self.served_name:
            raise APIError(
                404,
                f"the model '{model}' does not exist; this server serves '{self.served_name}'",
                param="model",
                code="model_not_found",
            )

    async def _serve(self, body: Any, ids: list[int], tenant: str, kind: str, prompt: str | list[Any]) -> Response:
        try:
            sampling = body.sampling(body.requested_max_tokens)
        except ValueError as error:
            raise APIError(400, str(error)) from None
        if self.inflight.requests >= self.config.max_queued_requests:
            raise APIError(
                429,
                f"the server is at its limit of {self.config.max_queued_requests} requests in flight; retry later",
                type_="rate_limit_exceeded",
                code="rate_limit_exceeded",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        # The tenant salts the hashes: different API keys (or users, without keys) never share pages.
        owner = tenant or body.user or ""
        salt = hashlib.sha256(owner.encode()).hexdigest()[:16] if owner else ""
        request = EngineRequest(uuid.uuid4().hex, ids, self.hash_blocks(ids, salt), salt, sampling, prompt)
        generation = Generation(self.replica, request, self.hash_blocks, self.inflight)
        try:
            first = await generation.next()
        except BaseException:
            generation.release(cancel=True)
            raise
        response_id = f"{'chatcmpl' if kind == 'chat.completion' else 'cmpl'}-{generation.request.request_id}"
        if body.stream:
            sse = self._sse(generation, first, body, kind, response_id)
            # A body the server never starts sending (the client left first) never runs `_sse`'s finally.
            weakref.finalize(sse, generation.release, True)
            return StreamingResponse(sse, media_type="text/event-stream")
        try:
            items = [first]
            while not items[-1].last:
                items.append(await generation.next())
        finally:
            generation.release(cancel=False)
        logprobs: list[dict[str, Any] | None] = [None] * body.n
        if body.requested_logprobs is not None:
            chat = kind == "chat.completion"
            logprobs = [
                self.logprobs.render([lp for i in items if i.index == k for lp in i.logprobs or ()], chat)
                for k in range(body.n)
            ]
        answers = _tool_answers(body)
        return JSONResponse(full_response(items, kind, response_id, self.served_name, logprobs, answers))

    def hash_blocks(self, ids: list[int], salt: str) -> list[BlockHash]:
        """The prompt's block hashes for a tenant's salt, computed as the replicas compute them."""
        return hash_blocks(ids, self.block_size, (self.model_id, salt))

    async def _sse(
        self, generation: Generation, first: GenerateDelta, body: Any, kind: str, response_id: str
    ) -> AsyncIterator[str]:
        created, chat, model = int(time.time()), kind == "chat.completion", self.served_name
        wants_logprobs, text_offsets = body.requested_logprobs is not None, [0] * body.n
        answers = _tool_answers(body)
        finished = False
        try:
            if chat:
                for index in range(body.n):
                    yield stream_chunk(response_id, created, model, chat, None, None, role=True, index=index)
            item = first
            while True:
                logprobs = None
                if wants_logprobs and item.logprobs:
                    logprobs = self.logprobs.render(item.logprobs, chat, text_offsets[item.index])
                    text_offsets[item.index] += self.logprobs.text_length(item.logprobs)
                text, calls, reason = item.text, None, item.finish_reason
                if answers is not None:
                    text, calls = answers[item.index].feed(item.text)
                    if item.finished:
                        rest, more = answers[item.index].finish()
                        text, calls = text + rest, calls + more
                        reason = answers[item.index].finish_reason(reason)
                if text or calls or item.finished or logprobs is not None:
                    yield stream_chunk(
                        response_id, created, model, chat, text, reason, logprobs=logprobs, index=item.index,
                        tool_calls=calls or None,
                    )  # fmt: skip
                if item.last:
                    finished = True
                    if body.include_usage:
                        obj = "chat.completion.chunk" if chat else kind
                        usage = usage_body(item.usage)
                        yield event({"id": response_id, "object": obj, "created": created, "model": model,
                                     "choices": [], "usage": usage})  # fmt: skip
                    break
                item = await generation.next()
            yield "data: [DONE]\n\n"
        except APIError as error:
            yield event(error.body())
            yield "data: [DONE]\n\n"
        finally:
            # Not finished: the client left (or the replica failed); stop generating, free the pages.
            generation.release(cancel=not finished)

"""OpenAI request bodies and error shapes, as the official clients send and expect them: read within the
server's limits, decoded, validated."""

from __future__ import annotations

import json
import math
from typing import Any, ClassVar, Literal

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from rayapp.config import LimitSettings
from rayapp.deployments.messages import ChatMessage, NamedToolChoice, Tool
from rayapp.deployments.tools import forced_output
from rayapp.engine.request import LimitError, RequestLimits
from rayapp.engine.sampling_params import MAX_LOGPROBS, SamplingParams, StructuredOutput


class APIError(Exception):
    """An error the client caused (4xx), answered in OpenAI's error body."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# Fields that change the answer, of OpenAI's API and of vLLM's server, that rayapp does not implement, each with
# the values that leave the answer as it is. A request asking for anything else gets a 400 naming the field,
# never an answer that silently is not what it asked for.
_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "functions": (None, []),
    "function_call": (None, "none"),
    "prediction": (None,),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "use_beam_search": (False, None),
    "structured_outputs": (None,),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
}
_UNSUPPORTED_COMPLETIONS = {**_UNSUPPORTED, "best_of": (None, 1), "echo": (False, None), "suffix": (None, "")}


class _Sampling(BaseModel):
    # Unknown fields are ignored, as OpenAI and vLLM do, so newer clients keep working (but see _UNSUPPORTED).
    model_config = ConfigDict(extra="ignore")
    unsupported: ClassVar[dict[str, tuple[Any, ...]]] = _UNSUPPORTED

    model: str
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)
    max_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1)
    ignore_eos: bool = False
    response_format: ResponseFormat | None = None
    # vLLM's sampling fields, with its ranges (None, as some clients send for a field left unset: the default).
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0, allow_inf_nan=False)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    # Token ids to biases; OpenAI sends the ids as strings (JSON keys are), read into ints here.
    logit_bias: dict[int, float] | None = None
    min_tokens: int | None = Field(None, ge=0)

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _token_ids(cls, bias: Any) -> Any:
        if not isinstance(bias, dict):
            return bias  # pydantic names the type it wants
        try:
            return {int(token): value for token, value in bias.items()}
        except (TypeError, ValueError):
            raise ValueError("logit_bias keys must be token ids (integers, as strings)") from None

    @field_validator("logit_bias")
    @classmethod
    def _clamped(cls, bias: dict[int, float] | None) -> dict[int, float] | None:
        if bias is not None and any(math.isnan(b) for b in bias.values()):
            raise ValueError("logit_bias values must be numbers")
        # As vLLM's server (and OpenAI's API) does.
        return None if bias is None else {t: min(100.0, max(-100.0, b)) for t, b in bias.items()}

    def sampling(self, max_tokens: int | None) -> SamplingParams:
        """This request's SamplingParams; ValueError names a bad field."""
        return SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            max_tokens=max_tokens,
            stop=self.stop_strings,
            seed=self.seed,
            ignore_eos=self.ignore_eos,
            logprobs=self.requested_logprobs,
            structured=self.structured_output(),
            n=self.n,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            min_p=self.min_p or 0.0,
            logit_bias=self.logit_bias or (),
            min_tokens=self.min_tokens or 0,
        )

    def structured_output(self) -> StructuredOutput | None:
        return None if self.response_format is None else self.response_format.structured()

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class JSONSchemaFormat(BaseModel):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_json_schema(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type json_schema needs a json_schema object")
        return self

    def structured(self) -> StructuredOutput | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return StructuredOutput()
        return StructuredOutput(json.dumps(self.json_schema.schema_))


class StreamOptions(BaseModel):
    include_usage: bool = False


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    # False: at most one call per answer (None, as some clients send it: the default, True).
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _choice_among_tools(self) -> ChatCompletionRequest:
        choice, names = self.tool_choice, [t.function.name for t in self.tools or ()]
        if choice not in (None, "none") and not names:
            raise ValueError("tool_choice needs tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"tool_choice names {choice.function.name!r}, which is not one of the tools")
        if self.forced_tools and self.response_format is not None and self.response_format.type != "text":
            raise ValueError("tool_choice required or a named function cannot be combined with response_format")
        return self

    @property
    def tool_mode(self) -> str | dict[str, Any] | None:
        """How answers hold tool calls (`tools.ToolAnswer`): None when the request has no tools (or
        tool_choice none), else `auto`, `required` or the named choice as a dict."""
        if not self.tools or self.tool_choice == "none":
            return None
        if isinstance(self.tool_choice, NamedToolChoice):
            return self.tool_choice.model_dump()
        return self.tool_choice or "auto"

    @property
    def parallel_calls(self) -> bool:
        return self.parallel_tool_calls is not False

    @property
    def forced_tools(self) -> bool:
        return self.tool_mode not in (None, "auto")

    def structured_output(self) -> StructuredOutput | None:
        if self.forced_tools:
            return forced_output([t.model_dump() for t in self.tools], self.tool_mode, self.parallel_calls)
        return super().structured_output()

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, top: int | None, info: ValidationInfo) -> int | None:
        if top and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return top

    @property
    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_Sampling):
    unsupported: ClassVar[dict[str, tuple[Any, ...]]] = _UNSUPPORTED_COMPLETIONS
    prompt: str | list[int]
    # The legacy endpoint's `logprobs` is the number of alternatives, at most 5.
    logprobs: int | None = Field(None, ge=0, le=5)

    @property
    def requested_logprobs(self) -> int | None:
        return self.logprobs

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, prompt: str | list[int]) -> str | list[int]:
        if len(prompt) == 0:
            raise ValueError("prompt is empty")
        return prompt

    @property
    def requested_max_tokens(self) -> int | None:
        # /v1/completions defaults to 16 tokens, as OpenAI's legacy endpoint does.
        return 16 if self.max_tokens is None else self.max_tokens


_Sampling.model_rebuild()


def parse(model: type[BaseModel], body: Any) -> Any:
    """Validate a JSON body; a bad one becomes a 400 naming the offending parameter."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    for name, neutral in getattr(model, "unsupported", {}).items():
        # bool is an int in Python: True must not pass for 1, nor False for 0.
        if name in body and not any(
            body[name] == v and isinstance(body[name], bool) == isinstance(v, bool) for v in neutral
        ):
            raise APIError(
                400, f"{name} is not supported by this server; leave it out", param=name, code="unsupported_parameter"
            )
    try:
        return model.model_validate(body)
    except ValidationError as error:
        first = error.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        raise APIError(400, f"{param}: {first['msg']}", param=param) from None


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 as soon as it is known to pass `limit` bytes (declared or as received)."""
    too_large = APIError(
        413, f"the request body is larger than this server's limit of {limit} bytes", code="request_too_large"
    )
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


def decode_json(raw: bytes) -> Any:
    """The body's JSON value; anything that is not JSON text (or that no tokenizer could take) is a 400."""
    try:
        body = json.loads(raw)
        # JSON escapes can spell lone surrogates, which no tokenizer accepts: refuse them here.
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply") from None
    except ValueError as error:  # not JSON, not UTF-8, or an integer literal too long to convert
        raise APIError(400, f"the request body is not valid JSON text: {error}") from None
    return body


def check_sizes(body: ChatCompletionRequest | CompletionRequest, limits: LimitSettings, prompt_chars: int) -> None:
    """The limits on messages, the prompt's characters, answers and stop strings, before any templating or
    tokenizing."""
    param = "messages" if isinstance(body, ChatCompletionRequest) else "prompt"
    if isinstance(body, ChatCompletionRequest) and len(body.messages) > limits.max_messages:
        raise APIError(
            400, f"{len(body.messages)} messages are more than this server's limit of {limits.max_messages}",
            param="messages",
        )  # fmt: skip
    if prompt_chars > limits.max_prompt_chars:
        raise APIError(
            400, f"the {param} hold {prompt_chars} characters, more than this server's limit of "
            f"{limits.max_prompt_chars}", param=param,
        )  # fmt: skip
    if body.n > limits.max_n:
        raise APIError(400, f"n={body.n} is more than this server's limit of {limits.max_n} answers", param="n")
    stops = body.stop_strings
    if len(stops) > limits.max_stop_strings:
        raise APIError(
            400, f"{len(stops)} stop strings are more than this server's limit of {limits.max_stop_strings}",
            param="stop",
        )  # fmt: skip
    if any(len(stop) > limits.max_stop_chars for stop in stops):
        raise APIError(
            400, f"a stop string is longer than this server's limit of {limits.max_stop_chars} characters",
            param="stop",
        )  # fmt: skip


def check_token_fields(body: ChatCompletionRequest | CompletionRequest, limits: RequestLimits) -> None:
    """min_tokens within the answer's max tokens, and logit_bias ids inside the vocabulary (`limits`, the engine's
    own check): a 400 naming the field."""
    max_tokens = body.requested_max_tokens
    if body.min_tokens and max_tokens is not None and body.min_tokens > max_tokens:
        name = "max_completion_tokens" if getattr(body, "max_completion_tokens", None) else "max_tokens"
        raise APIError(
            400, f"min_tokens={body.min_tokens} is more than {name}={max_tokens}; lower min_tokens or raise {name}",
            param="min_tokens",
        )  # fmt: skip
    try:
        limits.check_logit_bias((body.logit_bias or {}).items())
    except LimitError as error:
        raise APIError(400, str(error), param=error.param) from None

"""A request a replica's engine rejects is the client's 400, naming the field to change and OpenAI's code."""

from __future__ import annotations

import asyncio

import pytest
from ray.exceptions import RayTaskError

from rayapp.deployments.generation import Generation, InFlight
from rayapp.deployments.protocol import APIError
from rayapp.engine.request import CONTEXT_LENGTH_EXCEEDED, EngineRequest, LimitError
from rayapp.engine.sampling_params import SamplingParams


class _Rejecting:
    """A replica handle whose engine rejects every request with `error`."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    def options(self, stream: bool):
        return self

    @property
    def generate(self):
        return self

    def remote(self, request: EngineRequest):
        return self

    async def __anext__(self):
        raise RayTaskError("generate", "", self.error)

    def cancel(self) -> None:
        pass


@pytest.mark.parametrize(
    ("error", "param", "code"),
    [
        (LimitError("needs 600 KV pages but the pool has 512", "max_tokens"), "max_tokens", None),
        (LimitError("past the context", "prompt", CONTEXT_LENGTH_EXCEEDED), "prompt", CONTEXT_LENGTH_EXCEEDED),
        (ValueError("some other rejection"), None, None),
    ],
)
def test_an_engine_rejection_is_a_400_with_its_field_and_code(error, param, code):
    async def rejected() -> APIError:
        request = EngineRequest("r", [1, 2, 3], [], "", SamplingParams(max_tokens=4), "hi")
        inflight = InFlight()
        generation = Generation(_Rejecting(error), request, lambda ids, salt: [], inflight)
        with pytest.raises(APIError) as raised:
            await generation.next()
        generation.release(cancel=True)
        assert inflight.requests == 0
        return raised.value

    answer = asyncio.run(rejected())
    assert (answer.status, answer.message, answer.param, answer.code) == (400, str(error), param, code)

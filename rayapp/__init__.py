"""rayapp: LLM serving for long, multi-turn chat."""

from rayapp.engine.async_engine import AsyncLLMEngine
from rayapp.engine.llm_engine import LLMEngine
from rayapp.engine.outputs import CompletionOutput, RequestOutput
from rayapp.engine.sampling_params import SamplingParams
from rayapp.llm import LLM

__all__ = ["LLM", "AsyncLLMEngine", "CompletionOutput", "LLMEngine", "RequestOutput", "SamplingParams"]

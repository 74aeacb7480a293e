"""vision-serve's VLM inference engine: paged KV cache, continuous batching, chunked prefill."""

from engine.async_engine import AsyncEngine
from engine.config import EngineArgs
from engine.llm import LLM
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "AsyncEngine",
    "CompletionOutput",
    "EngineArgs",
    "RequestOutput",
    "SamplingParams",
]

"""Serving: the vLLM-shaped offline API (:class:`LLM`, :class:`SamplingParams`) and
``dcpgraph serve``, an OpenAI-compatible HTTP server (:mod:`.api_server`)."""

from .llm import LLM
from .outputs import CompletionOutput, RequestOutput
from .params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams"]

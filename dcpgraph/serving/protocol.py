"""OpenAI request bodies, validated strictly: an unknown field or a bad value is a 400, not a guess.

Only what dcpgraph implements is accepted: ``echo`` false, ``best_of`` absent or equal to ``n``.
Log-probabilities: completions take ``logprobs`` (an int, 0–20: top-N per token), chat takes
``logprobs: true`` with ``top_logprobs`` (0–20; giving it without ``logprobs: true`` is an error,
as in OpenAI's API). ``presence_penalty``/``frequency_penalty`` are in [-2, 2]. vLLM's extensions
``top_k``, ``repetition_penalty``, ``stop_token_ids``, ``skip_special_tokens`` and
``include_stop_str_in_output`` are accepted too.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..runtime.sampling import MAX_LOGPROBS
from .params import SamplingParams


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    n: int = Field(1, ge=1, le=16)
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    kv_transfer_params: dict[str, Any] | None = None  # P/D: see serving/kv_connector/agent.py

    def requested_logprobs(self) -> int | None:
        """Top-N log-probabilities per generated token (``None``: none)."""
        return None

    def sampling_params(self, max_tokens: int | None) -> SamplingParams:
        return SamplingParams(n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                              seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids,
                              max_tokens=max_tokens, logprobs=self.requested_logprobs(),
                              presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                              repetition_penalty=self.repetition_penalty,
                              skip_special_tokens=self.skip_special_tokens,
                              include_stop_str_in_output=self.include_stop_str_in_output)


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: Literal[False] = False
    best_of: int | None = None
    suffix: None = None

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, value: Any) -> Any:
        if isinstance(value, list) and not value:
            raise ValueError("prompt must not be empty")
        return value

    def requested_logprobs(self) -> int | None:
        return self.logprobs

    def prompts(self) -> list:
        """The prompts as :func:`.prompts.encode_prompt` takes them (strings or token-id lists)."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str
    name: str | None = None


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

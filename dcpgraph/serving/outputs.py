"""What ``LLM.generate`` returns, shaped like vLLM's ``RequestOutput`` / ``CompletionOutput``."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" (EOS, a stop token or a stop string) or "length"
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    cumulative_logprob: float | None = None
    logprobs: None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True

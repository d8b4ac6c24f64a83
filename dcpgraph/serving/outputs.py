"""What ``LLM.generate`` returns, shaped like vLLM's ``RequestOutput`` / ``CompletionOutput``."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """vLLM's ``Logprob``: a token's log-probability, its rank among all tokens (1 = most likely)
    and its text alone (``tokenizer.decode([id])``)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" (EOS, a stop token or a stop string) or "length"
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    cumulative_logprob: float | None = None  # sum of the sampled tokens' logprobs, when requested
    # per generated token, {token id: Logprob} of the sampled token and the top ``logprobs`` ones
    logprobs: list[dict[int, Logprob]] | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True
    # with SamplingParams.prompt_logprobs: None for the first prompt token, then per prompt token
    # {token id: Logprob} of that token and the top ``prompt_logprobs`` ones at its position
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None

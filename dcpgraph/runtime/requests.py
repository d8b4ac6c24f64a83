"""The records the scheduler deals in: a live :class:`Request`, its share of a step
(:class:`ScheduledChunk`), what the model runner returns for it (:class:`RowOutput`) and each
emitted token (:class:`StepEvent`). The engine, the workers and the serving layer read them; the
policy that moves them is :mod:`.scheduler`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from .sampling_params import SamplingParams
from .step_inputs import Chunk


@dataclass(eq=False)
class Request:
    id: int
    prompt: list[int]
    max_new_tokens: int
    params: SamplingParams
    generator: torch.Generator | None = None
    output: list[int] = field(default_factory=list)
    computed: int = 0
    finished: bool = False
    speculative: bool = True  # whether its decode rows may carry drafts
    preemptions: int = 0
    # with params.prompt_logprobs: entry j is prompt token j's log-probabilities (None for j = 0),
    # filled as prefill chunks run; complete when it holds len(prompt) entries
    prompt_logprobs: list[dict | None] | None = None
    grammar: Any = None  # its RequestGrammar (runtime/grammar.py) when it has structured outputs
    state_slot: int | None = None  # its recurrent-state slot while running (hybrid models)
    _joined: tuple = field(default=(None, None, 0, 0, None), init=False, repr=False, compare=False)

    @property
    def tokens(self) -> list[int]:
        """``prompt + output``: one list kept between calls and extended as ``output`` grows (a
        long prompt is not copied on every step); rebuilt when either list is replaced or shrinks.
        Read it; do not change it."""
        prompt, output, np_, no, joined = self._joined
        if prompt is not self.prompt or output is not self.output or np_ != len(self.prompt) or no > len(self.output):
            joined = self.prompt + self.output
        elif no < len(self.output):
            joined.extend(self.output[no:])
        self._joined = (self.prompt, self.output, len(self.prompt), len(self.output), joined)
        return joined

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Whether some prompt token's log-probabilities are still to be computed."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def reserve_tokens(self) -> int:
        return len(self.prompt) + self.max_new_tokens


@dataclass(frozen=True)
class ScheduledChunk:
    """One request's share of a step. ``draft_room``: how many draft tokens may follow the chunk
    (its blocks hold them and the request has that many tokens left to emit); 0 unless the chunk
    is one token that is sampled and speculation is on."""

    request: Request
    chunk: Chunk
    samples: bool
    draft_room: int = 0


class _StepEventFields(NamedTuple):
    request_id: int
    token: int
    finished: bool


class StepEvent(_StepEventFields):
    """One emitted token. ``finished``: the request ended with it (it is then no longer held).
    ``logprobs``: the token's :func:`~.sampling.token_logprobs` when the request asked for them,
    else ``None``; ``prompt_logprobs``: on a request's first token only, when it asked for them,
    one entry per prompt token (``None`` for the first, then :func:`~.sampling.token_logprobs` of
    each prompt token at its position), else ``None``. Attributes, not tuple fields, so
    ``rid, token, finished = event`` holds."""

    def __new__(cls, request_id: int, token: int, finished: bool, logprobs: dict | None = None,
                prompt_logprobs: list | None = None):
        event = super().__new__(cls, request_id, token, finished)
        event.logprobs = logprobs
        event.prompt_logprobs = prompt_logprobs
        return event


class RowOutput(NamedTuple):
    """What the model runner produced for one :class:`ScheduledChunk`: ``tokens`` sampled (none
    for a prefill chunk that does not reach the last token; with drafts, tokens whose common prefix
    with the drafts is the accepted drafts, followed by the target's token there: for a greedy
    request the target's argmax after each of the ``1 + len(drafts)`` query rows, for a sampled
    one rejection sampling's emitted tokens), the ``drafts`` it verified,
    per token, its log-probabilities if requested and, for a request that asked for prompt
    log-probabilities, those of the prompt tokens this chunk newly covered (in prompt order,
    continuing ``request.prompt_logprobs``)."""

    tokens: list[int]
    drafts: list[int]
    logprobs: list[dict] | None = None  # per token, when the request asked for log-probabilities
    prompt_logprobs: list[dict] | None = None

"""``SamplingParams``: the one description of how a request samples, with vLLM's names and defaults.

The offline API (:class:`dcpgraph.LLM`), the HTTP server and the engine all take this class; the
engine stores it on each :class:`~.scheduler.Request`, and :func:`~.sampling.sample`,
:func:`~dcpgraph.runtime.rejection.verify` and the log-probabilities read its fields.

Defaults follow vLLM: ``temperature=1.0`` (sampling; below ``1e-5`` is greedy), ``top_p=1.0``,
``top_k=0`` (``-1`` is accepted as vLLM's older spelling of "off"), ``max_tokens=16``, ``n=1``.
Every value is checked here, so a bad one raises ``ValueError`` naming the field before any
request is queued.

``stop`` strings end the output at their first occurrence in the *text* (never inside a character:
see :mod:`dcpgraph.serving.detokenizer`); the stop string itself is left out unless
``include_stop_str_in_output``. ``stop_token_ids`` end it at that token (kept in ``token_ids``,
left out of ``text``), as the model's EOS does. ``seed`` makes a sampled request reproducible;
completion ``i`` of ``n`` uses ``seed + i``.

``logprobs=N`` (0 to 20, vLLM's default ``max_logprobs``) returns, per generated token, the
log-probability of the sampled token and of the ``N`` most likely ones, from the logits it was
sampled from, before penalties and temperature (vLLM's ``raw_logprobs``; see
:mod:`dcpgraph.runtime.sampling`). ``prompt_logprobs`` is refused: the compiled program returns
logits for a request's last position only. ``presence_penalty``, ``frequency_penalty`` (in
[-2, 2]) and ``repetition_penalty`` (> 0, 1 = off) have vLLM's meaning and apply to greedy
requests too.

The engine's keyword API (``Engine.add_request(prompt, max_new_tokens, **sampling)``) takes the
per-token fields only (:data:`ENGINE_FIELDS`) and is greedy by default: its keywords are filled
in from :data:`ENGINE_DEFAULTS` (``temperature=0``), not from this class's defaults.
:meth:`SamplingParams.engine_params` gives those keywords for one completion, as a JSON-able dict
(what the multi-process engine sends to its ranks).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

MAX_LOGPROBS = 20  # vLLM's default max_logprobs: the most top log-probabilities one token returns
_GREEDY_BELOW = 1e-5  # vLLM treats temperatures this small as greedy

# The fields one engine request samples with (the keywords of Engine.add_request / generate).
ENGINE_FIELDS = ("temperature", "top_k", "top_p", "seed", "logprobs", "presence_penalty", "frequency_penalty",
                 "repetition_penalty")
ENGINE_DEFAULTS = {"temperature": 0.0}  # the engine's keyword API is greedy unless told otherwise


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    max_tokens: int | None = 16
    logprobs: int | None = None  # top-N log-probabilities per sampled token (None: none at all)
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stop_strings: tuple[str, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be a positive int, got {self.n!r}")
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise ValueError(f"temperature must be a number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be an int >= 0 (or -1 for off), got {self.top_k!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")
        if self.max_tokens is not None and (
                isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be a positive int or None, got {self.max_tokens!r}")
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be an int in [0, {MAX_LOGPROBS}] or None, got {self.logprobs!r}")
        if self.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs is not supported: the compiled program returns logits for the last "
                             "prompt position only; use None")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not -2 <= value <= 2:
                raise ValueError(f"{name} must be a number in [-2, 2], got {value!r}")
        if isinstance(self.repetition_penalty, bool) or not isinstance(self.repetition_penalty, (int, float)) \
                or not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be a number > 0 (1 is off), got {self.repetition_penalty!r}")
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if not all(isinstance(s, str) and s for s in stops):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        self.stop_strings = tuple(stops)
        ids = list(self.stop_token_ids or [])
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
            raise ValueError(f"stop_token_ids must be non-negative ints, got {self.stop_token_ids!r}")
        self.stop_token_ids = ids

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_BELOW

    @property
    def penalized(self) -> bool:
        """Whether any penalty changes the logits (a greedy token is then not the raw argmax)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1)

    @classmethod
    def for_engine(cls, params: SamplingParams | None = None, **sampling: Any) -> SamplingParams:
        """The parameters of one engine request: ``params`` itself, or built from the engine's
        keywords (:data:`ENGINE_FIELDS`, greedy unless ``temperature`` says otherwise). Giving
        both, or a keyword the engine does not sample with, raises ``TypeError``."""
        if params is not None:
            if sampling:
                raise TypeError(f"give params=SamplingParams(...) or sampling keywords, not both (got "
                                f"params and {sorted(sampling)})")
            if not isinstance(params, cls):
                raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
            if params.n != 1:
                raise ValueError(f"an engine request is one completion: params.n must be 1, got {params.n} "
                                 "(LLM.generate runs n completions)")
            return params
        unknown = sorted(set(sampling) - set(ENGINE_FIELDS))
        if unknown:
            raise TypeError(f"unexpected sampling keyword(s) {unknown}; the engine samples with {list(ENGINE_FIELDS)}")
        return cls(**{**ENGINE_DEFAULTS, **sampling})

    def engine_params(self, index: int = 0) -> dict:
        """Keyword arguments of ``Engine.add_request`` for completion ``index`` of ``n`` (only the
        ones that differ from the engine's defaults, so a plain greedy request sends none)."""
        params: dict = {}
        if not self.greedy:
            seed = None if self.seed is None else self.seed + index
            params = {"temperature": float(self.temperature), "top_k": max(self.top_k, 0),
                      "top_p": float(self.top_p), "seed": seed}
        if self.logprobs is not None:
            params["logprobs"] = self.logprobs
        for name, off in (("presence_penalty", 0), ("frequency_penalty", 0), ("repetition_penalty", 1)):
            if getattr(self, name) != off:
                params[name] = float(getattr(self, name))
        return params

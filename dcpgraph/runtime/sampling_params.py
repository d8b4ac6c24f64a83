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
:mod:`dcpgraph.runtime.sampling`). ``prompt_logprobs=N`` (0 to 20) returns, for every prompt token
after the first, its log-probability given the tokens before it and the ``N`` most likely tokens
at that position (vLLM's: the first prompt token has none). ``presence_penalty``, ``frequency_penalty`` (in
[-2, 2]) and ``repetition_penalty`` (> 0, 1 = off) have vLLM's meaning and apply to greedy
requests too.

vLLM's logits-shaping fields (applied by :func:`~.sampling.process_logits`, greedy included, in
vLLM's order: ``allowed_token_ids``, ``bad_words``, ``min_tokens``, ``logit_bias``, then the
penalties): ``allowed_token_ids`` (a non-empty list: every other token gets ``-inf``);
``bad_words`` (strings; :meth:`SamplingParams.update_from_tokenizer` turns each into the token
sequences vLLM bans, with and without a leading space, kept in ``bad_words_token_ids``: the last
token of a sequence is banned when the output so far ends with the rest of it); ``min_tokens``
(until that many tokens are out, EOS (unless ``ignore_eos``) and ``stop_token_ids`` get ``-inf``,
and neither they nor stop strings end the request); ``logit_bias`` (token id -> value added to its
logit; JSON's string keys are accepted). ``min_p`` (in [0, 1]) drops, after temperature, tokens
whose probability is below ``min_p`` times the largest one; it never changes a greedy token.
``ignore_eos`` makes the scheduler not stop at EOS (``max_tokens`` ends the request).
``truncate_prompt_tokens`` (``k >= 1``, or ``-1`` for ``max_model_len``) keeps a prompt's last
``k`` tokens (:meth:`SamplingParams.truncate`). ``structured_outputs``
(:class:`~.structured_outputs.StructuredOutputsParams`, or vLLM's request object as a dict)
constrains the output to a JSON schema, JSON object, regex, choice or EBNF grammar: every sampled
or verified row is masked to the tokens the grammar allows (:mod:`.grammar`); speculative drafts
are checked against the grammar too, so such a request may still take drafts.
``structured_outputs_after_token`` (set by the server's reasoning parser to ``</think>``'s id)
starts the constraint after that token, leaving the reasoning unconstrained.

Invariant: a request whose greedy token may differ from the raw argmax (:attr:`SamplingParams.
modifies_logits`) is never given speculative drafts (they are verified against raw logits); a
``min_p`` request may be, since :func:`~.sampling.probabilities` (what sampling and rejection
sampling both draw from) applies it.

The engine's keyword API (``Engine.add_request(prompt, max_new_tokens, **sampling)``) takes the
per-token fields only (:data:`ENGINE_FIELDS`) and is greedy by default: its keywords are filled
in from :data:`ENGINE_DEFAULTS` (``temperature=0``), not from this class's defaults.
:meth:`SamplingParams.engine_params` gives those keywords for one completion, as a JSON-able dict
(what the multi-process engine sends to its ranks).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from .structured_outputs import StructuredOutputsParams

MAX_LOGPROBS = 20  # vLLM's default max_logprobs: the most top log-probabilities one token returns
_GREEDY_BELOW = 1e-5  # vLLM treats temperatures this small as greedy

# The fields one engine request samples with (the keywords of Engine.add_request / generate).
# ``stop_token_ids`` is sent only with ``min_tokens``: the engine masks them; the caller stops at them.
ENGINE_FIELDS = ("temperature", "top_k", "top_p", "seed", "logprobs", "prompt_logprobs", "presence_penalty", "frequency_penalty",
                 "repetition_penalty", "min_p", "ignore_eos", "min_tokens", "logit_bias", "allowed_token_ids",
                 "bad_words_token_ids", "stop_token_ids", "structured_outputs",
                 "structured_outputs_after_token")
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
    prompt_logprobs: int | None = None  # top-N log-probabilities per prompt token (None: none at all)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    min_p: float = 0.0
    ignore_eos: bool = False
    min_tokens: int = 0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = None  # from bad_words (update_from_tokenizer), or given
    truncate_prompt_tokens: int | None = None
    structured_outputs: StructuredOutputsParams | None = None  # a dict is read as vLLM's object
    structured_outputs_after_token: int | None = None  # the constraint starts after this token (a reasoning end)
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
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be an int in [0, {MAX_LOGPROBS}] or None, got {value!r}")
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
        self._check_vllm_extras()

    def _check_vllm_extras(self) -> None:
        """The logits-shaping and length fields (module docstring); normalises ``logit_bias`` to
        ``{int: float}`` and the id lists to lists of ints."""
        if isinstance(self.min_p, bool) or not isinstance(self.min_p, (int, float)) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be a number in [0, 1], got {self.min_p!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an int >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be at most max_tokens ({self.max_tokens})")
        if self.truncate_prompt_tokens is not None and (not _is_int(self.truncate_prompt_tokens)
                                                        or self.truncate_prompt_tokens == 0
                                                        or self.truncate_prompt_tokens < -1):
            raise ValueError(f"truncate_prompt_tokens must be an int >= 1, -1 (max_model_len) or None, "
                             f"got {self.truncate_prompt_tokens!r}")
        self.logit_bias = _logit_bias(self.logit_bias)
        if self.structured_outputs is not None:
            self.structured_outputs = StructuredOutputsParams.from_json(self.structured_outputs)
            if self.structured_outputs_after_token is not None and not _is_int(self.structured_outputs_after_token):
                raise ValueError(f"structured_outputs_after_token must be a token id, got "
                                 f"{self.structured_outputs_after_token!r}")
            if self.min_tokens:
                raise ValueError("min_tokens cannot be combined with structured_outputs: a complete output "
                                 "would have no allowed token left (the grammar allows only EOS there)")
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _token_ids("allowed_token_ids", self.allowed_token_ids)
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty (every token would be banned)")
        if self.bad_words is not None and not (isinstance(self.bad_words, (list, tuple))
                                               and all(isinstance(w, str) and w.strip() for w in self.bad_words)):
            raise ValueError(f"bad_words must be a list of non-blank strings, got {self.bad_words!r}")
        if self.bad_words_token_ids is not None:
            if not isinstance(self.bad_words_token_ids, (list, tuple)):
                raise ValueError(f"bad_words_token_ids must be a list of token-id lists, got {self.bad_words_token_ids!r}")
            self.bad_words_token_ids = [_token_ids("bad_words_token_ids", ids) for ids in self.bad_words_token_ids]
            if not all(self.bad_words_token_ids):
                raise ValueError("bad_words_token_ids must not hold an empty sequence")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_BELOW

    @property
    def penalized(self) -> bool:
        """Whether any penalty changes the logits (a greedy token is then not the raw argmax)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1)

    @property
    def modifies_logits(self) -> bool:
        """Whether a greedy token may differ from the raw argmax: a penalty, ``logit_bias``,
        ``allowed_token_ids``, ``bad_words`` or ``min_tokens`` changes the logits. Such a request
        takes no speculative drafts (they are verified against the raw logits)."""
        return bool(self.penalized or self.logit_bias or self.allowed_token_ids is not None
                    or self.bad_words_token_ids or self.min_tokens)

    def update_from_tokenizer(self, tokenizer) -> None:
        """Fill ``bad_words_token_ids`` from ``bad_words`` as vLLM does: each word (leading spaces
        stripped) is encoded without special tokens as is, and with a leading space when that
        gives a different first token and as many tokens (the word in mid-text)."""
        if not self.bad_words:
            return
        sequences: list[list[int]] = []
        for word in self.bad_words:
            plain = list(tokenizer.encode(word.lstrip(), add_special_tokens=False))
            sequences.append(plain)
            spaced = list(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
            if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
                sequences.append(spaced)
        self.bad_words_token_ids = sequences

    def check_vocab(self, vocab_size: int) -> None:
        """``ValueError`` naming the field when a token id this request shapes the logits with is
        outside ``[0, vocab_size)`` (``stop_token_ids`` past the vocabulary are never sampled)."""
        fields = {"logit_bias": list(self.logit_bias or ()), "allowed_token_ids": self.allowed_token_ids or [],
                  "bad_words": [t for ids in self.bad_words_token_ids or () for t in ids]}
        for name, ids in fields.items():
            bad = sorted({t for t in ids if t >= vocab_size})
            if bad:
                raise ValueError(f"{name} holds token ids {bad[:5]} outside the vocabulary [0, {vocab_size})")

    def truncate(self, token_ids: list[int], max_model_len: int) -> list[int]:
        """The prompt's last ``truncate_prompt_tokens`` tokens (``-1``: ``max_model_len``); all of
        it when unset or already shorter (vLLM truncates on the left)."""
        k = self.truncate_prompt_tokens
        if k is None:
            return token_ids
        k = max_model_len if k == -1 else k
        return token_ids[-k:] if len(token_ids) > k else token_ids

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
        # an engine request's length is add_request's max_new_tokens: max_tokens must not bound min_tokens
        unbounded = {"max_tokens": None} if sampling.get("min_tokens") else {}
        return cls(**{**ENGINE_DEFAULTS, **sampling, **unbounded})

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
        if self.prompt_logprobs is not None:
            params["prompt_logprobs"] = self.prompt_logprobs
        for name, off in (("presence_penalty", 0), ("frequency_penalty", 0), ("repetition_penalty", 1)):
            if getattr(self, name) != off:
                params[name] = float(getattr(self, name))
        return {**params, **self._shaping_params()}

    def _shaping_params(self) -> dict:
        """The logits-shaping and EOS keywords that differ from their defaults (JSON-able:
        ``logit_bias`` as ``[[id, bias], ...]``, since JSON object keys are strings)."""
        if self.bad_words and self.bad_words_token_ids is None:
            raise ValueError("bad_words need their token ids: call update_from_tokenizer(tokenizer) first")
        params: dict = {}
        if self.min_p:
            params["min_p"] = float(self.min_p)
        if self.ignore_eos:
            params["ignore_eos"] = True
        if self.min_tokens:
            params["min_tokens"] = self.min_tokens
            if self.stop_token_ids:
                params["stop_token_ids"] = list(self.stop_token_ids)
        if self.logit_bias:
            params["logit_bias"] = [[t, b] for t, b in sorted(self.logit_bias.items())]
        if self.allowed_token_ids is not None:
            params["allowed_token_ids"] = list(self.allowed_token_ids)
        if self.bad_words_token_ids:
            params["bad_words_token_ids"] = [list(ids) for ids in self.bad_words_token_ids]
        if self.structured_outputs is not None:
            params["structured_outputs"] = self.structured_outputs.to_json()
            if self.structured_outputs_after_token is not None:
                params["structured_outputs_after_token"] = self.structured_outputs_after_token
        return params


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _token_ids(name: str, ids: Any) -> list[int]:
    if not isinstance(ids, (list, tuple)) or not all(_is_int(t) and t >= 0 for t in ids):
        raise ValueError(f"{name} must be a list of non-negative token ids, got {ids!r}")
    return [int(t) for t in ids]


def _logit_bias(bias: Any) -> dict[int, float] | None:
    """``{token id: bias}`` from a dict (int or decimal-string keys, as JSON gives them) or a list
    of ``[id, bias]`` pairs; every bias a finite number."""
    if bias is None:
        return None
    items = bias.items() if isinstance(bias, dict) else bias
    out: dict[int, float] = {}
    try:
        for token, value in items:
            token_id = int(token) if isinstance(token, str) and token.strip().isdigit() else token
            if not _is_int(token_id) or token_id < 0:
                raise ValueError
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError
            out[token_id] = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"logit_bias must map token ids to finite numbers, got {bias!r}") from None
    return out

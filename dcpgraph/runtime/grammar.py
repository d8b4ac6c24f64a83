"""Grammar-constrained sampling with xgrammar: a logits mask per sampled row.

:class:`GrammarBackend` holds one ``GrammarCompiler`` per tokenizer (its ``TokenizerInfo`` built
for the *model's* vocabulary size, which may exceed the tokenizer's: the ids past the tokenizer
are never allowed) and caches compiled grammars by their constraint. :class:`RequestGrammar` is one
request's matcher state. Invariants:

* the matcher has accepted exactly the request's output tokens (it advances over emitted tokens
  only, :meth:`RequestGrammar.advance`), so the mask of the next row is the set of tokens the
  grammar allows after the output so far;
* a sampled token is always one the mask allowed: every row a token is drawn or verified from is
  masked first (``-inf`` outside the mask);
* speculative drafts are checked against the grammar one by one (:meth:`RequestGrammar.mask_verify_rows`):
  row ``j`` is masked with the state after drafts ``0..j-1``, the drafts are cut at the first one the
  grammar refuses, and the matcher is rolled back over every draft it tried, so it again holds the
  output only until the scheduler's emitted tokens are known.

Once the grammar is complete only the stop tokens (the model's EOS ids) are allowed. A grammar
given a start token (``after_token``: a reasoning parser's ``</think>``, as vLLM applies
structured outputs after the reasoning) masks nothing until that token is emitted, then constrains
the tokens after it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import torch

from ..errors import GrammarError, RequestError
from .structured_outputs import (
    CONSTRAINTS,
    StructuredOutputsParams,
    check_structural_tag,
    without_additional_properties,
)

_BITS = torch.arange(32, dtype=torch.int32)


def _xgrammar():
    try:
        import xgrammar
    except ImportError as err:  # pragma: no cover - declared in the serve and test extras
        raise RequestError(f"structured outputs need xgrammar (pip install 'dcpgraph[serve]'): {err}") from None
    return xgrammar


def choice_grammar(choices: Sequence[str]) -> str:
    """An EBNF grammar whose language is exactly ``choices`` (each a JSON-escaped literal)."""
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


class GrammarBackend:
    """One tokenizer's grammar compiler (built once) and its compiled grammars by constraint."""

    def __init__(self, tokenizer_info: Any, stop_token_ids: Sequence[int]):
        xgr = _xgrammar()
        self.tokenizer_info = tokenizer_info
        self.vocab_size = int(tokenizer_info.vocab_size)
        self.stop_token_ids = [int(t) for t in stop_token_ids]
        self.compiler = xgr.GrammarCompiler(tokenizer_info, max_threads=1)
        self._compiled: dict[str, Any] = {}

    @classmethod
    def from_tokenizer(cls, tokenizer, vocab_size: int, stop_token_ids: Sequence[int]) -> GrammarBackend:
        """For an HF tokenizer and the model's (possibly padded) vocabulary size."""
        xgr = _xgrammar()
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=list(stop_token_ids))
        return cls(info, stop_token_ids)

    @classmethod
    def from_serialized(cls, text: str) -> GrammarBackend:
        """From :meth:`serialize`'s text (what a front end sends a multi-process engine)."""
        data = json.loads(text)
        return cls(_xgrammar().TokenizerInfo.deserialize_json(data["tokenizer_info"]), data["stop_token_ids"])

    def serialize(self) -> str:
        return json.dumps({"tokenizer_info": self.tokenizer_info.serialize_json(),
                           "stop_token_ids": self.stop_token_ids})

    def compile(self, params: StructuredOutputsParams) -> Any:
        """The compiled grammar of ``params`` (cached); :class:`GrammarError` with xgrammar's reason."""
        key = params.key()
        if key not in self._compiled:
            try:
                self._compiled[key] = self._compile(params)
            except Exception as err:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError subclasses
                kind = next(name for name in CONSTRAINTS if getattr(params, name) is not None)
                raise GrammarError(f"structured_outputs.{kind} cannot be compiled: {err}") from None
        return self._compiled[key]

    def _compile(self, params: StructuredOutputsParams) -> Any:
        c = self.compiler
        if params.json is not None or params.json_object:  # json_object: any JSON object, as vLLM
            schema = params.json if params.json is not None else {"type": "object"}
            if params.disable_additional_properties:
                schema = without_additional_properties(schema)
            compact = params.disable_any_whitespace
            return c.compile_json_schema(schema if isinstance(schema, str) else json.dumps(schema),
                                         any_whitespace=not compact, separators=(",", ":") if compact else None)
        if params.regex is not None:
            return c.compile_regex(params.regex)
        if params.choice is not None:
            return c.compile_grammar(choice_grammar(params.choice))
        if params.structural_tag is not None:
            return self._compile_structural_tag(params.structural_tag)
        return c.compile_grammar(params.grammar)

    def _compile_structural_tag(self, text: str) -> Any:
        """vLLM's two shapes (see :mod:`.structured_outputs`), as vLLM's xgrammar backend compiles them."""
        tag = check_structural_tag(text)
        if "structures" not in tag:
            return self.compiler.compile_structural_tag(text)
        xgr = _xgrammar()
        items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
                 for s in tag["structures"]]
        return self.compiler.compile_structural_tag(items, tag["triggers"])

    def matcher(self, params: StructuredOutputsParams, after_token: int | None = None) -> RequestGrammar:
        return RequestGrammar(self, self.compile(params), after_token)


class RequestGrammar:
    """One request's grammar state: the tokens it allows next, advanced over emitted tokens."""

    def __init__(self, backend: GrammarBackend, compiled: Any, after_token: int | None = None):
        xgr = _xgrammar()
        self.waiting_for = after_token  # the grammar starts after this token (a reasoning end) is emitted
        self.vocab_size = backend.vocab_size
        self.stop_token_ids = backend.stop_token_ids
        self.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=backend.stop_token_ids)
        self._bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)

    def allowed(self) -> torch.Tensor:
        """``[V]`` bool: the tokens the grammar allows after what the matcher accepted (all of
        them while it waits for its start token)."""
        if self.waiting_for is not None:
            return torch.ones(self.vocab_size, dtype=torch.bool)
        if self.matcher.is_terminated():
            mask = torch.zeros(self.vocab_size, dtype=torch.bool)
            mask[torch.tensor(self.stop_token_ids, dtype=torch.long)] = True
            return mask
        self.matcher.fill_next_token_bitmask(self._bitmask)
        words = self._bitmask[0].to(torch.int32)
        return ((words[:, None] >> _BITS) & 1).bool().reshape(-1)[: self.vocab_size]

    def mask(self, row: torch.Tensor) -> torch.Tensor:
        """``row [V']`` with every token the grammar refuses at ``-inf`` (a new tensor); ids past
        the grammar's vocabulary are refused too."""
        allowed = self.allowed()
        keep = torch.zeros(row.shape[-1], dtype=torch.bool)
        n = min(row.shape[-1], allowed.numel())
        keep[:n] = allowed[:n]
        return row.masked_fill(~keep, float("-inf"))

    def mask_verify_rows(self, rows: torch.Tensor, drafts: Sequence[int]) -> tuple[torch.Tensor, list[int]]:
        """The ``1 + k`` rows of a chunk verified with ``drafts``, row ``j`` masked with the state
        after drafts ``0..j-1``; drafts from the first one the grammar refuses on are dropped (with
        their rows). The matcher is left as it was (rolled back over the drafts it accepted)."""
        masked, kept, waiting, accepted = [], [], self.waiting_for, 0
        for j in range(len(drafts) + 1):
            masked.append(self.mask(rows[j]))
            if j == len(drafts):
                break
            draft = int(drafts[j])
            if self.waiting_for is not None:
                self.waiting_for = None if draft == self.waiting_for else self.waiting_for
            elif self.matcher.is_terminated() or not self.matcher.accept_token(draft):
                break
            else:
                accepted += 1
            kept.append(draft)
        if accepted:
            self.matcher.rollback(accepted)
        self.waiting_for = waiting
        return torch.stack(masked), kept

    def advance(self, tokens: Sequence[int]) -> None:
        """Accept the request's newly emitted ``tokens`` (each one the mask allowed)."""
        for token in tokens:
            if self.waiting_for is not None:
                self.waiting_for = None if int(token) == self.waiting_for else self.waiting_for
                continue
            if self.matcher.is_terminated():
                return
            if not self.matcher.accept_token(int(token)):
                raise RuntimeError(f"token {token} was emitted but the grammar refuses it (a mask was skipped)")

"""Text of a growing token sequence, released only where it can no longer change.

:class:`TextStream` receives a request's tokens one at a time and returns the text each one adds.
Invariants:

- the released text is always a prefix of the final text, so concatenated stream deltas equal the
  ``text`` of the finished output;
- no character is ever split: a byte-level tokenizer decodes an incomplete UTF-8 sequence at the
  end as U+FFFD, so trailing U+FFFD is held back until a later token completes (or the request
  ends with) it;
- a ``stop`` string is looked for in the decoded text, never in token ids, and the last
  ``len(longest stop) − 1`` characters are held back while the request runs, so a stop string is
  never partly streamed; the output ends right before it (or after it, with
  ``include_stop_str_in_output``);
- with ``min_tokens``, a stop token ends the output only once ``min_tokens`` tokens are out and a
  stop string only after that (vLLM's rules); with ``ignore_eos`` an EOS token that the budget
  happened to end on is a ``"length"`` finish.

Each step decodes the request's whole output (``O(n)`` per token): outputs here are short and it
keeps the decoder's own handling of spaces and special tokens exact.
"""

from __future__ import annotations

from collections.abc import Iterable

from .params import SamplingParams

_REPLACEMENT = "\ufffd"


class TextStream:
    def __init__(self, tokenizer, params: SamplingParams, eos_token_ids: Iterable[int] = ()):
        self.tokenizer = tokenizer
        self.params = params
        self.eos_token_ids = frozenset(eos_token_ids)
        self.stop_token_ids = frozenset(params.stop_token_ids or ())
        self.token_ids: list[int] = []
        self.text = ""  # released so far
        self.finished = False
        self.finish_reason: str | None = None
        self._text_tokens = 0  # leading token_ids that make up the text (a stop token is left out)
        self._hold = max((len(s) for s in params.stop_strings), default=1) - 1

    def _decode(self) -> str:
        ids = self.token_ids[: self._text_tokens]
        return self.tokenizer.decode(ids, skip_special_tokens=self.params.skip_special_tokens)

    def add(self, token: int, engine_finished: bool) -> str:
        """Take the next token (``engine_finished``: the engine ended the request with it: EOS or
        its token budget); return the newly released text. After it returns with
        :attr:`finished` set, the caller aborts the request if the engine had not ended it."""
        if self.finished:
            raise RuntimeError("token after the stream finished")
        self.token_ids.append(int(token))
        count, min_tokens = len(self.token_ids), self.params.min_tokens
        if token in self.stop_token_ids and count >= min_tokens:
            self._finish("stop")
        else:
            self._text_tokens = count
        full = self._decode()
        if not self.finished and count > min_tokens:  # vLLM checks stop strings only past min_tokens
            start = max(0, len(self.text) - self._hold)
            for position, stop in sorted((full.find(s, start), s) for s in self.params.stop_strings):
                if position >= 0:
                    end = position + len(stop) if self.params.include_stop_str_in_output else position
                    full = full[:end]
                    self._finish("stop")
                    break
        if not self.finished and engine_finished:
            eos = token in self.eos_token_ids and not self.params.ignore_eos
            self._finish("stop" if eos else "length")
        if self.finished:
            visible = full
        else:
            visible = full.rstrip(_REPLACEMENT)
            visible = visible[: max(len(visible) - self._hold, len(self.text))] if self._hold else visible
        if not visible.startswith(self.text):  # only a decoder that rewrites earlier text gets here
            if not self.finished:
                return ""
            raise RuntimeError(f"decoded text changed after release: {self.text!r} -> {visible!r}")
        delta = visible[len(self.text):]
        self.text = visible
        return delta

    def _finish(self, reason: str) -> None:
        self.finished = True
        self.finish_reason = reason

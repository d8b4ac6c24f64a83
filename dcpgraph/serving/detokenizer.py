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

Decoding is incremental, ``O(1)`` amortised per token (a whole-output decode per token was
``O(n²)`` per request): :func:`incremental_decoder` gives ``tokenizers``' ``DecodeStream`` for a
fast tokenizer whose ``decode`` is its backend's, and vLLM's prefix/read-offset method (decode a
short window, keep what it adds past its already-read part) for any other tokenizer. Both keep
:attr:`IncrementalDecoder.text` equal to ``tokenizer.decode(ids, skip_special_tokens=...)`` of the
ids pushed so far, U+FFFD of an unfinished character included, which is what the stop-string
search and the hold-back above read (tests/test_detokenizer.py compares the two on every step).
"""

from __future__ import annotations

from collections.abc import Iterable

from .params import SamplingParams

_REPLACEMENT = "\ufffd"


class IncrementalDecoder:
    """vLLM's prefix/read-offset detokenisation over ``tokenizer.decode`` (any tokenizer).

    Invariant: ``ids[:read]`` decode to :attr:`stable`, and :attr:`text` is what ``ids`` decode to
    now. Each token decodes one short window, ``ids[prefix:]``, where ``prefix`` starts the last
    released chunk, and subtracts the decode of ``ids[prefix:read]``: a decoder that treats a
    text's first token specially (SentencePiece's leading space) sees the same first token in both.
    What the window adds is released into :attr:`stable` once it is non-empty and does not end
    inside a character. A window that rewrites its own start (byte fallback turns released
    characters into U+FFFD while a stray byte follows them, as far back as the run of byte tokens
    goes) releases nothing, and :attr:`text` is then the whole decode, until windows extend again:
    ``O(n)`` per token only while a model emits invalid UTF-8."""

    def __init__(self, tokenizer, skip_special_tokens: bool):
        self.tokenizer, self.skip = tokenizer, skip_special_tokens
        self.ids: list[int] = []
        self.stable = ""
        self.prefix = self.read = 0
        self._tail = ""  # what ids[read:] add (held back)
        self._whole: str | None = None  # the whole decode, while a window rewrites its start

    @property
    def text(self) -> str:
        return self.stable + self._tail if self._whole is None else self._whole

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip) if ids else ""

    def push(self, token: int) -> None:
        self.ids.append(int(token))
        self._step()

    def _step(self) -> None:
        before, window = self._window()
        if window.startswith(before):
            added = window[len(before):]
            if added and not added.endswith(_REPLACEMENT):
                return self._release(added)
            self._tail, self._whole = added, None  # nothing yet, or it ends inside a character
        else:
            self._tail, self._whole = "", self.decode(self.ids)

    def _window(self) -> tuple[str, str]:
        """The decodes of ``ids[prefix:read]`` and ``ids[prefix:]``."""
        return self.decode(self.ids[self.prefix:self.read]), self.decode(self.ids[self.prefix:])

    def _release(self, added: str) -> None:
        self.stable += added
        self._tail, self._whole = "", None
        self.prefix, self.read = self.read, len(self.ids)


class StreamDecoder(IncrementalDecoder):
    """``tokenizers.decoders.DecodeStream`` over a fast tokenizer's backend: it returns each
    released chunk (the Rust side of the same offsets method, which holds a window back while it
    ends in U+FFFD); only while it holds one back is the window decoded here, for :attr:`text`.
    Where ``DecodeStream`` gives up (it raises when a window rewrites its own start), the offsets
    method of :class:`IncrementalDecoder` goes on alone."""

    def __init__(self, tokenizer, skip_special_tokens: bool):
        from tokenizers.decoders import DecodeStream

        super().__init__(tokenizer, skip_special_tokens)
        self.backend = tokenizer.backend_tokenizer
        self.stream = DecodeStream(skip_special_tokens=skip_special_tokens)

    def decode(self, ids: list[int]) -> str:
        return self.backend.decode(ids, skip_special_tokens=self.skip) if ids else ""

    def _step(self) -> None:
        if self.stream is None:
            return super()._step()
        try:
            chunk = self.stream.step(self.backend, self.ids[-1])
        except Exception:  # its window no longer starts with its prefix (a stray byte after a
            self.stream = None  # byte-fallback character): the Python side takes over from here
            return super()._step()
        if chunk is not None:
            return self._release(chunk)
        before, window = self._window()
        if window.startswith(before):
            self._tail, self._whole = window[len(before):], None
        else:
            self._tail, self._whole = "", self.decode(self.ids)


def incremental_decoder(tokenizer, skip_special_tokens: bool) -> IncrementalDecoder:
    """:class:`StreamDecoder` where ``tokenizer.decode`` is exactly its ``tokenizers`` backend's
    decode (a ``PreTrainedTokenizerFast`` that does not override decoding and applies no
    ``clean_up_tokenization_spaces``), else :class:`IncrementalDecoder` over ``tokenizer.decode``."""
    if _decodes_with_backend(tokenizer):
        return StreamDecoder(tokenizer, skip_special_tokens)
    return IncrementalDecoder(tokenizer, skip_special_tokens)


def _decodes_with_backend(tokenizer) -> bool:
    try:
        from tokenizers import Tokenizer
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        return False
    cls = type(tokenizer)
    if not isinstance(getattr(tokenizer, "backend_tokenizer", None), Tokenizer) or \
            cls.decode is not PreTrainedTokenizerFast.decode or cls._decode is not PreTrainedTokenizerFast._decode:
        return False
    if not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return True
    # transformers skips the clean-up for BPE models unless forced (PreTrainedTokenizerFast._decode)
    return type(tokenizer.backend_tokenizer.model).__name__ == "BPE" and not getattr(
        tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False)


class TextStream:
    def __init__(self, tokenizer, params: SamplingParams, eos_token_ids: Iterable[int] = (), decoder=None):
        """``decoder``: an :class:`IncrementalDecoder` to use (default: :func:`incremental_decoder`'s)."""
        self.tokenizer = tokenizer
        self.params = params
        self.eos_token_ids = frozenset(eos_token_ids)
        self.stop_token_ids = frozenset(params.stop_token_ids or ())
        self.token_ids: list[int] = []
        self.text = ""  # released so far
        self.finished = False
        self.finish_reason: str | None = None
        self._decoder = decoder or incremental_decoder(tokenizer, params.skip_special_tokens)
        self._hold = max((len(s) for s in params.stop_strings), default=1) - 1

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
        else:  # a stop token is kept in token_ids, out of the text
            self._decoder.push(token)
        full = self._decoder.text
        if not self.finished and count > min_tokens:  # vLLM checks stop strings only past min_tokens
            full = self._cut_at_stop(full)
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

    def _cut_at_stop(self, full: str) -> str:
        """``full`` up to the first stop string that starts in the not yet released text (and
        finished), or ``full`` unchanged."""
        start = max(0, len(self.text) - self._hold)
        for position, stop in sorted((full.find(s, start), s) for s in self.params.stop_strings):
            if position >= 0:
                self._finish("stop")
                return full[:position + len(stop) if self.params.include_stop_str_in_output else position]
        return full

    def _finish(self, reason: str) -> None:
        self.finished = True
        self.finish_reason = reason

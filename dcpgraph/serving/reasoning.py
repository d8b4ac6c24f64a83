"""Reasoning parsers (vLLM's ``--reasoning-parser``): a chat output's ``<think>...</think>`` part
goes to ``message.reasoning`` (vLLM 0.32's field name), the rest to ``content``.

Both parsers read the output as starting *inside* the reasoning (the chat template opens
``<think>``): a leading ``<think>`` is dropped, the text up to ``</think>`` is reasoning, the text
after it is content (``None`` when empty); an output without ``</think>`` is all reasoning.
``qwen3`` differs in one case: a request with ``chat_template_kwargs: {"enable_thinking": false}``
has no reasoning, its whole output is content. The same split holds for a stream:
:class:`ReasoningStream` holds back a piece of text that may be the start of a marker until the
next delta says, so the concatenated deltas equal the whole output's split.
"""

from __future__ import annotations

from dataclasses import dataclass

THINK_START, THINK_END = "<think>", "</think>"
REASONING_PARSERS = ("qwen3", "deepseek_r1")  # the ones dcpgraph implements


@dataclass(frozen=True)
class ReasoningParser:
    """One parser (by vLLM's name) and the tokenizer's ``</think>`` id (``None`` if it is not one token)."""

    name: str
    end_token_id: int | None = None

    @classmethod
    def for_tokenizer(cls, name: str, tokenizer) -> ReasoningParser:
        if name not in REASONING_PARSERS:
            raise ValueError(f"reasoning parser {name!r} is not implemented; choose from {list(REASONING_PARSERS)}")
        ids = tokenizer.encode(THINK_END, add_special_tokens=False)
        return cls(name, ids[0] if len(ids) == 1 else None)

    def thinks(self, template_kwargs: dict | None) -> bool:
        """Whether a request's output starts in its reasoning part."""
        return not (self.name == "qwen3" and (template_kwargs or {}).get("enable_thinking", True) is False)

    def split(self, text: str, template_kwargs: dict | None = None) -> tuple[str | None, str | None]:
        """``(reasoning, content)`` of a whole output."""
        stream = self.stream(template_kwargs)
        reasoning, content = stream.feed(text)
        more_reasoning, more_content = stream.finish()
        reasoning, content = reasoning + more_reasoning, content + more_content
        if not self.thinks(template_kwargs):
            return None, content
        return reasoning, content or None

    def stream(self, template_kwargs: dict | None = None) -> ReasoningStream:
        return ReasoningStream(self.thinks(template_kwargs))


class ReasoningStream:
    """Splits an output's text deltas into ``(reasoning delta, content delta)`` pairs."""

    def __init__(self, thinking: bool):
        self.in_reasoning = thinking
        self.at_start = thinking  # a leading <think> is still to be dropped
        self.held = ""

    def feed(self, delta: str) -> tuple[str, str]:
        text = self.held + delta
        self.held = ""
        if not self.in_reasoning:
            return "", text
        if self.at_start:
            if THINK_START.startswith(text) and len(text) < len(THINK_START):
                self.held = text  # may still become <think>
                return "", ""
            self.at_start = False
            if text.startswith(THINK_START):
                text = text[len(THINK_START):]
        end = text.find(THINK_END)
        if end >= 0:
            self.in_reasoning = False
            return text[:end], text[end + len(THINK_END):]
        keep = _partial_suffix(text, THINK_END)
        self.held = text[len(text) - keep:] if keep else ""
        return text[: len(text) - keep], ""

    def finish(self) -> tuple[str, str]:
        """What was held back at the end of the output (reasoning, since no marker completed)."""
        held, self.held = self.held, ""
        return (held, "") if self.in_reasoning else ("", held)


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0

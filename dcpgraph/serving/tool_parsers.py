"""Tool-call parsers for ``tool_choice: "auto"`` (vLLM's ``--tool-call-parser``): an output's
calls and the content around them. An output the parser cannot read is all content, no calls.

* ``hermes``: each call is ``<tool_call>{"name": N, "arguments": {...}}</tool_call>`` (the last one
  may be unclosed); the content is the text before the first ``<tool_call>`` (``None`` if empty).
* ``llama3_json``: the output (after an optional ``<|python_tag|>``) is one or more JSON objects
  ``{"name": N, "parameters"|"arguments": {...}}`` separated by ``;``; the content is ``None``.

``arguments`` is the call's arguments as JSON text (``ensure_ascii=False``, as vLLM).
"""

from __future__ import annotations

import json
import re

from .tool_call_stream import parser_call_stream
from .tools import new_call

TOOL_CALL_PARSERS = ("hermes", "llama3_json")  # the ones dcpgraph implements
_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"


def parse_hermes(text: str) -> tuple[str | None, list[dict]]:
    start = text.find("<tool_call>")
    if start < 0:
        return text, []
    try:
        calls = []
        for closed, open_ in _HERMES.findall(text):
            item = json.loads(closed or open_)
            calls.append(new_call(item["name"], json.dumps(item.get("arguments", {}), ensure_ascii=False)))
    except (json.JSONDecodeError, KeyError, TypeError):
        return text, []
    return text[:start] or None, calls


def parse_llama3_json(text: str) -> tuple[str | None, list[dict]]:
    body = text[len(_PYTHON_TAG):] if text.startswith(_PYTHON_TAG) else text
    if not body.lstrip().startswith("{"):
        return text, []
    decoder, calls, at = json.JSONDecoder(), [], 0
    try:
        while at < len(body):
            while at < len(body) and body[at] in " \t\r\n;":
                at += 1
            if at == len(body):
                break
            item, at = decoder.raw_decode(body, at)
            arguments = item.get("parameters", item.get("arguments", {}))
            calls.append(new_call(item["name"], json.dumps(arguments, ensure_ascii=False)))
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
        return text, []
    return None, calls


PARSERS = {"hermes": parse_hermes, "llama3_json": parse_llama3_json}


class AutoToolStream:
    """A streamed output under ``tool_choice: "auto"``: content is sent as it comes until it may
    be the start of a call (``<tool_call>`` for hermes; a leading ``{`` or ``<|python_tag|>`` for
    llama3_json); from there the text goes to a :class:`~.tool_call_stream.CallStream`, whose
    calls are sent argument fragment by fragment, as vLLM's. If no call was found by the end, the
    held text is sent as content (:meth:`finish`)."""

    def __init__(self, parser: str):
        self.parser = parser
        self.text = ""
        self.sent = 0  # characters of text sent as content
        self.holding = False
        self.calls = parser_call_stream(parser)
        self.fed = 0  # characters of text given to ``calls``

    def feed(self, delta: str) -> tuple[str, list[dict]]:
        """The content and the tool-call deltas ``delta`` completes."""
        self.text += delta
        content = ""
        if not self.holding:
            safe = self._safe_end()
            content, self.sent = self.text[self.sent:safe], max(self.sent, safe)
            if not self.holding:
                return content, []
            self.fed = self.sent
        deltas = self.calls.feed(self.text[self.fed:])
        self.fed = len(self.text)
        return content, deltas

    def _safe_end(self) -> int:
        """How much of the text cannot be part of a call (setting ``holding`` once a call may start)."""
        if self.parser == "hermes":
            start = self.text.find("<tool_call>")
            if start >= 0:
                self.holding = True
                return start
            return len(self.text) - _partial_suffix(self.text, "<tool_call>")
        head = self.text.lstrip()
        if head.startswith(("{", _PYTHON_TAG)):
            self.holding = True
            return self.sent
        if not head or _PYTHON_TAG.startswith(head):
            return self.sent  # not decided yet
        return len(self.text)

    def finish(self) -> tuple[str, bool]:
        """The content not sent yet, and whether calls were sent (then nothing more is content)."""
        if self.calls.calls:
            return "", True
        return self.text[self.sent:], False


def _partial_suffix(text: str, marker: str) -> int:
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0

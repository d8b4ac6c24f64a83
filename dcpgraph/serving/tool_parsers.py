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
    llama3_json), then held; :meth:`finish` parses the whole output as the non-streamed response
    does and gives the rest of the content and the calls."""

    def __init__(self, parser: str):
        self.parser = parser
        self.text = ""
        self.sent = 0  # characters of text sent as content
        self.holding = False

    def feed(self, delta: str) -> str:
        self.text += delta
        if self.holding:
            return ""
        safe = self._safe_end()
        out, self.sent = self.text[self.sent:safe], max(self.sent, safe)
        return out

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

    def finish(self) -> tuple[str, list[dict]]:
        """The content not sent yet and the calls (none if the output holds no readable call)."""
        content, calls = PARSERS[self.parser](self.text)
        if not calls:
            return self.text[self.sent:], []
        return (content or "")[self.sent:], calls


def _partial_suffix(text: str, marker: str) -> int:
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0

"""Tool calls streamed as vLLM streams them: a call's first delta carries its ``index``, ``id``,
``type`` and ``function.name`` (with ``arguments: ""``); each later delta carries only
``{"index", "function": {"arguments": <fragment>}}``, so that the fragments of one call, joined,
are its arguments as JSON text. A client (the ``openai`` library's stream accumulation) rebuilds
the calls by joining fragments per ``index``.

:class:`CallStream` reads a JSON text character by character and finds the calls in it: objects
at a given nesting depth whose ``name`` key holds the function's name and whose arguments key
(``parameters`` or ``arguments``) holds the arguments; the arguments value's own characters are
sent as they arrive (an object or array from its opening to its closing bracket; a scalar once
complete). An object with no arguments key has arguments ``{}``; one with no ``name`` is no call.
Arguments that come before the name are held until the name is read. Text outside those objects
(a tool-call parser's tags, an array's brackets and commas) is skipped.

:class:`NamedCallStream` is ``tool_choice`` naming one function: the whole output is its arguments.
"""

from __future__ import annotations

import json

from .tools import new_call

_CLOSERS = {"{": "}", "[": "]"}


class NamedCallStream:
    """The output of a named-function ``tool_choice``: one call whose arguments are the whole text."""

    def __init__(self, name: str):
        self.name = name
        self.calls = 0

    def feed(self, text: str) -> list[dict]:
        if not text:
            return []
        if self.calls == 0:
            self.calls = 1
            call = new_call(self.name, text)
            return [{"index": 0, **call}]
        return [{"index": 0, "function": {"arguments": text}}]


class CallStream:
    """The calls of a JSON text fed piece by piece (module docstring). ``call_depth`` is how many
    containers enclose a call object (0: objects at the top, as a tool-call parser's; 1: the
    items of ``tool_choice: "required"``'s array)."""

    def __init__(self, call_depth: int, argument_keys: tuple[str, ...]):
        self.call_depth = call_depth
        self.argument_keys = argument_keys
        self.calls = 0  # calls whose first delta has been sent
        self.depth = 0  # containers open at the current character
        self.in_string = self.escaped = False
        self._reset_call()

    def _reset_call(self) -> None:
        self.name: str | None = None
        self.key_chars: list[str] | None = None  # a key being read
        self.key: str | None = None  # the key whose value comes next
        self.value: str | None = None  # the key whose value is being read
        self.name_chars: list[str] = []
        self.scalar: list[str] = []  # an arguments scalar being read
        self.held: list[str] = []  # arguments read before the name
        self.had_arguments = False
        self.started = False

    def feed(self, text: str) -> list[dict]:
        """The deltas ``text`` completes: at most one first delta and one fragment per call."""
        out: list[dict] = []
        fragment: list[str] = []
        for ch in text:
            self._step(ch, fragment, out)
        self._flush(fragment, out)
        return out

    def _flush(self, fragment: list[str], out: list[dict]) -> None:
        if not fragment:
            return
        if self.started:
            out.append({"index": self.calls - 1, "function": {"arguments": "".join(fragment)}})
        else:
            self.held.extend(fragment)
        fragment.clear()

    def _start(self, fragment: list[str], out: list[dict]) -> None:
        """The name is known: send the call's first delta, then what was held."""
        self.started = True
        self.calls += 1
        out.append({"index": self.calls - 1, **new_call(self.name, "")})
        fragment[:0] = self.held
        self.held = []

    def _step(self, ch: str, fragment: list[str], out: list[dict]) -> None:
        level = self.call_depth + 1  # the depth inside a call object
        in_arguments = self.value in self.argument_keys and self.value is not None
        if self.in_string:
            self.escaped, closing = (False, False) if self.escaped else (ch == "\\", ch == '"')
            if closing:
                self.in_string = False
            if self.key_chars is not None:
                if closing:
                    self.key, self.key_chars = json.loads('"' + "".join(self.key_chars) + '"'), None
                else:
                    self.key_chars.append(ch)
            elif self.value == "name" and self.depth == level:
                if closing:
                    self.name, self.value = json.loads('"' + "".join(self.name_chars) + '"'), None
                    self._start(fragment, out)
                else:
                    self.name_chars.append(ch)
            elif in_arguments:
                (self.scalar if self.depth == level else fragment).append(ch)
                if closing and self.depth == level:
                    self._end_scalar(fragment)
            return
        if self.depth < level:  # outside any call object
            if ch in "{[":
                self.depth += 1
                if ch == "{" and self.depth == level:
                    self._reset_call()
            elif ch in "}]":
                self.depth = max(0, self.depth - 1)  # a stray closer in the text between calls
            elif ch == '"' and self.depth > 0:
                self.in_string = True
            return
        if self.depth == level and in_arguments and not self.scalar and ch in "{[":
            self.depth += 1
            fragment.append(ch)
            return
        if self.depth > level:  # inside a value nested in the call object
            if ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
            if in_arguments:
                fragment.append(ch)
                if self.depth == level:
                    self.value, self.had_arguments = None, True
            return
        # at the call object's own level
        if ch == '"':
            self.in_string = True
            if self.key is None and self.value is None:
                self.key_chars = []
            elif in_arguments:
                self.scalar.append(ch)
        elif ch == ":" and self.key is not None:
            self.value, self.key = self.key, None
            self.name_chars = []
        elif ch in ",}":
            if in_arguments and self.scalar:
                self._end_scalar(fragment)
            self.value = None
            if ch == "}":
                self.depth -= 1
                self._end_call(fragment, out)
        elif ch in "{[":
            self.depth += 1  # a value of another key
        elif in_arguments and not ch.isspace():
            self.scalar.append(ch)
        elif in_arguments and self.scalar:
            self._end_scalar(fragment)

    def _end_scalar(self, fragment: list[str]) -> None:
        fragment.extend(self.scalar)
        self.scalar, self.value, self.had_arguments = [], None, True

    def _end_call(self, fragment: list[str], out: list[dict]) -> None:
        if self.started and not self.had_arguments:
            fragment.append("{}")
        self._flush(fragment, out)
        self.started = False
        self._reset_call()


def call_stream(tool_choice) -> NamedCallStream | CallStream:
    """The stream of a constrained ``tool_choice``: a named function, or ``"required"`` (a JSON
    array of ``{"name", "parameters"}``)."""
    if isinstance(tool_choice, dict):
        return NamedCallStream(tool_choice["function"]["name"])
    return CallStream(call_depth=1, argument_keys=("parameters",))


def parser_call_stream(parser: str) -> CallStream:
    """The stream of a ``--tool-call-parser``'s calls, fed from where the first call may start."""
    keys = ("arguments",) if parser == "hermes" else ("parameters", "arguments")
    return CallStream(call_depth=0, argument_keys=keys)

"""Tool calling with ``tool_choice`` ``"required"`` or a named function, through structured
outputs (vLLM's construction), and the ``tool_calls`` of the response.

* ``{"type": "function", "function": {"name": N}}``: the output is constrained to tool ``N``'s
  ``parameters`` schema (an object with no declared properties when it has none); the response's
  ``message.tool_calls`` is one call of ``N`` whose ``arguments`` is the output text, ``content``
  is ``""`` and ``finish_reason`` stays the output's (``"stop"``), as OpenAI's API.
* ``"required"``: the output is constrained to a JSON array (at least one item; at most one with
  ``parallel_tool_calls: false``) of ``{"name": <a tool's name>, "parameters": <its schema>}``;
  each item becomes a call (``arguments``: its parameters as JSON text) and ``finish_reason`` is
  ``"tool_calls"`` when the output ended by itself.
* ``"none"``: no constraint, no parsing (the tools still go to the chat template, as vLLM).
* ``"auto"`` (the default when ``tools`` are given, as vLLM) needs ``--enable-auto-tool-choice``
  and ``--tool-call-parser`` (else a 400 naming them): the output is not constrained and the
  parser (:mod:`.tool_parsers`) reads its calls; ``finish_reason`` is ``"tool_calls"`` when it
  found any.

Every call gets an id ``chatcmpl-tool-<32 hex>``. A stream sends each call as vLLM does: a first
delta with its id and name, then its arguments fragment by fragment (:mod:`.tool_call_stream`).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

AUTO_NEEDS_PARSER = ('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set '
                     '(or use tool_choice "required", a named function or "none")')


def _parameters_or_empty(parameters: dict | None) -> dict:
    return parameters if parameters else {"type": "object", "properties": {}}


def tool_call_schema(tools: list[dict], tool_choice: Any, parallel_tool_calls: bool | None) -> dict | None:
    """The JSON schema a ``tool_choice`` constrains the output to (``None``: no constraint).
    ``tools`` are the request's ``{"type": "function", "function": {...}}`` entries."""
    functions = {t["function"]["name"]: t["function"] for t in tools}
    if isinstance(tool_choice, dict):
        return _parameters_or_empty(functions[tool_choice["function"]["name"]].get("parameters"))
    if tool_choice != "required":
        return None
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": [
        {"properties": {"name": {"type": "string", "enum": [name]},
                        "parameters": _parameters_or_empty(f.get("parameters"))},
         "required": ["name", "parameters"]} for name, f in functions.items()]}}
    if parallel_tool_calls is False:
        schema["maxItems"] = 1
    return schema


def new_call(name: str, arguments: str) -> dict:
    return {"id": f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def tool_calls_of(text: str, tool_choice: Any) -> list[dict] | None:
    """The calls a constrained output holds (``None`` when it holds none: an output cut short by
    ``max_tokens`` is not complete JSON and stays content)."""
    if isinstance(tool_choice, dict):
        try:
            json.loads(text, strict=False)
        except json.JSONDecodeError:
            return None
        return [new_call(tool_choice["function"]["name"], text)]
    if tool_choice != "required":
        return None
    try:
        items = json.loads(text, strict=False)
    except json.JSONDecodeError:
        return None
    return [new_call(item["name"], json.dumps(item["parameters"], ensure_ascii=False)) for item in items]

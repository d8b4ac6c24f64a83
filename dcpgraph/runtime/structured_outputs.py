"""``StructuredOutputsParams``: the one constraint a request's output must satisfy (vLLM's class).

Exactly one of the constraint fields is set: ``json`` (a JSON schema, as a dict or its JSON text),
``regex`` (the output fullmatches it), ``choice`` (the output is one of these strings),
``grammar`` (an EBNF grammar, xgrammar's GBNF dialect with a ``root`` rule), ``json_object``
(any JSON object) or ``structural_tag`` (the JSON text of vLLM's structural tag, in one of its two
shapes: ``{"type": "structural_tag", "format": {...}}``, xgrammar's structural-tag format, or the
older ``{"structures": [{"begin", "schema", "end"}, ...], "triggers": [...]}``, where text is free
until a trigger starts one of the structures, whose content then follows its schema up to its
``end``). ``disable_any_whitespace`` makes a ``json`` constraint emit compact JSON;
``disable_additional_properties`` (vLLM's) gives every object schema with ``properties`` or
``patternProperties`` and no ``additionalProperties`` of its own ``additionalProperties: false``
(:func:`without_additional_properties`). vLLM's ``whitespace_pattern`` is refused by name. The
constraint is applied as a logits mask by :mod:`.grammar`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
_REFUSED = {"whitespace_pattern": "whitespace_pattern is not supported (xgrammar ignores it in vLLM too)"}
OPTIONS = ("disable_any_whitespace", "disable_additional_properties")  # the flags beside the constraint


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False

    def __post_init__(self) -> None:
        given = [name for name in CONSTRAINTS if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(f"structured outputs take exactly one of {list(CONSTRAINTS)}, got "
                             f"{given or 'none'}")
        if isinstance(self.json, str):
            try:
                json.loads(self.json)
            except json.JSONDecodeError as err:
                raise ValueError(f"structured_outputs.json is not valid JSON: {err}") from None
        elif self.json is not None and not isinstance(self.json, dict):
            raise ValueError(f"structured_outputs.json must be a JSON schema (object or its text), got {self.json!r}")
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise ValueError(f"structured_outputs.regex must be a non-empty string, got {self.regex!r}")
        if self.choice is not None and (not isinstance(self.choice, (list, tuple)) or not self.choice
                                        or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError(f"structured_outputs.choice must be a non-empty list of non-empty strings, "
                             f"got {self.choice!r}")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            raise ValueError(f"structured_outputs.grammar must be a non-empty EBNF string, got {self.grammar!r}")
        if self.structural_tag is not None:
            check_structural_tag(self.structural_tag)
        if self.json_object is not None and self.json_object is not True:
            raise ValueError(f"structured_outputs.json_object must be true when given, got {self.json_object!r}")

    @classmethod
    def from_json(cls, data: StructuredOutputsParams | dict[str, Any]) -> StructuredOutputsParams:
        """From the request's ``structured_outputs`` object; vLLM fields dcpgraph does not implement
        are refused by name, unknown ones too."""
        if isinstance(data, cls):
            return data
        if not isinstance(data, dict):
            raise ValueError(f"structured_outputs must be an object, got {data!r}")
        asked = {k: v for k, v in data.items() if v not in (None, False)}
        for name in sorted(set(asked) & set(_REFUSED)):
            raise ValueError(f"structured_outputs.{name}: {_REFUSED[name]}")
        unknown = sorted(set(data) - set(CONSTRAINTS) - set(OPTIONS) - set(_REFUSED) - {"disable_fallback"})
        if unknown:
            raise ValueError(f"structured_outputs: unknown field(s) {unknown}; valid: {list(CONSTRAINTS + OPTIONS)}")
        return cls(**{k: v for k, v in data.items() if k in CONSTRAINTS or k in OPTIONS})

    def to_json(self) -> dict[str, Any]:
        """The set fields, JSON-able (what a multi-process engine sends its driver)."""
        out: dict[str, Any] = {name: getattr(self, name) for name in CONSTRAINTS if getattr(self, name) is not None}
        if "choice" in out:
            out["choice"] = list(out["choice"])
        out.update({name: True for name in OPTIONS if getattr(self, name)})
        return out

    def key(self) -> str:
        """A stable text key of the constraint (compiled grammars are cached by it)."""
        return json.dumps(self.to_json(), sort_keys=True)


def without_additional_properties(schema: str | dict) -> dict:
    """A copy of the JSON ``schema`` where every object schema with ``properties`` or
    ``patternProperties`` and no ``additionalProperties`` gets ``additionalProperties: false``,
    at any depth (vLLM's ``disable_additional_properties``)."""
    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            out = {k: walk(v) for k, v in node.items()}
            if "additionalProperties" not in out and ("properties" in out or "patternProperties" in out):
                out["additionalProperties"] = False
            return out
        if isinstance(node, list):
            return [walk(v) for v in node]
        return node

    return walk(json.loads(schema) if isinstance(schema, str) else schema)


def check_structural_tag(text: str) -> dict:
    """``structural_tag``'s JSON text read and its shape checked (which of the two, see the module
    docstring); what each structure's schema and format say is checked by xgrammar at compile
    time. Returns the object."""
    if not isinstance(text, str):
        raise ValueError(f"structured_outputs.structural_tag must be the JSON text of a structural tag, got {text!r}")
    try:
        tag = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"structured_outputs.structural_tag is not valid JSON: {err}") from None
    if not isinstance(tag, dict):
        raise ValueError(f"structured_outputs.structural_tag must be a JSON object, got {text!r}")
    if "structures" in tag:
        structures, triggers = tag.get("structures"), tag.get("triggers")
        if (not isinstance(structures, list) or not structures
                or not all(isinstance(s, dict) and isinstance(s.get("begin"), str) and isinstance(s.get("end"), str)
                           and isinstance(s.get("schema"), dict) for s in structures)):
            raise ValueError('structured_outputs.structural_tag: "structures" must be a non-empty list of '
                             '{"begin": str, "schema": {...}, "end": str}')
        if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
            raise ValueError('structured_outputs.structural_tag: "triggers" must be a non-empty list of strings')
    elif not isinstance(tag.get("format"), dict):
        raise ValueError('structured_outputs.structural_tag must have "format" (xgrammar\'s structural tag) '
                         'or "structures" and "triggers" (the older shape)')
    return tag

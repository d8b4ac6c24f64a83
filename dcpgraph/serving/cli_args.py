"""``dcpgraph serve``'s flags, generated from :class:`~dcpgraph.config.DcpgraphConfig`'s fields:
one flag per field (its spelling, type, choices, default and help from the field's metadata), so
every flag is a field and :meth:`DcpgraphConfig.from_cli_args` reads them all back."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from typing import Any

from ..config import SECTIONS


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """One flag per config field (but the ``cli=False`` ones), generated from the field: spellings
    from ``flags`` (default ``--field-name``), ``type`` from the annotation (or ``parse``), choices,
    default (or the ``env`` variable's value), help; booleans as ``BooleanOptionalAction``."""
    for section, cls in SECTIONS.items():
        group = parser.add_argument_group(section, (cls.__doc__ or "").split("\n")[0] or None)
        for f in dataclasses.fields(cls):
            if not f.metadata["cli"]:
                continue
            meta = f.metadata
            flags = meta["flags"] or (f"--{f.name.replace('_', '-')}",)
            default = _env_default(meta["env"], f.default)
            kwargs: dict[str, Any] = {"default": default, "help": meta["help"]}
            if flags[0].startswith("-"):
                kwargs["dest"] = f.name
            if f.type in ("bool", "bool | None"):
                kwargs["action"] = argparse.BooleanOptionalAction
            else:
                kwargs["type"] = _cli_type(f)
                choices = meta["choices"]
                if choices is not None:
                    kwargs["choices"] = [c for c in (choices() if callable(choices) else choices) if c is not None]
            if not flags[0].startswith("-"):  # positional
                kwargs.pop("default")
            group.add_argument(*flags, **kwargs)
    return parser


def _env_default(env: str | tuple[str, ...] | None, default: Any) -> Any:
    """The first of the ``env`` variables that is set and not empty, else ``default``."""
    for name in (env,) if isinstance(env, str) else env or ():
        if os.environ.get(name):
            return os.environ[name]
    return default


def _cli_type(field: dataclasses.Field):
    parse = field.metadata["parse"]
    if parse == "json":
        return _json_object
    if parse is not None:
        return parse
    base = field.type.split(" | ")[0]
    return {"int": int, "float": float, "str": str}[base]


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"not valid JSON ({err}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value

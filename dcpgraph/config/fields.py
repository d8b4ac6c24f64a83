"""The field machinery of :mod:`dcpgraph.config`: :func:`setting` declares a field with what the
CLI generator and the compile mapping need in its metadata (``help``, ``flags``, ``option``,
``low``, ``choices``, ``cli``, ``env``, ``parse``), :func:`option_name` is the name
:func:`dcpgraph.compile` takes a field by, and :class:`Section` checks every int and bool field of
a section by its annotation before the section's own rules."""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any

from ..errors import ConfigError

_SAME = object()  # metadata default: the compile option is spelled as the field


def setting(default: Any = None, help: str = "", *, flags: tuple[str, ...] | None = None,  # noqa: A002
            option: Any = _SAME, low: int | None = None, choices: Any = None, cli: bool = True,
            env: str | None = None, parse: Any = None) -> Any:
    """A config field: its default and what :func:`add_cli_args` and the compile mapping need.
    ``choices`` may be a callable (evaluated when the parser is built); ``parse`` overrides the
    argparse ``type`` the annotation gives; ``env`` names an environment variable that supplies
    the CLI default (a tuple: the first one set, e.g. dcpgraph's then vLLM's name)."""
    metadata = {"help": help, "flags": flags, "option": option, "low": low, "choices": choices, "cli": cli,
                "env": env, "parse": parse}
    return dataclasses.field(default=default, metadata=metadata)


def is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def option_name(field: dataclasses.Field) -> str | None:
    """The name :func:`dcpgraph.compile` takes ``field`` by, None when it takes no such option."""
    option = field.metadata["option"]
    return field.name if option is _SAME else option


class Section:
    """Checks every int and bool field by its annotation (``int`` with ``low``, ``int | None``,
    ``bool``), normalising ints to ``int``; then the section's own :meth:`_validate`."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value, name = getattr(self, f.name), option_name(f) or f.name
            low = f.metadata["low"]
            if f.type == "int" and low is not None:
                if not is_int(value) or value < low:
                    raise ConfigError(f"{name} must be an int >= {low}, got {value!r}")
                object.__setattr__(self, f.name, int(value))
            elif f.type == "int | None" and low is not None:
                if value is not None and (not is_int(value) or value < low):
                    raise ConfigError(f"{name} must be None or an int >= {low}, got {value!r}")
                object.__setattr__(self, f.name, None if value is None else int(value))
            elif f.type == "bool" and not isinstance(value, bool):
                raise ConfigError(f"{name} must be True or False, got {value!r}")
        self._validate()

    def _validate(self) -> None:
        pass

"""The configuration, one tree of frozen dataclasses, validated once before any work.

:class:`DcpgraphConfig` holds a section per concern: :class:`ModelConfig`, :class:`ParallelConfig`,
:class:`CacheConfig`, :class:`SchedulerConfig`, :class:`CompilationConfig`,
:class:`SpeculativeOptions` and :class:`ServingConfig`. :func:`dcpgraph.compile` builds it from its
keyword options (:meth:`DcpgraphConfig.from_compile_options`), :class:`~dcpgraph.LLM` from its
vLLM-named arguments (:meth:`DcpgraphConfig.from_llm_kwargs`) and ``dcpgraph serve`` from its flags
(:meth:`DcpgraphConfig.from_cli_args`); each section checks itself in ``__post_init__``, so a
config that exists is a valid one.

Each field is vLLM's name where vLLM has one and carries, in ``dataclasses.field(metadata=...)``:
``help``; ``flags`` (its CLI spellings, default ``--field-name``; ``cli=False`` for the two fields
a command line cannot express); ``option``, the name :func:`dcpgraph.compile` takes it by (None:
not a compile option), which is also the name its error messages use; ``low``, the smallest
value of an int; ``choices``. :func:`dcpgraph.serving.cli_args.add_cli_args` generates ``dcpgraph serve``'s flags from these
fields (booleans as ``argparse.BooleanOptionalAction``: ``--enable-prefix-caching`` /
``--no-enable-prefix-caching``), so a flag without a field cannot exist.

Errors: :class:`~dcpgraph.errors.ConfigError` for a value of the wrong type or out of range, or
two cache sizes at once; ``TypeError`` for an option name ``compile`` does not take. Every
message names the valid settings. Rules that depend on the model (head counts,
``block_size % interleave``) are :meth:`dcpgraph.mesh.Mesh.validate`'s.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import warnings
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError
from .fields import Section, is_int, option_name, setting
from .sections import (
    CACHE_SIZE_OPTIONS,
    COMMS,
    COMPILE_DEFAULTS,
    DISTRIBUTED_EXECUTOR_BACKENDS,
    EXECUTORS,
    IMPLEMENTED_REASONING_PARSERS,
    IMPLEMENTED_TOOL_CALL_PARSERS,
    KV_ALLOCATIONS,
    LOAD_FORMATS,
    LOG_LEVELS,
    REASONING_PARSERS,
    SECTIONS,
    TOOL_CALL_PARSERS,
    CacheConfig,
    CompilationConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    ServingConfig,
    SpeculativeOptions,
)

__all__ = [
    "CACHE_SIZE_OPTIONS", "COMMS", "COMPILE_DEFAULTS", "DEPRECATED_OPTIONS", "DISTRIBUTED_EXECUTOR_BACKENDS", "EXECUTORS",
    "IMPLEMENTED_REASONING_PARSERS", "IMPLEMENTED_TOOL_CALL_PARSERS", "KV_ALLOCATIONS", "LOAD_FORMATS", "LOG_LEVELS",
    "REASONING_PARSERS", "SECTIONS", "TOOL_CALL_PARSERS", "VALID_OPTIONS", "CacheConfig", "CompilationConfig",
    "DcpgraphConfig", "ModelConfig", "ParallelConfig", "SchedulerConfig", "Section", "ServingConfig",
    "SpeculativeOptions", "compile_option_fields", "config_fields", "option_name", "setting",
]

DEPRECATED_OPTIONS = {"max_batched_tokens": "max_num_batched_tokens", "speculative_tokens": "speculative_config"}


def config_fields() -> dict[str, tuple[str, dataclasses.Field]]:
    """Every field of the tree by name (names are unique across sections): ``(section, field)``."""
    return {f.name: (section, f) for section, cls in SECTIONS.items() for f in dataclasses.fields(cls)}


def compile_option_fields() -> dict[str, tuple[str, dataclasses.Field]]:
    """Compile option name -> ``(section, field)``."""
    return {option_name(f): (s, f) for s, f in config_fields().values() if option_name(f) is not None}


# every option compile takes besides tp, dcp and pcp (its explicit mesh arguments)
VALID_OPTIONS = tuple(sorted(set(compile_option_fields()) - {"tp", "dcp", "pcp"}))


@dataclass(frozen=True)
class DcpgraphConfig:
    """The whole configuration; built (and so validated) once, before any work."""

    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    cache: CacheConfig = dataclasses.field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = dataclasses.field(default_factory=SchedulerConfig)
    compilation: CompilationConfig = dataclasses.field(default_factory=CompilationConfig)
    speculative: SpeculativeOptions = dataclasses.field(default_factory=SpeculativeOptions)
    serving: ServingConfig = dataclasses.field(default_factory=ServingConfig)

    @classmethod
    def from_fields(cls, **values: Any) -> DcpgraphConfig:
        """From field names (any section); the rest default."""
        fields = config_fields()
        unknown = sorted(set(values) - set(fields))
        if unknown:
            raise TypeError(f"unknown config fields: {unknown}; the config has {sorted(fields)}")
        by_section: dict[str, dict[str, Any]] = {section: {} for section in SECTIONS}
        for name, value in values.items():
            by_section[fields[name][0]][name] = value
        return cls(**{section: SECTIONS[section](**kw) for section, kw in by_section.items()})

    @classmethod
    def from_compile_options(cls, *, tp: int = 1, dcp: int = 1, pcp: int = 1, **given: Any) -> DcpgraphConfig:
        """From :func:`dcpgraph.compile`'s keywords (the deprecated spellings warn); the options of
        :data:`COMPILE_DEFAULTS` not given (or, for the two budgets, None) take compile's defaults.
        ``enable_prefix_caching=None`` given explicitly means vLLM's default: on where supported."""
        given = _renamed(given)
        for name, value in COMPILE_DEFAULTS.items():
            if given.get(name) is None and (name in ("max_num_seqs", "max_num_batched_tokens") or name not in given):
                given[name] = value
        unknown = sorted(set(given) - set(VALID_OPTIONS))
        if unknown:
            raise TypeError(f"unknown options: {unknown}; compile takes {list(VALID_OPTIONS)}")
        options = compile_option_fields()
        return cls.from_fields(tensor_parallel_size=tp, decode_context_parallel_size=dcp,
                               prefill_context_parallel_size=pcp,
                               **{options[name][1].name: value for name, value in given.items()})

    @classmethod
    def from_llm_kwargs(cls, **kwargs: Any) -> DcpgraphConfig:
        """From :class:`~dcpgraph.LLM`'s arguments: its own (vLLM's names, which are the fields')
        and the compile options it passes on (compile's names)."""
        fields = config_fields()
        kwargs = _renamed(kwargs)
        own = {k: v for k, v in kwargs.items() if k in fields}
        given = {k: v for k, v in kwargs.items() if k not in fields}
        unknown = sorted(set(given) - set(VALID_OPTIONS))
        if unknown:
            raise TypeError(f"unknown options: {unknown}; compile takes {list(VALID_OPTIONS)}")
        options = compile_option_fields()
        return cls.from_fields(**own, **{options[name][1].name: value for name, value in given.items()})

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> DcpgraphConfig:
        """From the flags :func:`dcpgraph.serving.cli_args.add_cli_args` made."""
        return cls.from_fields(**{name: getattr(args, name) for name, (_, f) in config_fields().items()
                                  if f.metadata["cli"]})

    def replace(self, **values: Any) -> DcpgraphConfig:
        """A copy with some fields (by field name) changed, validated again."""
        return type(self).from_fields(**{**self.values(), **values})

    def values(self) -> dict[str, Any]:
        """Field name -> value, over every section (``speculative_config`` as given)."""
        return {name: getattr(getattr(self, section), name) for name, (section, _) in config_fields().items()}

    def compile_options(self) -> dict[str, Any]:
        """Every option of :func:`dcpgraph.compile` but tp, dcp and pcp, by compile's names, resolved:
        the effective backend, ``fuse_new_tokens`` decided, the checked speculative config."""
        out = {name: getattr(getattr(self, section), f.name)
               for name, (section, f) in compile_option_fields().items() if name in VALID_OPTIONS}
        out["backend"] = self.compilation.effective_backend
        out["fuse_new_tokens"] = self.compilation.effective_fuse_new_tokens
        out["speculative_config"] = self.speculative.checked
        return out

    def changed_compile_options(self) -> dict[str, Any]:
        """The compile options (compile's names, values as given) that differ from their defaults;
        the backend as it runs (``"eager"`` under ``enforce_eager``)."""
        defaults = DcpgraphConfig().values()
        values = self.values()
        out = {option_name(f): values[name] for name, (_, f) in config_fields().items()
               if option_name(f) in VALID_OPTIONS and values[name] != defaults[name]}
        if self.compilation.enforce_eager:
            out["backend"] = "eager"
        return out


def _renamed(given: dict[str, Any]) -> dict[str, Any]:
    """``given`` with the older spellings replaced by the options they stand for, each with a
    ``DeprecationWarning``; both spellings of one option at once are refused."""
    given = dict(given)
    if "max_batched_tokens" in given:
        _deprecated("max_batched_tokens is deprecated: use max_num_batched_tokens (vLLM's name), the same budget")
        if "max_num_batched_tokens" in given:
            raise ConfigError("give max_num_batched_tokens or its deprecated spelling max_batched_tokens, not both")
        given["max_num_batched_tokens"] = given.pop("max_batched_tokens")
    if "speculative_tokens" in given:
        k = given.pop("speculative_tokens")
        _deprecated(f"speculative_tokens={k!r} is deprecated: use "
                    f"speculative_config={{\"method\": \"ngram\", \"num_speculative_tokens\": {k!r}}}")
        if not is_int(k) or k < 0:
            raise ConfigError(f"speculative_tokens must be an int >= 0, got {k!r}")
        if given.get("speculative_config") is not None:
            raise ConfigError("give speculative_config or the older speculative_tokens (which means "
                              "{'method': 'ngram', 'num_speculative_tokens': k}), not both")
        if k:
            given["speculative_config"] = {"method": "ngram", "num_speculative_tokens": int(k)}
    return given


def _deprecated(message: str) -> None:
    """A ``DeprecationWarning`` attributed to the first caller outside dcpgraph (the line that
    called ``dcpgraph.compile``, ``LLM``, ...), however deep inside the package it is raised."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # dcpgraph/
    frame, level = sys._getframe(0), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, DeprecationWarning, stacklevel=level)

"""Where a model tensor lies in a checkpoint whose names are not the model's.

transformers keeps, per model type, how a checkpoint's tensor names become the module's
(``transformers.conversion_mapping.get_checkpoint_conversion_mapping``): renamed pieces of a path
(Mixtral's ``.block_sparse_moe.`` is the module's ``.mlp.``) and per-expert tensors merged into
fused experts (``experts.{e}.w1`` and ``w3`` stacked over ``e`` and concatenated into
``experts.gate_up_proj``). :class:`CheckpointNames` reads the kinds of entry it can invert
exactly and answers, for a model tensor, the stored tensors it is built from, as a lazy source
(:mod:`.tensor_sources`: nothing is read until a rank reads its slice). Entries of other kinds
are not read; a tensor only they would provide stays missing and the loader names it.

Renamings written as regular expressions (DeepSeek-V4's ``\\.attn\\.`` → ``.self_attn.``, then
``\\.wkv\\.`` → ``.kv_proj.``, chained) are not inverted: every stored name is run forward through
all of them in order, as transformers renames a checkpoint key when it loads
(``core_model_loading.rename_source_key``), and a model tensor is found under the stored name
that renames to it (:func:`forward_names`).

Without a mapping for the model type, fused experts are looked for under the per-expert names
most checkpoints use (``experts.{e}.gate_proj`` / ``up_proj`` / ``down_proj``).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

from .tensor_sources import Concatenated, SafetensorsFiles, Stacked, Stored

DEFAULT_MERGES = (
    ("mlp.experts.gate_up_proj", ("mlp.experts.*.gate_proj.weight", "mlp.experts.*.up_proj.weight")),
    ("mlp.experts.down_proj", ("mlp.experts.*.down_proj.weight",)),
)


@dataclass(frozen=True)
class ExpertMerge:
    """Model tensor ``<prefix><target>`` = ``stack_e(cat_0(<prefix><source with * = e>, ...))``."""

    target: str
    sources: tuple[str, ...]


@dataclass(frozen=True)
class CheckpointNames:
    renamings: tuple[tuple[str, str], ...]  # (checkpoint piece, model piece), literal substrings
    merges: tuple[ExpertMerge, ...]
    patterns: tuple[tuple[str, str], ...] = ()  # (checkpoint regex, model text): every renaming, in order

    @classmethod
    def for_model_type(cls, model_type: str | None) -> CheckpointNames:
        renamings, merges, patterns = [], [], []
        for entry in _conversion_mapping(model_type):
            kind = type(entry).__name__
            sources, targets = list(entry.source_patterns), list(entry.target_patterns)
            if kind == "WeightRenaming" and len(sources) == len(targets) == 1 and _literal(sources[0] + targets[0]):
                renamings.append((sources[0], targets[0]))
            if kind == "WeightRenaming" and len(sources) == len(targets) == 1 and "\\" not in targets[0]:
                patterns.append((sources[0], targets[0]))
            elif kind == "WeightConverter" and len(targets) == 1 and _is_expert_merge(entry, len(sources)):
                merges.append(ExpertMerge(_unescaped(targets[0]), tuple(_unescaped(p) for p in sources)))
        if not merges:
            merges = [ExpertMerge(t, s) for t, s in DEFAULT_MERGES]
        return cls(tuple(renamings), tuple(merges), tuple(patterns))

    def checkpoint_names(self, name: str) -> list[str]:
        """``name`` and each single renaming of it back into the checkpoint's pieces."""
        return [name, *(name.replace(model, stored) for stored, model in self.renamings if model in name)]

    def source(self, name: str, shape: tuple[int, ...], files: SafetensorsFiles):
        """The stored tensors model tensor ``name`` (of ``shape``) is built from, or None."""
        for candidate in self.checkpoint_names(name)[1:]:
            if candidate in files:
                return Stored(files, candidate)
        renamed = forward_names(self.patterns, files).get(name) if self.patterns else None
        if renamed is not None:
            return Stored(files, renamed)
        return self.merged(name, shape, files, lambda n: self._stored(n, files))

    def merged(self, name: str, shape: tuple[int, ...], files: SafetensorsFiles, lookup):
        """The fused tensor ``name`` stacked from its per-expert stored tensors (``lookup``: a
        per-expert model-side name → its stored name, or None), or None when a merge does not
        apply or a part is missing."""
        for merge in self.merges:
            if not name.endswith(merge.target) or not shape:
                continue
            prefix = name[: len(name) - len(merge.target)]
            stored = [[lookup(prefix + s.replace("*", str(e))) for s in merge.sources] for e in range(shape[0])]
            if all(n is not None for names in stored for n in names):
                parts = [[Stored(files, n) for n in names] for names in stored]
                return Stacked(tuple(Concatenated(tuple(p), 0) if len(p) > 1 else p[0] for p in parts))
        return None

    def _stored(self, name: str, files: SafetensorsFiles) -> str | None:
        found = next((n for n in self.checkpoint_names(name) if n in files), None)
        if found is None and self.patterns:
            found = forward_names(self.patterns, files).get(name)
        return found


@functools.lru_cache(maxsize=8)
def _compiled(patterns: tuple[tuple[str, str], ...]) -> tuple:
    return tuple((re.compile(source), target) for source, target in patterns)


def renamed(patterns: tuple[tuple[str, str], ...], name: str) -> str:
    """``name`` run forward through ``patterns``: each ``(regex, text)`` in order replaces its
    first match (they chain), as transformers renames a stored name when it loads."""
    for regex, target in _compiled(patterns):
        name = regex.sub(lambda _m, t=target: t, name, count=1)
    return name


@functools.lru_cache(maxsize=4)
def forward_names(patterns: tuple[tuple[str, str], ...], files: SafetensorsFiles) -> dict[str, str]:
    """Model-side name → stored name, for every stored name that ``patterns`` rename: each
    ``(regex, text)`` in order replaces its first match (they chain). A model-side name two
    stored names rename to is left out (ambiguous)."""
    out: dict[str, str] = {}
    clashes = set()
    for stored in files.names():
        name = renamed(patterns, stored)
        if name == stored:
            continue
        if name in out:
            clashes.add(name)
        out[name] = stored
    return {k: v for k, v in out.items() if k not in clashes}


def _conversion_mapping(model_type: str | None) -> list:
    if not model_type:
        return []
    # An optional transformers API (5.x): where it is absent or answers otherwise for this model
    # type, the defaults below stand, and any tensor only a mapping would name is reported missing.
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    except ImportError:
        return []
    try:
        return list(get_checkpoint_conversion_mapping(model_type) or [])
    except (KeyError, ValueError, TypeError, AttributeError):
        return []


def _literal(text: str) -> bool:
    """Whether a pattern is a plain substring (dots aside, no regular-expression syntax)."""
    return not any(c in text for c in "^$*+?()[]{}|\\")


def _unescaped(pattern: str) -> str:
    """A pattern with its escaped dots (``\\.``) as plain dots."""
    return pattern.replace("\\.", ".")


def _is_expert_merge(entry, n_sources: int) -> bool:
    """``MergeModulelist(dim=0)``, then for several sources ``Concatenate(dim=1)``: the stack of
    per-expert tensors, each the concatenation of its sources along their first dim."""
    ops = [(type(op).__name__, getattr(op, "dim", None)) for op in (getattr(entry, "operations", None) or [])]
    want = [("MergeModulelist", 0)] + ([("Concatenate", 1)] if n_sources > 1 else [])
    patterns = list(entry.source_patterns)
    return ops == want and all(p.count("*") == 1 and _literal(_unescaped(p).replace("*", "")) for p in patterns)

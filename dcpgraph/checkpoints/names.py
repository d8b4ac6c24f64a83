"""Where a model tensor lies in a checkpoint whose names are not the model's.

transformers keeps, per model type, how a checkpoint's tensor names become the module's
(``transformers.conversion_mapping.get_checkpoint_conversion_mapping``): renamed pieces of a path
(Mixtral's ``.block_sparse_moe.`` is the module's ``.mlp.``) and per-expert tensors merged into
fused experts (``experts.{e}.w1`` and ``w3`` stacked over ``e`` and concatenated into
``experts.gate_up_proj``). :class:`CheckpointNames` reads the kinds of entry it can invert
exactly and answers, for a model tensor, the stored tensors it is built from, as a lazy source
(:mod:`.tensor_sources`: nothing is read until a rank reads its slice). Entries of other kinds
are not read; a tensor only they would provide stays missing and the loader names it.

Without a mapping for the model type, fused experts are looked for under the per-expert names
most checkpoints use (``experts.{e}.gate_proj`` / ``up_proj`` / ``down_proj``).
"""

from __future__ import annotations

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

    @classmethod
    def for_model_type(cls, model_type: str | None) -> CheckpointNames:
        renamings, merges = [], []
        for entry in _conversion_mapping(model_type):
            kind = type(entry).__name__
            sources, targets = list(entry.source_patterns), list(entry.target_patterns)
            if kind == "WeightRenaming" and len(sources) == len(targets) == 1 and _literal(sources[0] + targets[0]):
                renamings.append((sources[0], targets[0]))
            elif kind == "WeightConverter" and len(targets) == 1 and _is_expert_merge(entry, len(sources)):
                merges.append(ExpertMerge(targets[0], tuple(sources)))
        if not merges:
            merges = [ExpertMerge(t, s) for t, s in DEFAULT_MERGES]
        return cls(tuple(renamings), tuple(merges))

    def checkpoint_names(self, name: str) -> list[str]:
        """``name`` and each single renaming of it back into the checkpoint's pieces."""
        return [name, *(name.replace(model, stored) for stored, model in self.renamings if model in name)]

    def source(self, name: str, shape: tuple[int, ...], files: SafetensorsFiles):
        """The stored tensors model tensor ``name`` (of ``shape``) is built from, or None."""
        for candidate in self.checkpoint_names(name)[1:]:
            if candidate in files:
                return Stored(files, candidate)
        for merge in self.merges:
            if not name.endswith(merge.target) or not shape:
                continue
            prefix = name[: len(name) - len(merge.target)]
            stored = [[self._stored(prefix + s.replace("*", str(e)), files) for s in merge.sources]
                      for e in range(shape[0])]
            if all(n is not None for names in stored for n in names):
                parts = [[Stored(files, n) for n in names] for names in stored]
                return Stacked(tuple(Concatenated(tuple(p), 0) if len(p) > 1 else p[0] for p in parts))
        return None

    def _stored(self, name: str, files: SafetensorsFiles) -> str | None:
        return next((n for n in self.checkpoint_names(name) if n in files), None)


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


def _is_expert_merge(entry, n_sources: int) -> bool:
    """``MergeModulelist(dim=0)``, then for several sources ``Concatenate(dim=1)``: the stack of
    per-expert tensors, each the concatenation of its sources along their first dim."""
    ops = [(type(op).__name__, getattr(op, "dim", None)) for op in (getattr(entry, "operations", None) or [])]
    want = [("MergeModulelist", 0)] + ([("Concatenate", 1)] if n_sources > 1 else [])
    patterns = list(entry.source_patterns)
    return ops == want and all(p.count("*") == 1 and _literal(p.replace("*", "")) for p in patterns)

"""Lowering of dcpgraph's ops for torchair's GE mode: a table of rules, each a traced torch function.

:func:`lower_npu` (the pass, :mod:`.lower`) · :mod:`.rules` (the table, checkers) ·
:mod:`.trace` (a function traced in place of a node) · :mod:`.ascend` (Ascend ops, GE gaps) ·
the rules with their op contracts: :mod:`.rules_attention` (FusedInferAttentionScore),
:mod:`.rules_merge` (AttentionUpdate / aten merge), :mod:`.rules_cache` (KV write → scatter),
:mod:`.rules_sparse` (DSA: LightningIndexer, SparseFlashAttention, an aten top-k merge),
:mod:`.rules_compressed` (DeepSeek-V4: the sink merge → aten; why the other V4 ops have no rule);
:mod:`.decide` (whether a graph can go to GE at all: the ops with no rule, decided from the table).

Checked on CPU by ``tests/torchair_tier``: conversion of DCP decode programs (GQA and MLA, a2a and
ag_rs) to GE with every node converted, which GE ops come out, and that the lowered graph run with
CPU reference kernels of FIAS/AttentionUpdate (written from their documentation) reproduces
eager's logits and caches, including requests with no local keys, slot −1 writes and all-empty
merges. Not checked: the Ascend kernels themselves (numerics, limits, performance).
"""

from .lower import MERGE_MODES, lower_npu
from .rules import TABLE, NpuLoweringError

__all__ = ["MERGE_MODES", "TABLE", "NpuLoweringError", "lower_npu"]

"""The TP-plan vocabulary: every style transformers' ``base_model_tp_plan`` / ``base_model_ep_plan``
use, with what it means for a forward-only graph whose activations are replicated over TP.

A plan entry names either a module (``layers.*.mlp.down_proj``) or a parameter
(``layers.*.mlp.experts.gate_up_proj``). Weight layouts: a linear's weight is ``[out, in]``; a
grouped-expert weight is ``[E, out, in]`` (HF's fused experts), so "output features" is dim ``-2``
and "input features" dim ``-1`` for both.

======================================  ============================================================
style                                   effect on rank ``r`` of ``tp``
======================================  ============================================================
``colwise``                             output features split (dim -2; a bias or 1-D parameter such
                                        as attention sinks: dim -1); the output stays sharded
``unit_colwise``                        colwise on a query/key/value projection, split by whole heads;
                                        with fewer KV heads than ranks each head is replicated
                                        (``tp // n_kv`` ranks a head), as for ``colwise``
``colwise_rep``,                        colwise, then all-gather of the output's last dim
``colwise_gather_output``
``rowwise``                             input features split (dim -1); on a linear an all-reduce
                                        follows and a bias is added once after it; on a grouped-
                                        expert parameter the owning ``moe_tp_experts`` module reduces
``unit_rowwise``                        rowwise on an attention output projection (by whole heads)
``rowwise_split_input``, ``rowwise_rep``  rowwise whose input arrives replicated: the rank's slice of
                                        the input's last dim is taken first
``packed_colwise`` / ``packed_rowwise``   like colwise / rowwise on a fused ``[gate; up]`` dim: each
                                        of the two halves is split, rank ``r`` keeps
                                        ``[gate_r; up_r]``, so the model's own ``chunk(2)`` still
                                        pairs gate and up
``qkv_colwise`` (dcpgraph's own)      a fused ``[q; k; v]`` projection: each section split by
                                        head (:class:`QKVShardRule`), the model's slices of its
                                        output re-pointed at the local sections
``norm_colwise`` (dcpgraph's own)     a 1-D RMSNorm weight over a head-sharded width: split as
                                        that width, the mean of squares averaged over the group
``embedding_rowwise`` (vocab parallel)  embedding rows split, out-of-range ids look up zeros,
                                        all-reduce
``embedding_colwise``                   embedding columns split, all-gather of the last dim
``moe_tp_experts``, ``all_reduce``,     all-reduce of the module's output (its parameters carry
``ep_dispatch_experts``                 their own styles and leave partial sums)
``grouped_gemm``                        expert parallelism: experts (dim 0) partitioned over ranks;
                                        see :func:`dcpgraph.passes.shard_tp` for the dispatch
``replicate``, ``replicated``,          replicated. ``sequence_parallel`` shards activations along
``replicated_with_grad_allreduce``,     the sequence for training memory; on replicated
``sequence_parallel``, ``mla_kv_a_proj``, activations its forward values are the replicated ones.
``local_params``                        ``local_params`` only says its module runs on the local
                                        shards its parameters' own entries produce.
======================================  ============================================================

Refused by name: ``moe_identity_expert`` (LongCat-Flash's zero-compute experts: HF pre-divides the
identity's input by ``tp`` because its output is summed over ranks; an ``nn.Identity`` leaves no
node in the traced graph to divide).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from ..errors import ConfigError
from ..program import ShardRule

COLWISE = frozenset({"colwise", "unit_colwise", "colwise_rep", "colwise_gather_output", "packed_colwise",
                     "qkv_colwise"})
GATHER_OUTPUT = frozenset({"colwise_rep", "colwise_gather_output"})
ROWWISE = frozenset({"rowwise", "unit_rowwise", "rowwise_split_input", "rowwise_rep", "packed_rowwise"})
SPLIT_INPUT = frozenset({"rowwise_split_input", "rowwise_rep"})
PACKED = frozenset({"packed_colwise", "packed_rowwise"})
EMBEDDING = frozenset({"embedding_rowwise", "vocab_parallel", "embedding_colwise"})
MODULE_REDUCE = frozenset({"moe_tp_experts", "all_reduce", "ep_dispatch_experts"})
EXPERT_PARALLEL = frozenset({"grouped_gemm"})
REPLICATED = frozenset({
    "replicate", "replicated", "replicated_with_grad_allreduce", "sequence_parallel", "mla_kv_a_proj",
    "local_params",
})
REFUSED = {
    "moe_identity_expert": "zero-compute identity experts (LongCat-Flash) leave no traced node to pre-divide",
}
QKV = frozenset({"qkv_colwise"})
NORM = frozenset({"norm_colwise"})
ALL_STYLES = COLWISE | ROWWISE | EMBEDDING | MODULE_REDUCE | EXPERT_PARALLEL | REPLICATED | NORM | set(REFUSED)


@dataclass(frozen=True)
class PackedShardRule(ShardRule):
    """Split ``dim`` into ``packed`` equal halves (``[gate; up]``), shard each half into ``tp``
    chunks and keep rank ``r``'s chunk of every half, in order: ``[gate_r; up_r]``."""

    packed: int = 2

    def local(self, full: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
        if self.dim is None or tp == 1:
            return full
        if full.shape[self.dim] % (self.packed * tp):
            raise ValueError(f"cannot split dim {self.dim} of {tuple(full.shape)} into {self.packed}x{tp}")
        halves = full.chunk(self.packed, self.dim)
        return torch.cat([h.chunk(tp, self.dim)[rank] for h in halves], self.dim).contiguous()


def _rows_kept(rule, full: torch.Tensor, rank: int, tp: int, rows: int, layout: str) -> torch.Tensor:
    """Rank ``rank``'s rows of ``full`` along ``rule.dim``: ``rule.row_ranges(rank, tp)``
    concatenated in order; ``full`` itself when unsplit; ``rows`` and ``layout`` say what ``dim``
    must hold."""
    if rule.dim is None or tp == 1:
        return full
    if full.shape[rule.dim] != rows:
        raise ValueError(f"dim {rule.dim} of {tuple(full.shape)} is not {layout}")
    return torch.cat([full.narrow(rule.dim, a, b - a) for a, b in rule.row_ranges(rank, tp)], rule.dim).contiguous()


@dataclass(frozen=True)
class QKVShardRule(ShardRule):
    """A fused ``[q; k; v]`` projection's rows (``q_rows = heads·head_dim``, ``kv_rows`` each for
    k and v): rank ``r`` keeps its ``1/tp`` of q, and its part of k and of v, which with fewer KV
    heads than ranks is part ``r // (tp // kv_heads)`` of ``kv_heads`` (KV heads replicated):
    ``[q_r; k_r; v_r]``."""

    q_rows: int = 0
    kv_rows: int = 0
    kv_heads: int = 1

    def kv_parts(self, tp: int) -> int:
        return min(tp, self.kv_heads)

    def row_ranges(self, rank: int, tp: int) -> list[tuple[int, int]]:
        """The ``[start, stop)`` rows of the full tensor that rank ``rank`` keeps, in order."""
        if self.q_rows % tp or self.kv_rows % self.kv_parts(tp) or tp % self.kv_parts(tp):
            raise ValueError(f"cannot split q rows {self.q_rows} / k, v rows {self.kv_rows} over tp={tp}")
        q_chunk, kv_chunk = self.q_rows // tp, self.kv_rows // self.kv_parts(tp)
        kv_index = rank // (tp // self.kv_parts(tp))
        k_start, v_start = self.q_rows, self.q_rows + self.kv_rows
        return [(rank * q_chunk, (rank + 1) * q_chunk),
                (k_start + kv_index * kv_chunk, k_start + (kv_index + 1) * kv_chunk),
                (v_start + kv_index * kv_chunk, v_start + (kv_index + 1) * kv_chunk)]

    def local(self, full: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
        return _rows_kept(self, full, rank, tp, self.q_rows + 2 * self.kv_rows,
                          f"q {self.q_rows} + 2 x kv {self.kv_rows}")

    def local_shape(self, shape: tuple[int, ...], tp: int) -> tuple[int, ...]:
        if self.dim is None or tp == 1:
            return tuple(shape)
        out = list(shape)
        out[self.dim] = self.q_rows // tp + 2 * (self.kv_rows // self.kv_parts(tp))
        return tuple(out)


@dataclass(frozen=True)
class SectionShardRule(ShardRule):
    """A tensor whose ``dim`` concatenates ``sections`` of different sizes (a recurrent layer's
    ``[q | k | v]`` conv channels, LFM2's ``[B | C | x]``): every section is split into ``tp``
    equal chunks and rank ``r`` keeps its chunk of each, in order."""

    sections: tuple[int, ...] = ()

    def row_ranges(self, rank: int, tp: int) -> list[tuple[int, int]]:
        """The ``[start, stop)`` rows of the full tensor that rank ``rank`` keeps, in order."""
        if any(size % tp for size in self.sections):
            raise ValueError(f"cannot split sections {list(self.sections)} over tp={tp}")
        out, start = [], 0
        for size in self.sections:
            chunk = size // tp
            out.append((start + rank * chunk, start + (rank + 1) * chunk))
            start += size
        return out

    def local(self, full: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
        return _rows_kept(self, full, rank, tp, sum(self.sections), f"the sections {list(self.sections)}")

    def local_shape(self, shape: tuple[int, ...], tp: int) -> tuple[int, ...]:
        if self.dim is None or tp == 1:
            return tuple(shape)
        out = list(shape)
        out[self.dim] = sum(size // tp for size in self.sections)
        return tuple(out)


def param_rule(style: str, ndim: int, is_bias: bool) -> ShardRule:
    """The shard of a parameter under a linear / grouped-expert style (see the module table)."""
    if style in COLWISE:
        dim = -1 if (is_bias or ndim == 1) else -2
    elif style in ROWWISE:
        if is_bias or ndim == 1:
            return ShardRule(None)
        dim = -1
    elif style in EXPERT_PARALLEL:
        return ShardRule(0)
    else:
        return ShardRule(None)
    return PackedShardRule(dim) if style in PACKED else ShardRule(dim)


def with_expert_parallel(program):
    """``program`` whose TP plan has the model's expert-parallel entries (HF's
    ``base_model_ep_plan``: ``grouped_gemm`` experts, ``ep_dispatch_experts`` module) in place of
    its tensor-parallel expert entries; refused for a model without one."""
    from dataclasses import replace


    ep_plan = program.facts.extra.get("ep_plan") or {}
    if not ep_plan:
        raise ConfigError(
            f"enable_expert_parallel=True: {program.facts.architecture} has no expert-parallel plan "
            "(no routed experts); use enable_expert_parallel=False"
        )
    plan = {**program.facts.tp_plan, **ep_plan}
    return program.replace(facts=replace(program.facts, tp_plan=plan))


def plan_rule(plan: dict[str, str], module_path: str) -> str | None:
    """The rule of the first plan pattern matching ``module_path`` (``*`` matches one path
    component), or None."""
    for pattern, rule in plan.items():
        regex = "^" + re.escape(pattern).replace(r"\*", r"[^.]+") + "$"
        if re.match(regex, module_path):
            return rule
    return None

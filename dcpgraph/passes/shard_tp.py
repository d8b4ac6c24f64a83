"""``shard_tp``: tensor parallelism from a plan that is data (torchtitan / HF ``tp_plan`` style).

The plan maps module- or parameter-path patterns (``*`` = one path component) to styles; the
vocabulary (every style transformers' plans use) is :mod:`dcpgraph.passes.tp_styles`. Linears
and embeddings are rewritten here; parameter entries (grouped experts, sinks), module-output
reductions and expert parallelism in :mod:`dcpgraph.passes.tp_modules`. For K/V projections with
``tp > n_kv`` a colwise split takes ``n_kv`` parts and rank ``r`` takes part ``r // (tp // n_kv)``
(KV heads replicated).

A vocabulary ``tp`` does not divide (GPT-2's 50257) is padded, as vLLM pads its vocab-parallel
layers: the embedding's and the gathered LM head's rows are extended with zeros to a multiple of
``64·tp`` (:func:`padded_size`, ``ShardRule.padded``). Token ids never reach the padded embedding
rows, and the gathered output is sliced back to the true width right after the all-gather, so
the padded logits are never sampled, returned or penalised.

Shards are computed functionally from the full parameters at run time (``Program.local_state``):
the user's model is never modified. Reshapes in traced HF models use ``-1`` for head counts, so
local head counts follow from the local weights; the verifier's shape propagation checks that.
"""

from __future__ import annotations

import dataclasses
from collections import deque

import torch
import torch.fx

from ..errors import UnsupportedModelError, VerificationError
from ..mesh import Mesh, local_kv_heads
from ..program import (
    PARAM,
    RANK,
    REPLICATE,
    InputSpec,
    Program,
    ShardRule,
    example_specs,
)
from . import collectives as coll
from .graph_edit import Emitter, add_placeholders, nodes_calling
from .manager import program_pass, ran
from .respecialize import respecialize_shapes
from .shard_recurrent_tp import recurrent_parameter_targets
from .tp_modules import merge_summed_reductions, reduce_module_outputs, shard_parameters
from .tp_norms import shard_norms
from .tp_styles import (
    ALL_STYLES,
    COLWISE,
    GATHER_OUTPUT,
    PACKED,
    QKV,
    REFUSED,
    REPLICATED,
    ROWWISE,
    SPLIT_INPUT,
    PackedShardRule,
    QKVShardRule,
    plan_rule,
)

aten = torch.ops.aten
dcp_ops = torch.ops.dcpgraph


def _require_head_sharded_kv(kv_linears, plan: dict[str, str], specs) -> None:
    """The KV cache layout gives each TP rank its own KV heads: the K/V projections must leave
    their output column-sharded (a gathered or replicated projection runs attention replicated)."""
    for linear in kv_linears:
        path = specs[linear.args[1].name].target.removesuffix(".weight")
        style = plan_rule(plan, path)
        if style not in COLWISE or style in GATHER_OUTPUT:
            raise UnsupportedModelError(
                f"TP plan leaves the K/V projection {path} {style or 'unplanned'}: attention would run "
                "replicated on every rank, but the KV cache layout needs head-sharded K/V "
                "(a colwise / packed_colwise style); use tp=1"
            )


def _refuse_styles(plan: dict[str, str]) -> None:
    for pattern, style in plan.items():
        if style in REFUSED:
            raise UnsupportedModelError(f"TP plan style {style!r} ({pattern}) is not supported: {REFUSED[style]}")
        if style not in ALL_STYLES:
            raise UnsupportedModelError(
                f"TP plan style {style!r} ({pattern}) is unknown; known styles: {sorted(ALL_STYLES)}"
            )


def nearest_linears(start: torch.fx.Node) -> set[torch.fx.Node]:
    """Linear nodes reached walking backwards from ``start`` without passing through a linear."""
    found, seen, queue = set(), {start}, deque([start])
    while queue:
        node = queue.popleft()
        if node.op == "call_function" and node.target is aten.linear.default and node is not start:
            found.add(node)
            continue
        for arg in node.all_input_nodes:
            if arg not in seen:
                seen.add(arg)
                queue.append(arg)
    return found


def kv_projection_linears(graph: torch.fx.Graph, cache_heads: dict[str, int] | None = None) -> dict[torch.fx.Node, int]:
    """The linears that produce the K/V written to the caches, each with the (global) KV head
    count of the cache it feeds (``cache_heads``: cache placeholder name -> heads; 0 when not
    given): layers may differ in KV heads, so each projection is split by its own layer's. Raises
    :class:`UnsupportedModelError` for a cache whose K/V no linear produces (a ``Conv1D``
    projection, as GPT-2's ``addmm``): no plan style could head-shard it."""
    found: dict[torch.fx.Node, int] = {}
    writes = [*nodes_calling(graph, dcp_ops.kv_cache_write_.default),
              *nodes_calling(graph, dcp_ops.kv_cache_write_fp8_.default)]
    for write in writes:  # both take (cache, new, slot_mapping, ...)
        linears = nearest_linears(write.args[1])
        if not linears:
            raise UnsupportedModelError(
                f"the K/V written to {write.args[0].name} come from no linear layer (a Conv1D / addmm "
                "projection, as in GPT-2): TP cannot head-shard them for the KV cache layout; use tp=1"
            )
        heads = (cache_heads or {}).get(write.args[0].name, 0)
        found.update((linear, heads) for linear in linears)
    return found


VOCAB_PAD_MULTIPLE = 64
"""A dim ``tp`` does not divide is padded to a multiple of ``64·tp``: every rank's chunk is a
whole number of 64-row blocks, as vLLM pads its vocab-parallel embedding and LM head."""


def padded_size(size: int, tp: int) -> int | None:
    """The padded length of a vocab-parallel dim of ``size`` entries over ``tp`` ranks: None when
    ``tp`` divides it (split as it is), else the next multiple of ``VOCAB_PAD_MULTIPLE · tp``."""
    if size % tp == 0:
        return None
    step = VOCAB_PAD_MULTIPLE * tp
    return -(-size // step) * step


class _TPSharding:
    """One ``shard_tp`` run's state: the parameters' shard rules as they are assigned (each
    parameter gets one rule, which must divide it), style counts for the summary, and the
    ``tp_rank`` placeholder, added on first use."""

    def __init__(self, program: Program, graph: torch.fx.Graph, plan: dict[str, str], tp: int):
        self.program, self.graph, self.plan, self.tp = program, graph, plan, tp
        self.e = Emitter(graph)
        self.specs = {s.name: s for s in program.inputs}
        self.rules: dict[str, ShardRule] = {}
        self.counts: dict[str, int] = {}
        self.rank_node: list[torch.fx.Node] = []
        # Recurrent layers split by their own per-kind rules (shard_recurrent_tp), not the plan.
        self.recurrent = recurrent_parameter_targets(program)
        self.rules.update({s.name: REPLICATE for s in program.inputs if s.target in self.recurrent})

    def tp_rank(self) -> torch.fx.Node:
        if not self.rank_node:
            self.rank_node.extend(add_placeholders(self.graph, ["tp_rank"]))
        return self.rank_node[0]

    def count(self, style: str) -> None:
        self.counts[style] = self.counts.get(style, 0) + 1

    def assign(self, node: torch.fx.Node | None, rule: ShardRule, what: str) -> None:
        if node is None:
            return
        spec = self.specs.get(node.name)
        if spec is None or spec.kind != PARAM:
            raise UnsupportedModelError(f"{what}: expected a parameter, found {node.name}")
        if self.rules.get(node.name, rule) != rule:
            raise UnsupportedModelError(
                f"{spec.target} needs two different shardings ({self.rules[node.name]} vs {rule})")
        full = self.program.state[spec.target]
        if isinstance(rule, QKVShardRule):
            try:
                rule.local_shape(tuple(full.shape), self.tp)
                rule.row_ranges(0, self.tp)
            except ValueError as exc:
                raise UnsupportedModelError(f"{spec.target}: {exc}") from None
            self.rules[node.name] = rule
            return
        parts = (rule.parts or self.tp) * getattr(rule, "packed", 1)
        if rule.dim is not None and (rule.padded or full.shape[rule.dim]) % parts:
            raise UnsupportedModelError(f"{spec.target} {tuple(full.shape)} cannot be split in {parts} on dim {rule.dim}")
        self.rules[node.name] = rule

    def gather_last_dim(self, node: torch.fx.Node, size: int | None = None) -> None:
        """``node``'s users see its last dimension all-gathered over the TP group; with ``size``,
        only its first ``size`` entries (the gathered dimension was padded past them)."""
        e = self.e
        with self.graph.inserting_before(node.next):
            moved = e(aten.movedim.int, node, -1, 0)
            contiguous = e(aten.clone.default, moved, memory_format=torch.contiguous_format)
            gathered = coll.all_gather(self.graph, contiguous, self.tp, "tp")
            back = e(aten.movedim.int, gathered, 0, -1)
            if size is not None:
                back = e(aten.slice.Tensor, back, -1, 0, size)
        node.replace_all_uses_with(back)
        moved.args = (node, *moved.args[1:])

    def embedding(self, node: torch.fx.Node) -> None:
        """``embedding_colwise``: hidden dimension split and gathered. Otherwise vocab-parallel:
        with ``R = Vp/tp`` rows per rank (``Vp`` the vocabulary, or :func:`padded_size` where
        ``tp`` does not divide it) rank ``r`` holds rows ``[r·R, (r+1)·R)``, looks up ids in its
        range (others read row 0 and are zeroed), and the sum over ranks is the full lookup; ids
        are below ``V``, so no rank reads a padded row. A replicated style stays replicated."""
        weight, ids = node.args[:2]
        path = self.specs[weight.name].target.removesuffix(".weight")
        style = plan_rule(self.plan, path)
        if style == "embedding_colwise":
            self.assign(weight, ShardRule(1), path)
            self.gather_last_dim(node)
            self.count(style)
            return
        vocab = self.program.state[self.specs[weight.name].target].shape[0]
        if style in REPLICATED:
            return
        padded = padded_size(vocab, self.tp)
        self.assign(weight, ShardRule(0, padded=padded), "embedding")
        e, graph = self.e, self.graph
        with graph.inserting_before(node):
            rows = (padded or vocab) // self.tp
            local = e(aten.sub.Tensor, ids, e(aten.mul.Tensor, self.tp_rank(), rows))
            outside = e(aten.logical_or.default, e(aten.lt.Scalar, local, 0), e(aten.ge.Scalar, local, rows))
            safe = e(aten.masked_fill.Scalar, local, outside, 0)
        with graph.inserting_before(node.next):
            zeroed = e(aten.masked_fill.Scalar, node, e(aten.unsqueeze.default, outside, -1), 0.0)
            reduced = coll.all_reduce(graph, zeroed, "tp")
        node.replace_all_uses_with(reduced)
        zeroed.args = (node, *zeroed.args[1:])
        node.args = (weight, safe, *node.args[2:])
        self.count("vocab_parallel")

    def linear(self, node: torch.fx.Node, kv_linears: dict[torch.fx.Node, int]) -> None:
        """A planned linear: colwise splits the output features (a K/V projection with fewer KV
        heads than ranks in ``n_kv`` parts), rowwise the input features with an all-reduce after."""
        weight = node.args[1]
        bias = node.args[2] if len(node.args) > 2 else None
        spec = self.specs.get(weight.name)
        if spec is None or spec.kind != PARAM or spec.target in self.recurrent:
            return
        path = spec.target.removesuffix(".weight")
        rule = plan_rule(self.plan, path)
        if rule is None or rule in REPLICATED:
            return
        self.count(rule)
        if rule in QKV:
            self.fused_qkv(node, weight, bias, path)
        elif rule in COLWISE:
            n_kv = kv_linears.get(node) or self.program.facts.num_kv_heads
            parts = n_kv if (node in kv_linears and n_kv < self.tp) else None
            features = self.program.state[spec.target].shape[0]
            # Only a gathered output may be padded: the gather's slice drops the padding's columns.
            padded = padded_size(features, self.tp) if rule in GATHER_OUTPUT and parts is None else None
            shard = PackedShardRule(0) if rule in PACKED else ShardRule(0, parts, padded)
            self.assign(weight, shard, path)
            self.assign(bias, shard, path)
            if rule in GATHER_OUTPUT:
                self.gather_last_dim(node, features if padded else None)
        elif rule in ROWWISE:
            self.rowwise(node, rule, weight, bias, path)
        else:
            raise UnsupportedModelError(f"TP plan style {rule!r} for the linear {path} is not supported")

    def fused_qkv(self, node: torch.fx.Node, weight, bias, path: str) -> None:
        """``qkv_colwise``: the fused ``[q; k; v]`` rows split by :class:`QKVShardRule`, and every
        slice the model takes of the output's last dim (its q, k and v sections at global
        offsets) re-pointed at the same section of the local ``[q_r; k_r; v_r]``."""
        facts = self.program.facts
        if facts.layer_kv_heads or facts.layer_head_dims:
            raise UnsupportedModelError(
                f"{path}: a fused qkv projection in a model whose layers differ in KV heads or head dim "
                "is not supported at tp > 1 (its rows are split by one model-wide shape); use tp=1")
        rule = QKVShardRule(0, q_rows=facts.num_q_heads * facts.head_dim,
                            kv_rows=facts.num_kv_heads * facts.head_dim, kv_heads=facts.num_kv_heads)
        self.assign(weight, rule, path)
        self.assign(bias, rule, path)
        q_local = rule.q_rows // self.tp
        kv_local = rule.kv_rows // rule.kv_parts(self.tp)
        full = rule.q_rows + 2 * rule.kv_rows
        sections = {(0, rule.q_rows): (0, q_local),
                    (rule.q_rows, rule.q_rows + rule.kv_rows): (q_local, q_local + kv_local),
                    (rule.q_rows + rule.kv_rows, full): (q_local + kv_local, q_local + 2 * kv_local)}
        rank = node.meta["val"].dim() if "val" in node.meta else 3
        for user in list(node.users):
            ok = user.target is aten.slice.Tensor and user.args[0] is node and len(user.args) >= 3 \
                and user.args[1] in (-1, rank - 1)
            start = (user.args[2] if len(user.args) > 2 else 0) or 0
            end = min(user.args[3] if len(user.args) > 3 and user.args[3] is not None else full, full)
            if not ok or (start, end) not in sections:
                raise UnsupportedModelError(
                    f"{path}: a fused qkv projection's output must be used as its q, k and v sections "
                    f"(rows {sorted(sections)}), found {user.format_node()}; use tp=1")
            local_start, local_end = sections[(start, end)]
            user.args = (node, user.args[1], local_start, local_end, *user.args[4:])

    def rowwise(self, node: torch.fx.Node, rule: str, weight, bias, path: str) -> None:
        """``y = all_reduce(x_r @ W_r^T) + b``: the bias is added once, after the reduction."""
        e, graph = self.e, self.graph
        self.assign(weight, PackedShardRule(1) if rule in PACKED else ShardRule(1), path)
        if rule in SPLIT_INPUT:
            with graph.inserting_before(node):
                x = node.args[0]
                split = e(aten.unflatten.int, x, -1, [self.tp, -1])
                mine = e(aten.index_select.default, split, -2, e(aten.reshape.default, self.tp_rank(), [1]))
                local_x = e(aten.squeeze.dim, mine, -2)
            node.args = (local_x, *node.args[1:])
        if bias is not None:
            self.assign(bias, ShardRule(None), path)
            node.args = (node.args[0], weight)
        with graph.inserting_before(node.next):
            reduced = coll.all_reduce(graph, node, "tp")
            result = e(aten.add.Tensor, reduced, bias) if bias is not None else reduced
        node.replace_all_uses_with(result)
        reduced.args[0].args = (node, *reduced.args[0].args[1:])


@program_pass(
    "shard_tp",
    requires=[ran("insert_kv_cache", "K/V projections are found from the cache writes; cache heads become local")],
)
def shard_tp(program: Program, mesh: Mesh, plan: dict[str, str] | None = None):
    facts = program.facts
    if program.mesh.tp != 1:
        raise VerificationError("shard_tp applied twice")
    if mesh.tp == 1:
        return program.replace(mesh=mesh), "tp=1: nothing to shard"
    plan = dict(facts.tp_plan if plan is None else plan)
    _refuse_styles(plan)
    tp = mesh.tp
    gm = program.copy_graph()
    graph = gm.graph
    sharding = _TPSharding(program, graph, plan, tp)
    specs, rules = sharding.specs, sharding.rules
    kv_linears = kv_projection_linears(graph, {c.name: c.heads for c in program.caches})
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is aten.embedding.default and node.args[0].name in specs:
            sharding.embedding(node)
        elif node.target is aten.linear.default:
            sharding.linear(node, kv_linears)
    if facts.attention == "gqa":
        _require_head_sharded_kv(kv_linears, plan, specs)
    shard_norms(program, graph, plan, specs, rules, sharding.assign, sharding.count, tp, kv_linears, nearest_linears)
    reduced = reduce_module_outputs(graph, plan, sharding.count, tp)
    shard_parameters(program, graph, plan, specs, rules, sharding.assign, sharding.count, tp, sharding.tp_rank,
                     reduced)
    merged = merge_summed_reductions(graph)
    inputs = [
        InputSpec(s.name, s.kind, s.target, rules.get(s.name, s.shard)) for s in program.inputs
    ]
    if sharding.rank_node:
        inputs.append(InputSpec("tp_rank", RANK, "tp_rank"))
    caches = tuple(
        dataclasses.replace(c, heads=local_kv_heads(c.heads, tp) if facts.attention == "gqa" else c.heads)
        for c in program.caches
    )
    result = program.replace(graph_module=gm, inputs=tuple(inputs), mesh=mesh, caches=caches)
    fixed = respecialize_shapes(gm, example_specs(result))
    gm.recompile()
    summary = ", ".join(f"{v} {k}" for k, v in sorted(sharding.counts.items())) or "no planned layers"
    return result, (f"tp={tp}: {summary}; {merged} all-reduce pairs merged; "
                    f"{fixed} baked-in shape literals re-specialised")

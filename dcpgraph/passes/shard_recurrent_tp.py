"""``shard_recurrent_tp``: recurrent layers' heads/channels split over the TP group, per kind.

Runs after ``shard_tp`` (which leaves every recurrent layer's parameters alone, see
:func:`recurrent_parameter_targets`) and ``insert_recurrent_state`` (whose pools it resizes). Each
recurrent kind has one row in :data:`TP_RULES`: the parameter suffix that names the layer's
module (its conv weight), the layer's indivisible unit count, every parameter's
:class:`~dcpgraph.program.ShardRule` by suffix, the ``[q | k | v]`` section sizes the traced
graph splits by (rescaled to ``1/tp``), and its pools' local shapes. For a layer the TP group
splits (``tp`` divides its units), rank ``r`` holds its ``1/tp`` of the heads/channels, the
output projection becomes row-parallel (``y = all_reduce(x_r W_rᵀ) + b``, the bias added once
after the sum) and its state pools hold ``1/tp`` of the state. A layer ``tp`` does not divide is
replicated: full weights and state on every rank, complete output, no collective (as
:meth:`~dcpgraph.recurrent_state.GatedDeltaNetShape.on_rank` counts it).

The traced recurrent layers use ``-1`` for every head count (:mod:`dcpgraph.ops.gated_delta_layer`,
:mod:`dcpgraph.frontends.gated_delta_net`, :mod:`dcpgraph.frontends.short_conv`,
:mod:`dcpgraph.ops.mamba2_layer`), so the only
literals that depend on the split are the section sizes rescaled here; shape propagation after
the pass checks the result.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.fx

from ..errors import UnsupportedModelError, VerificationError
from ..ops import gated_delta as _gated_delta_ops  # noqa: F401  (registers the anchors' ops)
from ..ops import kimi_delta as _kimi_delta_ops  # noqa: F401  (registers dcpgraph.kimi_delta_rule_)
from ..ops import lightning_attention as _lightning_ops  # noqa: F401
from ..program import BUFFER, PARAM, REPLICATE, InputSpec, Program, RecurrentStateSpec, ShardRule
from ..recurrent_state import (
    GatedDeltaNetShape,
    KimiDeltaShape,
    LightningAttentionShape,
    Mamba2Shape,
    ShortConvShape,
)
from . import collectives as coll
from .graph_edit import Emitter, nodes_calling
from .manager import program_pass, ran
from .tp_styles import SectionShardRule

aten = torch.ops.aten
dcp_ops = torch.ops.dcpgraph
# the pool argument of causal_conv1d_ / gated_delta_rule_ and kimi_delta_rule_ / mamba2_scan_ / lightning_attention_
CONV_ARGS_POOL, RULE_ARGS_POOL, SCAN_ARGS_POOL, LIGHTNING_ARGS_POOL = 3, 5, 7, 4


@dataclass
class RecurrentLayer:
    """One traced recurrent layer: its decoder index, kind, module prefix (``model.layers.0.linear_attn.``),
    parameter specs by suffix, its stateful conv node (``None`` for a kind without one: lightning
    attention) and its state-space node (a gated delta net's delta rule, a Mamba-2 mixer's scan,
    a lightning attention; ``None`` for a short convolution)."""

    index: int
    kind: str
    prefix: str
    params: dict[str, InputSpec]
    conv: torch.fx.Node | None
    rule: torch.fx.Node | None


@dataclass(frozen=True)
class RecurrentTPRule:
    """How one recurrent kind splits over TP. ``conv_weight``: the parameter suffix that names the
    layer's module, read by argument ``anchor[2]`` of its stateful op ``anchor[0]`` (its canonical
    form ``anchor[1]``), whose pool is ``<anchor_pool>_<layer>``: the conv weight of a conv-carrying
    kind, lightning attention's ``slope_rate``. ``shape(layer, program)`` gives the layer's shape object
    (``units``: what ``tp`` must divide; ``on_rank(tp)``; pool shapes); ``param_rules(shape)``
    every parameter suffix's rule on a split layer (a suffix not listed is refused by name);
    ``sections(shape)`` the section sizes of the traced ``split_with_sizes`` of the conv output to
    rescale; ``weight_splits(shape)`` further section sizes by which the traced graph splits a
    layer parameter (Mamba-2's ``in_proj`` into ``[z | xBC | dt]``), rescaled alike; ``buffers``
    the buffer suffixes split with the parameters (Falcon-H1's ``mup_vector``; others stay whole);
    ``pools(local)`` pool role → per-slot shape on one rank; ``rewrite(graph, layer, tp)`` any
    further graph change a split needs (a norm over all heads averaging its mean over ranks)."""

    conv_weight: str
    shape: Callable[[RecurrentLayer, Program], object]
    units: Callable[[object], int]
    param_rules: Callable[[object], dict[str, ShardRule]]
    sections: Callable[[object], tuple[int, ...] | None]
    pools: Callable[[object], dict[str, tuple[int, ...]]]
    out_proj: tuple[str, ...] = ("out_proj",)
    weight_splits: Callable[[object], tuple[tuple[int, ...], ...]] = lambda s: ()
    buffers: tuple[str, ...] = ()
    anchor: tuple = (dcp_ops.causal_conv1d_.default, dcp_ops.causal_conv1d.default, 1)
    anchor_pool: str = "conv_state"
    rewrite: Callable[[torch.fx.Graph, RecurrentLayer, int], None] | None = None


def _gdn_shape(layer: RecurrentLayer, program: Program) -> GatedDeltaNetShape:
    k, v = layer.rule.args[1].meta["val"], layer.rule.args[2].meta["val"]
    kernel = int(program.state[layer.params["conv1d.weight"].target].shape[-1])
    return GatedDeltaNetShape(int(k.shape[1]), int(v.shape[1]), int(k.shape[2]), int(v.shape[2]), kernel)


def _gdn_sections(s: GatedDeltaNetShape) -> tuple[int, int, int]:
    return (s.key_heads * s.key_dim, s.key_heads * s.key_dim, s.value_heads * s.value_dim)


def _gdn_param_rules(s: GatedDeltaNetShape) -> dict[str, ShardRule]:
    """Rows by key-head group: the fused ``in_proj_qkvz``/``in_proj_ba`` are laid out per key
    head (a contiguous ``1/tp`` of rows is a group of whole heads); ``[q | k | v]`` tensors by
    section; OLMo-Hybrid's separate ``q/k/v/g/b/a_proj`` by rows (per head, ``o_norm``/``o_proj`` as
    ``norm``/``out_proj``); ``A_log``/``dt_bias`` per value head; the per-head norm weight replicated;
    ``out_proj`` by input columns."""
    qkv = SectionShardRule(0, sections=_gdn_sections(s))
    rows = ShardRule(0)
    olmo = {f"{name}.weight": rows for name in ("q_proj", "k_proj", "v_proj", "g_proj", "b_proj", "a_proj")}
    return {"in_proj_qkvz.weight": rows, "in_proj_ba.weight": rows, "in_proj_qkv.weight": qkv,
            "in_proj_z.weight": rows, "in_proj_b.weight": rows, "in_proj_a.weight": rows, **olmo,
            "conv1d.weight": qkv, "conv1d.bias": qkv, "A_log": rows, "dt_bias": rows,
            "norm.weight": REPLICATE, "o_norm.weight": REPLICATE, "out_proj.weight": ShardRule(1),
            "o_proj.weight": ShardRule(1)}


def _short_conv_shape(layer: RecurrentLayer, program: Program) -> ShortConvShape:
    channels, _, kernel = program.state[layer.params["conv.weight"].target].shape
    return ShortConvShape(int(channels), int(kernel))


def _short_conv_param_rules(s: ShortConvShape) -> dict[str, ShardRule]:
    """``in_proj``'s ``[B | C | x]`` by section, the depthwise conv by channel, ``out_proj`` by
    input columns (its bias added once, after the all-reduce)."""
    parts = SectionShardRule(0, sections=(s.channels,) * 3)
    return {"in_proj.weight": parts, "in_proj.bias": parts, "conv.weight": ShardRule(0), "conv.bias": ShardRule(0),
            "out_proj.weight": ShardRule(1), "out_proj.bias": REPLICATE}


def _mamba2_shape(layer: RecurrentLayer, program: Program) -> Mamba2Shape:
    x, b = layer.rule.args[0].meta["val"], layer.rule.args[3].meta["val"]
    kernel = int(program.state[layer.params["conv1d.weight"].target].shape[-1])
    return Mamba2Shape(int(x.shape[1]), int(x.shape[2]), int(b.shape[1]), int(b.shape[2]), kernel)


def _mamba2_conv_sections(s: Mamba2Shape) -> tuple[int, int, int]:
    gn = s.groups * s.state_size
    return (s.heads * s.head_dim, gn, gn)


def _mamba2_in_proj_parts(s: Mamba2Shape) -> tuple[int, int, int]:
    """``in_proj``'s rows as the traced mixer splits them: ``[z (I) | xBC (I + 2GN) | dt (Hh)]``."""
    return (s.heads * s.head_dim, s.conv_channels, s.heads)


def _mamba2_param_rules(s: Mamba2Shape) -> dict[str, ShardRule]:
    """``in_proj`` (and Falcon-H1's ``mup_vector`` scaling its outputs) by its ``[z | x | B | C | dt]``
    sections (``x``, ``z`` by head, ``B``/``C`` by group, ``dt`` by head); the conv over
    ``[x | B | C]`` by section; ``A_log``/``D``/``dt_bias`` by head; the gated norm's weight by
    channel (its groups are the B/C groups, so a rank holds whole norm groups); ``out_proj`` by
    input columns, its bias added once after the all-reduce."""
    inner, gn = s.heads * s.head_dim, s.groups * s.state_size
    in_proj = (inner, inner, gn, gn, s.heads)
    conv = SectionShardRule(0, sections=_mamba2_conv_sections(s))
    rows = ShardRule(0)
    return {"in_proj.weight": SectionShardRule(0, sections=in_proj), "in_proj.bias": SectionShardRule(0, sections=in_proj),
            "mup_vector": SectionShardRule(2, sections=in_proj), "conv1d.weight": conv, "conv1d.bias": conv,
            "A_log": rows, "D": rows, "dt_bias": rows, "norm.weight": rows,
            "out_proj.weight": ShardRule(1), "out_proj.bias": REPLICATE}


def _lightning_shape(layer: RecurrentLayer, program: Program) -> LightningAttentionShape:
    q = layer.rule.args[0].meta["val"]
    return LightningAttentionShape(int(q.shape[1]), int(q.shape[2]))


def _lightning_param_rules(s: LightningAttentionShape) -> dict[str, ShardRule]:
    """Rows by head: ``qkv_proj`` is laid out per head ``[q_h | k_h | v_h]`` (a contiguous ``1/tp``
    of rows is whole heads), ``output_gate``, the norm weight (channel ``h·D + d``) and the decay
    ``slope_rate [H, 1, 1]`` by head; ``out_proj`` by input columns."""
    rows = ShardRule(0)
    return {"qkv_proj.weight": rows, "output_gate.weight": rows, "norm.weight": rows, "slope_rate": rows,
            "out_proj.weight": ShardRule(1)}


def _average_norm_over_ranks(graph: torch.fx.Graph, layer: RecurrentLayer, tp: int) -> None:
    """The output norm spans every head: its mean of squares over the rank's ``H·D/tp`` channels
    becomes ``all_reduce(mean_r)/tp``, the mean over all channels (the ranks hold equal widths)."""
    means, seen, queue = [], {layer.rule}, [layer.rule]
    while queue:
        node = queue.pop()
        for user in node.users:
            if user in seen or user.target is aten.linear.default:
                continue
            seen.add(user)
            if user.target is aten.mean.dim:
                means.append(user)
            else:
                queue.append(user)
    if len(means) != 1:
        raise VerificationError(f"recurrent layer {layer.index} ({layer.kind}): expected one mean of squares "
                                f"(the output norm) before out_proj, found {len(means)}")
    (mean,) = means
    users = list(mean.users)
    with graph.inserting_before(mean.next):
        averaged = Emitter(graph)(aten.div.Tensor, coll.all_reduce(graph, mean, "tp"), tp)
    for user in users:
        user.replace_input_with(mean, averaged)


@dataclass(frozen=True)
class _KimiDeltaSplit:
    """A KDA layer's shape plus the axis of its ``A_log`` that holds the heads (``kimi_linear``
    stores ``[1, 1, H, 1]``, ``bailing_hybrid`` ``[H]``)."""

    state: KimiDeltaShape
    a_log_dim: int

    def on_rank(self, tp: int) -> _KimiDeltaSplit:
        return _KimiDeltaSplit(self.state.on_rank(tp), self.a_log_dim)


def _kda_shape(layer: RecurrentLayer, program: Program) -> _KimiDeltaSplit:
    v = layer.rule.args[2].meta["val"]
    kernel = int(program.state[layer.params["conv1d.weight"].target].shape[-1])
    a_log = program.state[layer.params["forget_gate.A_log"].target]
    heads_axes = [d for d, n in enumerate(a_log.shape) if n == v.shape[1]]
    return _KimiDeltaSplit(KimiDeltaShape(int(v.shape[1]), int(v.shape[2]), kernel),
                           heads_axes[0] if heads_axes else 0)


def _kda_param_rules(s: _KimiDeltaSplit) -> dict[str, ShardRule]:
    """By head: the rows of ``q_proj``/``k_proj``/``v_proj``/``b_proj``, of the gates' up
    projections (``f_b_proj`` or ``f_proj``, ``g_b_proj`` or ``g_proj``) and of ``dt_bias``; the
    conv by ``[q | k | v]`` section; ``A_log`` along its head axis; the low-rank down projections
    (``f_a_proj``, ``g_a_proj``) and the per-head norm weight replicated; ``o_proj`` by input
    columns."""
    width = s.state.heads * s.state.head_dim
    qkv = SectionShardRule(0, sections=(width,) * 3)
    rows = ShardRule(0)
    return {"q_proj.weight": rows, "k_proj.weight": rows, "v_proj.weight": rows, "b_proj.weight": rows,
            "conv1d.weight": qkv, "conv1d.bias": qkv,
            "forget_gate.f_a_proj.weight": REPLICATE, "forget_gate.f_b_proj.weight": rows,
            "forget_gate.f_proj.weight": rows, "forget_gate.dt_bias": rows,
            "forget_gate.A_log": ShardRule(s.a_log_dim),
            "g_a_proj.weight": REPLICATE, "g_b_proj.weight": rows, "g_proj.weight": rows,
            "o_norm.weight": REPLICATE, "o_proj.weight": ShardRule(1)}


TP_RULES: dict[str, RecurrentTPRule] = {
    "gated delta net": RecurrentTPRule(
        conv_weight="conv1d.weight", shape=_gdn_shape, units=lambda s: s.key_heads, param_rules=_gdn_param_rules,
        sections=_gdn_sections, out_proj=("out_proj", "o_proj"),
        pools=lambda s: {"conv_state": s.conv_state_shape(1)[1:], "recurrent_state": s.recurrent_state_shape(1)[1:]}),
    "kimi delta attention": RecurrentTPRule(
        conv_weight="conv1d.weight", shape=_kda_shape, units=lambda s: s.state.heads, param_rules=_kda_param_rules,
        sections=lambda s: (s.state.heads * s.state.head_dim,) * 3, out_proj=("o_proj",),
        pools=lambda s: {"conv_state": s.state.conv_state_shape(1)[1:],
                         "recurrent_state": s.state.recurrent_state_shape(1)[1:]}),
    "short convolution": RecurrentTPRule(
        conv_weight="conv.weight", shape=_short_conv_shape, units=lambda s: s.channels,
        param_rules=_short_conv_param_rules, sections=lambda s: None,
        pools=lambda s: {"conv_state": s.conv_state_shape(1)[1:]}),
    "mamba2": RecurrentTPRule(
        conv_weight="conv1d.weight", shape=_mamba2_shape, units=lambda s: math.gcd(s.heads, s.groups),
        param_rules=_mamba2_param_rules, sections=_mamba2_conv_sections,
        pools=lambda s: {"conv_state": s.conv_state_shape(1)[1:], "ssm_state": s.ssm_state_shape(1)[1:]},
        weight_splits=lambda s: (_mamba2_in_proj_parts(s),), buffers=("mup_vector",)),
    "lightning attention": RecurrentTPRule(
        conv_weight="slope_rate", shape=_lightning_shape, units=lambda s: s.heads,
        param_rules=_lightning_param_rules, sections=lambda s: None,
        pools=lambda s: {"kv_state": s.kv_state_shape(1)[1:]}, buffers=("slope_rate",),
        anchor=(dcp_ops.lightning_attention_.default, dcp_ops.lightning_attention.default, 3), anchor_pool="kv_state",
        rewrite=_average_norm_over_ranks),
}
"""Recurrent kind (``facts.extra["recurrent_layers"]``'s values) → its TP rule; a new kind adds a row."""


def _param_source(node: torch.fx.Node, specs: dict[str, InputSpec]) -> InputSpec | None:
    """The parameter (or buffer) a weight argument is read from through view-like ops (``squeeze``, ``view``…)."""
    while isinstance(node, torch.fx.Node) and node.op == "call_function" and node.all_input_nodes:
        node = node.args[0]
    if not isinstance(node, torch.fx.Node):
        return None
    spec = specs.get(node.name)
    return spec if spec is not None and spec.kind in (PARAM, BUFFER) else None


def recurrent_layers_of(program: Program) -> list[RecurrentLayer]:
    """The traced recurrent layers with their nodes and parameters, found from the state pools
    ``insert_recurrent_state`` made (``conv_state_<layer>``, ``recurrent_state_<layer>``,
    ``ssm_state_<layer>``, ``kv_state_<layer>``)."""
    graph = program.graph_module.graph
    specs = {s.name: s for s in program.inputs}
    kinds = dict(program.facts.extra.get("recurrent_layers") or {})
    convs = {n.args[CONV_ARGS_POOL].name: n for n in nodes_calling(graph, dcp_ops.causal_conv1d_.default)}
    rules = {n.args[RULE_ARGS_POOL].name: n for op in (dcp_ops.gated_delta_rule_.default, dcp_ops.kimi_delta_rule_.default)
             for n in nodes_calling(graph, op)}
    rules.update((n.args[SCAN_ARGS_POOL].name, n) for n in nodes_calling(graph, dcp_ops.mamba2_scan_.default))
    rules.update((n.args[LIGHTNING_ARGS_POOL].name, n)
                 for n in nodes_calling(graph, dcp_ops.lightning_attention_.default))
    layers = []
    for index, kind in sorted(kinds.items()):
        if kind not in TP_RULES:
            raise UnsupportedModelError(f"recurrent layer {index} ({kind}) has no TP rule; kinds with one: "
                                        f"{sorted(TP_RULES)}")
        rule = TP_RULES[kind]
        conv = convs.get(f"conv_state_{index}")
        anchor = conv if rule.anchor_pool == "conv_state" else rules.get(f"{rule.anchor_pool}_{index}")
        weight = _param_source(anchor.args[rule.anchor[2]], specs) if anchor is not None else None
        suffix = rule.conv_weight
        if weight is None or not weight.target.endswith(suffix):
            raise VerificationError(f"recurrent layer {index} ({kind}): no stateful {rule.anchor[0]} reading a "
                                    f"'{suffix}' parameter")
        prefix = weight.target.removesuffix(suffix)
        params = {s.target.removeprefix(prefix): s for s in program.inputs
                  if s.target.startswith(prefix) and (s.kind == PARAM or (
                      s.kind == BUFFER and s.target.removeprefix(prefix) in TP_RULES[kind].buffers))}
        state_space = (rules.get(f"recurrent_state_{index}") or rules.get(f"ssm_state_{index}")
                       or rules.get(f"kv_state_{index}"))
        layers.append(RecurrentLayer(index, kind, prefix, params, conv, state_space))
    return layers


def recurrent_parameter_targets(program: Program) -> set[str]:
    """Parameter targets under a recurrent layer's module, found from the traced canonical ops or
    their stateful forms: ``shard_tp`` leaves these to this pass."""
    specs = {s.name: s for s in program.inputs}
    graph = program.graph_module.graph
    anchors = [(node, arg) for stateful, canonical, arg in {r.anchor for r in TP_RULES.values()}
               for node in (*nodes_calling(graph, canonical), *nodes_calling(graph, stateful))]
    suffixes = {r.conv_weight for r in TP_RULES.values()}
    prefixes = set()
    for node, arg in anchors:
        weight = _param_source(node.args[arg], specs)
        suffix = next((x for x in suffixes if weight is not None and weight.target.endswith(x)), None)
        if suffix is not None:
            prefixes.add(weight.target.removesuffix(suffix))
    return {s.target for s in program.inputs if s.kind == PARAM and any(s.target.startswith(p) for p in prefixes)}


def _row_parallel(graph: torch.fx.Graph, linear: torch.fx.Node) -> None:
    """``linear(x_r, W_r, b)`` → ``all_reduce(linear(x_r, W_r)) + b``."""
    bias = linear.args[2] if len(linear.args) > 2 else None
    linear.args = linear.args[:2]
    with graph.inserting_before(linear.next):
        reduced = coll.all_reduce(graph, linear, "tp")
        result = Emitter(graph)(aten.add.Tensor, reduced, bias) if bias is not None else reduced
    linear.replace_all_uses_with(result)
    reduced.args[0].args = (linear, *reduced.args[0].args[1:])


def _split_layer(graph: torch.fx.Graph, layer: RecurrentLayer, rule: RecurrentTPRule, shape,
                 tp: int) -> dict[str, ShardRule]:
    """Rewrite one layer for a split over ``tp``; returns its parameters' rules by input name."""
    wanted = rule.param_rules(shape)
    unknown = sorted(set(layer.params) - set(wanted))
    if unknown:
        raise UnsupportedModelError(f"recurrent layer {layer.index} ({layer.kind}): parameters {unknown} under "
                                    f"{layer.prefix} have no TP rule; known: {sorted(wanted)}")
    sections = rule.sections(shape)
    if sections is not None:
        specs = {s.name: s for s in layer.params.values()}
        wanted_sizes = [list(sections), *(list(parts) for parts in rule.weight_splits(shape))]
        splits = [n for n in nodes_calling(graph, aten.split_with_sizes.default)
                  if (n.args[0] is layer.conv or _param_source(n.args[0], specs) is not None)
                  and list(n.args[1]) in wanted_sizes]
        for split in splits:
            split.args = (split.args[0], [size // tp for size in split.args[1]], *split.args[2:])
        if not any(n.args[0] is layer.conv for n in splits):
            raise VerificationError(f"recurrent layer {layer.index}: no split of the conv output into sections "
                                    f"{list(sections)}")
    out_weight = next((layer.params[f"{name}.weight"] for name in rule.out_proj
                       if f"{name}.weight" in layer.params), None)
    linears = [n for n in nodes_calling(graph, aten.linear.default)
               if out_weight is not None and n.args[1].name == out_weight.name]
    if len(linears) != 1:
        raise VerificationError(f"recurrent layer {layer.index}: expected one {'/'.join(rule.out_proj)} linear, found {len(linears)}")
    _row_parallel(graph, linears[0])
    if rule.rewrite is not None:
        rule.rewrite(graph, layer, tp)
    return {spec.name: wanted[suffix] for suffix, spec in layer.params.items()}


def _pools_fit_their_ops(program: Program) -> None:
    """Every state pool's per-slot shape is what its op reads on this rank: a conv state
    ``[C_r, K−1]`` for the conv's local weight ``[C_r, K]``, a delta-rule state ``[Hv_r, Dk, Dv]``
    for its local ``k [T, Hk_r, Dk]`` and ``v [T, Hv_r, Dv]``, a Mamba-2 SSM state ``[Hh_r, P, N]``
    for its scan's local ``x [T, Hh_r, P]`` and ``B [T, G_r, N]``, a lightning kv state
    ``[H_r, D, Dv]`` for its local ``q [T, H_r, D]`` and ``v [T, H_r, Dv]``."""
    pools = {p.name: tuple(p.shape) for p in program.recurrent_states}
    graph = program.graph_module.graph
    for op, pool_arg, what, per_slot in _POOL_READERS:
        for node in nodes_calling(graph, op):
            pool, want = node.args[pool_arg].name, per_slot(*(a.meta["val"] if isinstance(a, torch.fx.Node) else a
                                                                for a in node.args))
            if pools.get(pool) != want:
                raise VerificationError(f"{pool} holds {pools.get(pool)} per slot, its {what} reads {want}")


def _conv_slot(x, weight, *_) -> tuple[int, ...]:
    return int(weight.shape[0]), int(weight.shape[1]) - 1


def _delta_rule_slot(q, k, v, *_) -> tuple[int, ...]:
    return int(v.shape[1]), int(k.shape[2]), int(v.shape[2])


def _scan_slot(x, dt, a, b, *_) -> tuple[int, ...]:
    return int(x.shape[1]), int(x.shape[2]), int(b.shape[2])


def _lightning_slot(q, k, v, *_) -> tuple[int, ...]:
    return int(q.shape[1]), int(q.shape[2]), int(v.shape[2])


# (stateful op, its pool's argument index, what it is, the per-slot state shape its inputs read)
_POOL_READERS = (
    (dcp_ops.causal_conv1d_.default, CONV_ARGS_POOL, "conv", _conv_slot),
    (dcp_ops.gated_delta_rule_.default, RULE_ARGS_POOL, "delta rule", _delta_rule_slot),
    (dcp_ops.kimi_delta_rule_.default, RULE_ARGS_POOL, "Kimi delta rule", _delta_rule_slot),
    (dcp_ops.mamba2_scan_.default, SCAN_ARGS_POOL, "Mamba-2 scan", _scan_slot),
    (dcp_ops.lightning_attention_.default, LIGHTNING_ARGS_POOL, "lightning attention", _lightning_slot),
)


@program_pass("shard_recurrent_tp", requires=[
    ran("shard_tp", "the mesh's TP size is set, and shard_tp leaves the recurrent layers to this pass"),
    ran("insert_recurrent_state", "its state pools are resized to the rank's heads/channels"),
], ensures=[_pools_fit_their_ops])
def shard_recurrent_tp(program: Program):
    tp = program.mesh.tp
    if tp == 1:
        return program, "tp=1: nothing to shard"
    gm = program.copy_graph()
    graph = gm.graph
    rules: dict[str, ShardRule] = {}
    pool_shapes: dict[str, tuple[int, ...]] = {}
    split, replicated = [], []
    for layer in recurrent_layers_of(program.replace(graph_module=gm)):
        rule = TP_RULES[layer.kind]
        shape = rule.shape(layer, program)
        if rule.units(shape) % tp:
            replicated.append(layer.index)
            continue
        rules.update(_split_layer(graph, layer, rule, shape, tp))
        for role, local in rule.pools(shape.on_rank(tp)).items():
            pool_shapes[f"{role}_{layer.index}"] = tuple(local)
        split.append(layer.index)
    gm.recompile()
    inputs = tuple(InputSpec(s.name, s.kind, s.target, rules.get(s.name, s.shard)) for s in program.inputs)
    pools = tuple(RecurrentStateSpec(p.name, p.layer, p.role, pool_shapes.get(p.name, p.shape), p.dtype)
                  for p in program.recurrent_states)
    result = program.replace(graph_module=gm, inputs=inputs, recurrent_states=pools)
    return result, (f"tp={tp}: recurrent layers {split} split by heads/channels (row-parallel output, state 1/{tp})"
                    + (f"; layers {replicated} replicated (tp does not divide their heads/channels)"
                       if replicated else ""))

"""The tensor-parallel split of each recurrent layer kind: :data:`TP_RULES`, one
:class:`RecurrentTPRule` per kind (gated delta net, Kimi delta attention, short convolution,
Mamba-2, lightning attention), saying which parameters are split by head or channel (by suffix),
how the layer's state pools shrink on a rank, which projection becomes row-parallel and any extra
graph rewrite the split needs. The pass that applies them is
:mod:`dcpgraph.passes.shard_recurrent_tp`; a new kind adds a row here.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.fx

from ..errors import VerificationError
from ..ops import gated_delta as _gated_delta_ops  # noqa: F401  (registers the anchors' ops)
from ..ops import kimi_delta as _kimi_delta_ops  # noqa: F401  (registers dcpgraph.kimi_delta_rule_)
from ..ops import lightning_attention as _lightning_ops  # noqa: F401
from ..program import REPLICATE, InputSpec, Program, ShardRule
from ..recurrent_state import (
    GatedDeltaNetShape,
    KimiDeltaShape,
    LightningAttentionShape,
    Mamba2Shape,
    ShortConvShape,
)
from . import collectives as coll
from .graph_edit import Emitter
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


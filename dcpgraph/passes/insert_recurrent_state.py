"""``insert_recurrent_state``: canonical recurrent ops → in-place updates of per-request state pools.

Per recurrent layer ``i`` (``facts.extra["recurrent_layers"]``, in graph order), the canonical ops
a front end traced over one sequence from a zero state become their stateful forms over the
step's varlen rows::

    causal_conv1d(x, w, b, act)          → causal_conv1d_(x, w, b, conv_state_i, state_slots,
                                                           cu_seqlens_q, context_lens, act)
    gated_delta_rule(q, k, v, g, β, C)   → gated_delta_rule_(q, k, v, g, β, recurrent_state_i,
                                                             state_slots, cu_seqlens_q, context_lens, C)
    kimi_delta_rule(q, k, v, g, β, C)    → kimi_delta_rule_(… the same arguments …)
    mamba2_scan(x, dt, A, B, C, D, b, lo, hi, L) → mamba2_scan_(x, dt, A, B, C, D, b, ssm_state_i, state_slots,
                                                                 cu_seqlens_q, context_lens, lo, hi, L)
    lightning_attention(q, k, v, s, L)   → lightning_attention_(q, k, v, s, kv_state_i, state_slots,
                                                                 cu_seqlens_q, context_lens, L)

``conv_state_i [slots, C, K−1]`` (model dtype), ``recurrent_state_i [slots, Hv, Dk, Dv]`` (a gated
delta net's or a Kimi delta attention's), ``ssm_state_i [slots, H, P, N]`` and
``kv_state_i [slots, H, D, D]`` (fp32) are program state like the KV caches: placeholders of kind ``recurrent``, returned as
outputs, written in place. ``state_slots [R]`` is a new per-step input (the request's slot, −1
for padding rows); a row with ``context_lens == 0`` starts from a zero state, so a prompt split
into prefill chunks and its decode steps carry the state, and a recomputed request restarts it.
Runs after ``insert_kv_cache`` (whose ``cu_seqlens_q`` / ``context_lens`` it reads).
"""

from __future__ import annotations

import torch

from ..errors import VerificationError
from ..ops import kimi_delta as _kimi_delta_ops  # noqa: F401  (registers dcpgraph.kimi_delta_rule)
from ..ops import lightning_attention as _lightning_ops  # noqa: F401  (registers dcpgraph.lightning_attention)
from ..ops import mamba2 as _mamba2_ops  # noqa: F401  (registers dcpgraph.mamba2_scan)
from ..program import META, RECURRENT, InputSpec, Program, RecurrentStateSpec
from ..recurrent_state import RECURRENT_STATE_DTYPE
from .graph_edit import add_placeholders, nodes_calling, output_node
from .manager import holds, program_pass

dcp_ops = torch.ops.dcpgraph
CANONICAL_RECURRENT = (dcp_ops.causal_conv1d.default, dcp_ops.gated_delta_rule.default, dcp_ops.kimi_delta_rule.default,
                       dcp_ops.mamba2_scan.default, dcp_ops.lightning_attention.default)
CONV_FREE_KINDS = ("lightning attention",)  # recurrent kinds without a causal conv
# Delta-rule kinds: canonical op → (its recurrent kind, its stateful form). Both read (q, k, v, g, β,
# chunk) and keep a ``recurrent_state [Hv, Dk, Dv]`` per slot.
DELTA_RULES = {dcp_ops.gated_delta_rule.default: ("gated delta net", dcp_ops.gated_delta_rule_.default),
               dcp_ops.kimi_delta_rule.default: ("kimi delta attention", dcp_ops.kimi_delta_rule_.default)}
SLOTS_ROLE = "state_slots"


def recurrent_layers(program: Program) -> dict[int, str]:
    """Decoder layer → recurrent kind, as the front end recorded them."""
    return dict(program.facts.extra.get("recurrent_layers") or {})


def _canonical_recurrent(program: Program) -> list:
    return [n for n in program.graph_module.graph.nodes if n.op == "call_function" and n.target in CANONICAL_RECURRENT]


HAS_RECURRENT = holds("canonical causal_conv1d / gated_delta_rule / kimi_delta_rule / mamba2_scan / "
                      "lightning_attention nodes (traced recurrent layers)",
                      lambda p: bool(_canonical_recurrent(p)))
HAS_STEP_METADATA = holds("the 'cu_seqlens_q' and 'context_lens' inputs (insert_kv_cache)",
                          lambda p: {"cu_seqlens_q", "context_lens"} <= {s.name for s in p.inputs})


def _no_canonical_recurrent_left(program: Program) -> None:
    left = _canonical_recurrent(program)
    if left:
        raise VerificationError(f"canonical recurrent ops left after insert_recurrent_state: {[n.name for n in left]}")


@program_pass("insert_recurrent_state", requires=[HAS_RECURRENT, HAS_STEP_METADATA],
              ensures=[_no_canonical_recurrent_left])
def insert_recurrent_state(program: Program):
    gm = program.copy_graph()
    graph = gm.graph
    kinds = recurrent_layers(program)
    layers = sorted(i for i in kinds if kinds[i] not in CONV_FREE_KINDS)  # one conv each
    convs = nodes_calling(graph, dcp_ops.causal_conv1d.default)
    delta_kinds = {kind for kind, _ in DELTA_RULES.values()}
    rules = [n for n in graph.nodes if n.op == "call_function" and n.target in DELTA_RULES]
    gdn_layers = [i for i in layers if recurrent_layers(program)[i] in delta_kinds]
    mismatched = [(i, n.name) for i, n in zip(gdn_layers, rules) if DELTA_RULES[n.target][0] != recurrent_layers(program)[i]]
    scans = nodes_calling(graph, dcp_ops.mamba2_scan.default)
    mamba2_layers = [i for i in layers if recurrent_layers(program)[i] == "mamba2"]
    lightnings = nodes_calling(graph, dcp_ops.lightning_attention.default)
    lightning_layers = sorted(i for i in kinds if kinds[i] == "lightning attention")
    if (len(convs) != len(layers) or len(rules) != len(gdn_layers) or len(scans) != len(mamba2_layers)
            or len(lightnings) != len(lightning_layers) or mismatched):
        raise VerificationError(
            f"insert_recurrent_state: {len(convs)} convolutions, {len(rules)} delta rules, {len(scans)} Mamba-2 "
            f"scans and {len(lightnings)} lightning attentions for recurrent layers {kinds} (one convolution per "
            "layer of a conv-carrying kind, one rule of its kind per gated delta net or Kimi delta attention, "
            "one scan per Mamba-2 mixer, one lightning attention per lightning layer)")
    specs: list[RecurrentStateSpec] = []
    for layer, conv in zip(layers, convs):
        channels, kernel = conv.args[1].meta["val"].shape
        specs.append(RecurrentStateSpec(f"conv_state_{layer}", layer, "conv_state", (int(channels), int(kernel) - 1),
                                        conv.args[1].meta["val"].dtype))
    for layer, rule in zip(gdn_layers, rules):
        k, v = rule.args[1].meta["val"], rule.args[2].meta["val"]
        specs.append(RecurrentStateSpec(f"recurrent_state_{layer}", layer, "recurrent_state",
                                        (int(v.shape[1]), int(k.shape[-1]), int(v.shape[-1])), RECURRENT_STATE_DTYPE))
    for layer, scan in zip(mamba2_layers, scans):
        x, b = scan.args[0].meta["val"], scan.args[3].meta["val"]
        specs.append(RecurrentStateSpec(f"ssm_state_{layer}", layer, "ssm_state",
                                        (int(x.shape[1]), int(x.shape[2]), int(b.shape[-1])), RECURRENT_STATE_DTYPE))
    for layer, node in zip(lightning_layers, lightnings):
        q, v = node.args[0].meta["val"], node.args[2].meta["val"]
        specs.append(RecurrentStateSpec(f"kv_state_{layer}", layer, "kv_state",
                                        (int(q.shape[1]), int(q.shape[2]), int(v.shape[2])), RECURRENT_STATE_DTYPE))
    pools = add_placeholders(graph, [s.name for s in specs] + [SLOTS_ROLE])
    by_name = {n.name: n for n in graph.nodes if n.op == "placeholder"}
    slots, cu, context = pools[-1], by_name["cu_seqlens_q"], by_name["context_lens"]
    for layer, conv in zip(layers, convs):
        x, weight, bias, activation = conv.args
        with graph.inserting_before(conv):
            new = graph.call_function(dcp_ops.causal_conv1d_.default,
                                      (x, weight, bias, by_name[f"conv_state_{layer}"], slots, cu, context, activation))
        new.meta = dict(conv.meta)
        conv.replace_all_uses_with(new)
        graph.erase_node(conv)
    for layer, rule in zip(gdn_layers, rules):
        q, k, v, g, beta, chunk = rule.args
        with graph.inserting_before(rule):
            new = graph.call_function(DELTA_RULES[rule.target][1],
                                      (q, k, v, g, beta, by_name[f"recurrent_state_{layer}"], slots, cu, context, chunk))
        new.meta = dict(rule.meta)
        rule.replace_all_uses_with(new)
        graph.erase_node(rule)
    for layer, scan in zip(mamba2_layers, scans):
        x, dt, a, b, c, d, dt_bias, dt_min, dt_max, chunk = scan.args
        with graph.inserting_before(scan):
            new = graph.call_function(dcp_ops.mamba2_scan_.default,
                                      (x, dt, a, b, c, d, dt_bias, by_name[f"ssm_state_{layer}"], slots, cu, context,
                                       dt_min, dt_max, chunk))
        new.meta = dict(scan.meta)
        scan.replace_all_uses_with(new)
        graph.erase_node(scan)
    for layer, node in zip(lightning_layers, lightnings):
        q, k, v, slope, block = node.args
        with graph.inserting_before(node):
            new = graph.call_function(dcp_ops.lightning_attention_.default,
                                      (q, k, v, slope, by_name[f"kv_state_{layer}"], slots, cu, context, block))
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
    out_node = output_node(graph)
    outputs = out_node.args[0]
    outputs = list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]
    out_node.args = (tuple(outputs + list(pools[:-1])),)
    gm.recompile()
    inputs = [*program.inputs, *(InputSpec(s.name, RECURRENT, s.role) for s in specs),
              InputSpec(SLOTS_ROLE, META, SLOTS_ROLE)]
    result = program.replace(graph_module=gm, inputs=tuple(inputs), recurrent_states=tuple(specs))
    return result, f"{len(kinds)} recurrent layers -> state pools ({len(specs)} pools, one slot per request)"

"""The ``canonicalize_attention`` pass: plan one :class:`AttentionRewrite` per attention, then apply.

Invariants:

- planning is read-only: every attention in the graph is planned (and any refusal raised) before
  the pass's own copy of the graph is edited, so a refused model is never half rewritten;
- a rewrite replaces a whole attention or nothing: an intermediate (scores, probabilities…) used
  outside the matched attention is refused, and two plans claiming one node are refused;
- the result of each rewrite is ``dcpgraph.attention(q, k, v, scale, True)`` with 4-D
  ``[B, H, T, D]`` operands, K/V un-repeated (:mod:`.gqa`), the mask proven causal (:mod:`.masks`),
  cast back to the dtype of the node it replaces when that differs from ``q``'s;
- buffers and constants read only by the masks are dropped from the Program's inputs and state;
- afterwards no SDPA op and no softmax feeding a matmul is left (:func:`canonical_only`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx

from ...errors import VerificationError
from ...passes.graph_edit import nodes_calling
from ...passes.manager import program_pass
from ...program import BUFFER, CONSTANT, Program
from .gqa import kv_sources, untranspose
from .masks import MaskEvaluator, check_causal
from .nodes import example_value, refuse, tensor_shape
from .patterns import (
    SDPA_FAMILY,
    attention_softmaxes,
    describe_score_chain,
    match_scores,
    raw_attention,
    value_matmul,
)
from .sparse import check_sparse_canonical, recognise_indexers

aten = torch.ops.aten
dcp_ops = torch.ops.dcpgraph

_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_SDPA_DEFAULTS = (None, None, None, None, 0.0, False, None, False)


@dataclass
class AttentionRewrite:
    """One planned replacement of raw attention by ``dcpgraph.attention``."""

    anchor: torch.fx.Node  # insert before; its uses get the result
    q: torch.fx.Node
    k: torch.fx.Node  # not transposed (unless k_transposed)
    k_transposed: bool  # True: ``k`` is kᵀ and must be transposed back
    v: torch.fx.Node
    scale: float
    dead: tuple[torch.fx.Node, ...]  # nodes to erase, users first
    kind: str  # "sdpa" or "matmul-softmax"


def _heads(q: torch.fx.Node, k: torch.fx.Node, v: torch.fx.Node, at: torch.fx.Node) -> list[tuple]:
    """The q/k/v shapes, refused unless 4-D with ``Hk == Hv`` dividing ``Hq``."""
    shapes = [tensor_shape(x) for x in (q, k, v)]
    if any(s is None or len(s) != 4 for s in shapes):
        raise refuse(at, f"attention expects 4-D [batch, heads, tokens, dim] q/k/v, got {shapes}")
    hq, hk, hv = shapes[0][1], shapes[1][1], shapes[2][1]
    if hk != hv or not all(isinstance(h, int) for h in (hq, hk)) or hq % hk:
        raise refuse(at, f"{hq} query heads with {hk} key / {hv} value heads")
    return shapes


def plan_sdpa(node: torch.fx.Node, masks: MaskEvaluator) -> AttentionRewrite:
    """The rewrite of one SDPA-family node; refuses anything but causal, dropout-free SDPA."""
    arg = dict(zip(_SDPA_ARGS, _SDPA_DEFAULTS))
    arg.update(zip(_SDPA_ARGS, node.args))
    arg.update(node.kwargs)
    if node.target is not aten.scaled_dot_product_attention.default:
        raise refuse(node, f"{node.target} is not supported; trace before decomposition so "
                     "scaled_dot_product_attention stays one op")
    if arg["dropout_p"]:
        raise refuse(node, f"attention dropout (dropout_p={arg['dropout_p']}) is not supported")
    q, k, v = arg["query"], arg["key"], arg["value"]
    shapes = _heads(q, k, v, node)
    if arg["attn_mask"] is not None:
        check_causal(masks, node, "sdpa", arg["attn_mask"], (q, k))
    elif not arg["is_causal"]:
        raise refuse(node, "non-causal scaled_dot_product_attention (is_causal=False, no mask) "
                     "is not supported")
    scale = arg["scale"]
    if scale is None:
        scale = shapes[0][-1] ** -0.5
    if not isinstance(scale, (int, float)):
        raise refuse(node, f"a scale of type {type(scale).__name__} is not supported")
    k, v = kv_sources(k, v)
    return AttentionRewrite(node, q, k, False, v, float(scale), (node,), "sdpa")


def _constant_scale(roles: dict[str, torch.fx.Node]) -> float:
    """The factor the scores are multiplied by (1.0 without a scale step)."""
    if "scale" not in roles:
        return 1.0
    s = roles["scale"]
    other = [a for a in s.args[:2] if a is not roles["qk"]]
    if len(other) != 1 or not isinstance(other[0], (int, float)):
        raise refuse(s, f"the attention scores are scaled by {other} (only a constant number "
                     "is supported)")
    if s.target in (aten.div.Tensor, aten.div.Scalar):
        return 1.0 / float(other[0])
    return float(other[0])


def plan_softmax(softmax: torch.fx.Node, masks: MaskEvaluator) -> AttentionRewrite:
    """The rewrite of hand-written attention ending in ``softmax`` (a softmax that reaches a
    matmul); refuses every arrangement the score patterns and the checks below do not prove."""
    pv, chain = value_matmul(softmax)
    if pv is None or pv.target is not aten.matmul.default:
        raise refuse(softmax, "softmax attention whose probabilities reach "
                     f"{pv.target if pv is not None else 'a matmul'} through other ops is not "
                     "recognised (expected softmax → casts/dropout → matmul(p, v))")
    matched = match_scores(softmax)
    if matched is None:
        raise refuse(softmax, f"unrecognised attention ({describe_score_chain(softmax)}): expected "
                     "softmax over matmul(q, kT) [· scale] [+ causal mask]; soft-capping, biases "
                     "and other score transforms are not supported")
    roles = matched.roles
    dim = softmax.args[1] if len(softmax.args) > 1 else softmax.kwargs.get("dim")
    rank = len(tensor_shape(softmax) or ())
    if not isinstance(dim, int) or dim % max(rank, 1) != rank - 1:
        raise refuse(softmax, f"softmax over dim {dim}, not the key dim")
    if pv.args[0] is not (chain[-1] if chain else softmax):
        raise refuse(pv, "the probabilities are the right operand of the value matmul")
    for node in chain:
        if node.target is aten.dropout.default and node.args[1] and node.args[2]:
            raise refuse(node, f"attention dropout (p={node.args[1]}) is not supported")
    scale = _constant_scale(roles)
    if "masked" not in roles:
        raise refuse(softmax, f"non-causal attention (no mask between the scores and the "
                     f"softmax; pattern '{matched.pattern.name}') is not supported")
    masked, mask, kind = roles["masked"], roles["mask"], matched.pattern.mask
    fill = masked.args[2] if kind in ("masked_fill", "where") else None
    # Escapes: every intermediate's users must be inside the match.
    scaled = [roles["scale"]] if "scale" in roles else []
    internal = [roles["qk"], *scaled, masked, softmax, *chain]
    inside = set(internal) | {pv}
    for node in internal:
        outside = [u.name for u in node.users if u not in inside]
        if outside:
            raise refuse(node, f"the attention intermediate {node.name} ({node.target}) is also "
                         f"used by {outside} outside the attention; dcpgraph rewrites only whole "
                         "attentions (no partial rewrite)")
    check_causal(masks, masked, kind, mask, masked, fill)
    q, k_t, v = roles["q"], roles["kT"], pv.args[1]
    k = untranspose(k_t)
    if k is None:  # kT is not a visible transpose: check the shapes of k = kT.mT
        shape, q_shape = tensor_shape(k_t), tensor_shape(q)
        if shape is None or len(shape) != 4 or q_shape is None or len(q_shape) != 4:
            raise refuse(roles["qk"], "attention expects 4-D [batch, heads, tokens, dim] q/k/v")
        k_final, v_final = k_t, v
    else:
        _heads(q, k, v, roles["qk"])
        k_final, v_final = kv_sources(k, v)
    dead = (pv, *reversed(chain), softmax, masked, *scaled, roles["qk"])
    return AttentionRewrite(pv, q, k_final, k is None, v_final, scale, dead, "matmul-softmax")


def apply_rewrite(graph: torch.fx.Graph, rewrite: AttentionRewrite) -> None:
    """Insert ``dcpgraph.attention`` before the anchor, reroute its uses, erase the dead nodes."""
    with graph.inserting_before(rewrite.anchor):
        k = rewrite.k
        if rewrite.k_transposed:
            k = graph.call_function(aten.transpose.int, (k, -2, -1))
        out = graph.create_node(
            "call_function", dcp_ops.attention.default, (rewrite.q, k, rewrite.v, rewrite.scale, True),
            name="attention",
        )
        want = example_value(rewrite.anchor)
        have = example_value(rewrite.q)
        if isinstance(want, torch.Tensor) and isinstance(have, torch.Tensor) and want.dtype != have.dtype:
            out = graph.call_function(aten._to_copy.default, (out,), {"dtype": want.dtype})
    out.meta["nn_module_stack"] = rewrite.anchor.meta.get("nn_module_stack")
    rewrite.anchor.replace_all_uses_with(out)
    for node in rewrite.dead:
        if not node.users:
            graph.erase_node(node)


def plan_all(graph: torch.fx.Graph, masks: MaskEvaluator) -> list[AttentionRewrite]:
    """Every rewrite of ``graph`` (read-only); refuses overlapping attentions."""
    rewrites = [plan_sdpa(n, masks) for n in graph.nodes if n.op == "call_function" and n.target in SDPA_FAMILY]
    rewrites += [plan_softmax(softmax, masks) for softmax, _consumer in attention_softmaxes(graph)]
    claimed: dict[torch.fx.Node, AttentionRewrite] = {}
    for rewrite in rewrites:
        for node in rewrite.dead:
            if node in claimed:
                raise refuse(node, "two attention patterns overlap here")
            claimed[node] = rewrite
    return rewrites


# -- the invariant and the pass ---------------------------------------------------------------------
def canonical_only(program: Program) -> None:
    """No raw attention left; every ``dcpgraph.attention`` causal, 4-D, with ``Hkv | Hq``."""
    graph = program.graph_module.graph
    left = raw_attention(graph)
    if left:
        raise VerificationError(f"raw attention left after canonicalization: {[n.name for n in left]}")
    problem = check_sparse_canonical(graph)
    if problem:
        raise VerificationError(problem)
    for node in nodes_calling(graph, dcp_ops.attention.default):
        q, k, v, _scale, causal = node.args[:5]
        if causal is not True:
            raise VerificationError(f"{node.name}: canonical attention must be causal")
        shapes = [tensor_shape(x) for x in (q, k, v)]
        if any(s is None or len(s) != 4 for s in shapes):
            raise VerificationError(f"{node.name}: q/k/v must be 4-D, got {shapes}")
        if shapes[0][1] % shapes[1][1] or shapes[1][1] != shapes[2][1]:
            raise VerificationError(f"{node.name}: {shapes[0][1]} query heads vs {shapes[1][1]} KV heads")


def _original_users(program: Program, name: str) -> list[torch.fx.Node]:
    node = next(n for n in program.graph_module.graph.nodes if n.op == "placeholder" and n.name == name)
    return list(node.users)


@program_pass("canonicalize_attention", ensures=[canonical_only])
def canonicalize_attention(program: Program):
    gm = program.copy_graph()
    graph = gm.graph
    masks = MaskEvaluator(program, gm)
    rewrites = plan_all(graph, masks)
    for rewrite in rewrites:
        apply_rewrite(graph, rewrite)
    indexers = recognise_indexers(graph)
    inputs = program.inputs
    if rewrites or indexers:
        graph.eliminate_dead_code()
        # Buffers/constants only the masks read (a ``tril`` buffer, say) are no longer inputs.
        unused = {
            n.name for n in graph.nodes
            if n.op == "placeholder" and not n.users and n.name in masks.specs
            and masks.specs[n.name].kind in (BUFFER, CONSTANT)
            and any(u.op != "output" for u in _original_users(program, n.name))
        }
        for node in [n for n in graph.nodes if n.name in unused]:
            graph.erase_node(node)
        inputs = tuple(s for s in program.inputs if s.name not in unused)
    gm.recompile()
    counts: dict[str, int] = {}
    for rewrite in rewrites:
        counts[rewrite.kind] = counts.get(rewrite.kind, 0) + 1
    total = len(nodes_calling(graph, dcp_ops.attention.default))
    if indexers:
        counts["sparse-indexer"] = indexers
    done = ", ".join(f"{v} {k}" for k, v in sorted(counts.items())) or "nothing to rewrite"
    state = {s.target: program.state[s.target] for s in inputs if s.target in program.state}
    return (
        program.replace(graph_module=gm, inputs=inputs, state=state),
        f"{done}; {total} dcpgraph.attention nodes",
    )

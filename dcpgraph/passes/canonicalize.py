"""``canonicalize_attention``: raw attention in a traced graph → ``torch.ops.dcpgraph.attention``.

Two shapes of attention are recognised, both in the HF layout ``q [B, Hq, S, D]``,
``k [B, Hkv, S, D]``, ``v [B, Hkv, S, Dv]``::

    # (a) SDPA                                         # (b) hand-written, anchored on softmax
    o = aten.scaled_dot_product_attention(             s = matmul(q, kT)          # kT = k.mT
            q, k, v, attn_mask, dropout_p,             s = s * c  |  s / c        # optional
            is_causal, scale, enable_gqa)              s = masked_fill(s, m, -inf)  |  s + m
                                                         |  where(m, s, -inf)      # the mask
                                                       p = softmax(s, -1)
                                                       p = p.to(dtype) / dropout(eval) …
                                                       o = matmul(p, v)
    # both become
    o = dcpgraph.attention(q, k, v, scale, True)

GQA: ``enable_gqa=True`` passes K/V through with their own head count; K/V repeated by
``repeat_interleave(x, n, dim=1)`` or HF's ``repeat_kv`` (``unsqueeze → expand → reshape``) are
traced back to the un-repeated tensor, so the facts (and the KV cache) see the real KV heads.

How (b) is found: a read-only networkx view of the FX graph (node id = node name, edges carry the
argument positions) and a handful of tiny patterns generated from one table (optional scale ×
mask kind), matched with ``DiGraphMatcher.subgraph_monomorphisms_iter`` on the few nodes around a
softmax, anchored on it and matching backwards; the softmax → matmul side is a short walk through
pass-through ops (casts, dropout in eval mode). The view is never mutated: every rewrite is planned
first, then applied to the pass's own copy of the graph.

Nothing is assumed:

- **causal** is decided by *evaluating* the mask subgraph (it may read only shapes, buffers,
  parameters and constants; a mask computed from input values is refused) at two token counts and
  comparing it with the causal mask. A finite fill value counts as −inf only if it is ≤ −1e9;
- an intermediate (scores, probabilities…) whose value is used outside the matched attention
  (e.g. the scores are also returned) makes the whole thing **unsupported**: dcpgraph raises
  :class:`~dcpgraph.errors.UnsupportedModelError` naming the node rather than rewriting part of it;
- non-causal SDPA, a non-causal or unrecognised mask, dropout > 0, a tensor scale, a softmax that
  feeds a matmul in any other arrangement: :class:`~dcpgraph.errors.UnsupportedModelError` naming
  the node, its module path and the feature.

A softmax that does not feed a matmul (an MoE router, say) is not attention and is left alone.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass

import networkx as nx
import sympy
import torch
import torch.fx
from networkx.algorithms import isomorphism

from ..errors import UnsupportedModelError, VerificationError
from ..program import BUFFER, CONSTANT, STATE_KINDS, USER, Program
from .graph_edit import nodes_calling
from .manager import program_pass

aten = torch.ops.aten
dcp_ops = torch.ops.dcpgraph

SDPA_FAMILY = frozenset(
    getattr(aten, name).default
    for name in (
        "scaled_dot_product_attention",
        "_scaled_dot_product_attention_math",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_fused_sdp_choice",
    )
    if hasattr(aten, name)
)
SOFTMAX = frozenset({aten.softmax.int, aten._softmax.default, aten._safe_softmax.default})
MATMULS = frozenset({aten.matmul.default, aten.bmm.default, aten.einsum.default})
# Ops between softmax and the value matmul that do not change what attention computes.
PASS_THROUGH = frozenset({
    aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default, aten.type_as.default,
    aten.dropout.default, aten.clone.default, aten.contiguous.default, aten.alias.default,
})
_SCALES = frozenset({aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar})
_NEG_FILL = -1e9  # a finite fill at most this is as good as -inf (exp underflows to exactly 0)


# -- the read-only networkx view ------------------------------------------------------------------
def graph_view(graph: torch.fx.Graph) -> nx.DiGraph:
    """``nx.DiGraph`` with one vertex per FX node (id = node name; attributes ``op``, ``target``,
    ``node``) and an edge ``arg → user`` whose ``index`` is the set of argument positions (kwarg
    names for keyword arguments). Analyses only: never edit the graph through it."""
    view = nx.DiGraph()
    for node in graph.nodes:
        view.add_node(node.name, op=node.op, target=node.target, node=node)
        for index, arg in _arguments(node):
            if view.has_edge(arg.name, node.name):
                view.edges[arg.name, node.name]["index"].add(index)
            else:
                view.add_edge(arg.name, node.name, index={index})
    return view


def _arguments(node: torch.fx.Node) -> Iterable[tuple[object, torch.fx.Node]]:
    def walk(value, index):
        if isinstance(value, torch.fx.Node):
            yield index, value
        elif isinstance(value, (list, tuple)):
            for item in value:
                yield from walk(item, index)
        elif isinstance(value, dict):
            for item in value.values():
                yield from walk(item, index)

    for i, arg in enumerate(node.args):
        yield from walk(arg, i)
    for key, arg in node.kwargs.items():
        yield from walk(arg, key)


# -- the pattern table ------------------------------------------------------------------------------
# mask kind -> (targets, argument positions of the scores, of the mask)
_MASK_OPS = {
    "masked_fill": (frozenset({aten.masked_fill.Scalar}), {0}, {1}),
    "additive": (frozenset({aten.add.Tensor}), {0, 1}, {0, 1}),
    "where": (frozenset({aten.where.ScalarOther}), {1}, {0}),
    None: None,
}


@functools.cache
def _patterns() -> tuple[tuple[str, nx.DiGraph], ...]:
    """``qk = matmul(q, kT) [→ scale] [→ mask] → softmax``, every variant, longest first."""
    out = []
    for scaled in (True, False):
        for mask_kind, mask_op in _MASK_OPS.items():
            p = nx.DiGraph()
            p.add_node("q", targets=None)
            p.add_node("kT", targets=None)
            p.add_node("qk", targets=frozenset({aten.matmul.default}))
            p.add_edge("q", "qk", index={0})
            p.add_edge("kT", "qk", index={1})
            last = "qk"
            if scaled:
                p.add_node("scale", targets=_SCALES)
                p.add_edge(last, "scale", index={0, 1})
                last = "scale"
            if mask_op is not None:
                targets, score_at, mask_at = mask_op
                p.add_node("mask", targets=None)
                p.add_node("masked", targets=targets, kind=mask_kind)
                p.add_edge(last, "masked", index=score_at)
                p.add_edge("mask", "masked", index=mask_at)
                last = "masked"
            p.add_node("softmax", targets=SOFTMAX, anchor=True)
            p.add_edge(last, "softmax", index={0})
            name = f"{'scaled ' if scaled else ''}{mask_kind or 'unmasked'}"
            out.append((name, p))
    out.sort(key=lambda item: -item[1].number_of_nodes())
    return tuple(out)


_BACKWARD_DEPTH = 4  # softmax ← masked ← scale ← qk ← q / kT: the deepest pattern


def _neighbourhood(view: nx.DiGraph, anchor: str) -> nx.DiGraph:
    seen, frontier = {anchor}, [anchor]
    for _ in range(_BACKWARD_DEPTH):
        frontier = [p for n in frontier for p in view.predecessors(n) if p not in seen]
        seen.update(frontier)
    return view.subgraph(seen)


def match_scores(view: nx.DiGraph, anchor: str) -> tuple[str, dict[str, torch.fx.Node]] | None:
    """``(pattern name, role → FX node)`` of the score chain ending at softmax ``anchor``."""
    host = _neighbourhood(view, anchor)

    def node_match(h: dict, p: dict) -> bool:
        if p.get("anchor") and h["node"].name != anchor:
            return False
        targets = p["targets"]
        return targets is None or (h["op"] == "call_function" and h["target"] in targets)

    def edge_match(h: dict, p: dict) -> bool:
        return bool(h["index"] & p["index"])

    for name, pattern in _patterns():
        matcher = isomorphism.DiGraphMatcher(host, pattern, node_match=node_match, edge_match=edge_match)
        for mapping in matcher.subgraph_monomorphisms_iter():
            return name, {role: view.nodes[h]["node"] for h, role in mapping.items()}
    return None


# -- helpers --------------------------------------------------------------------------------------
def where(node: torch.fx.Node) -> str:
    """``node name in module.path (Class)`` from the export's module stack, for error messages."""
    stack = node.meta.get("nn_module_stack") or {}
    if stack:
        path, cls = list(stack.values())[-1]
        cls = cls.rsplit(".", 1)[-1] if isinstance(cls, str) else getattr(cls, "__name__", str(cls))
        if path:
            return f"{path} ({cls}), node {node.name}"
        return f"{cls}, node {node.name}"
    return f"node {node.name}"


def _val(node) -> object:
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else None


def _shape(node) -> tuple | None:
    val = _val(node)
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def _is_noop_slice(node: torch.fx.Node) -> bool:
    if node.target is not aten.slice.Tensor:
        return False
    args = list(node.args) + [None] * (5 - len(node.args))
    _, _dim, start, end, step = args[:5]
    return (start in (None, 0)) and (end is None or (isinstance(end, int) and end >= 2**62)) and step in (None, 1)


def unrepeat(node: torch.fx.Node) -> tuple[torch.fx.Node, int]:
    """``(source, n)`` when ``node`` repeats each KV head ``n`` times along dim 1 (GQA done by
    hand), else ``(node, 1)``. Recognises ``repeat_interleave(x, n, dim=1)`` and HF's
    ``repeat_kv``: ``reshape(expand(unsqueeze(x, 2), [b, h, n, s, d]), [b, h·n, s, d])``."""
    shape = _shape(node)
    if node.op != "call_function" or shape is None or len(shape) != 4:
        return node, 1
    if node.target is aten.repeat_interleave.self_int:
        src, reps = node.args[0], node.args[1]
        dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim")
        src_shape = _shape(src)
        if isinstance(reps, int) and dim in (1, -3) and src_shape and len(src_shape) == 4:
            return src, reps
        return node, 1
    if node.target in (aten.reshape.default, aten.view.default, aten._unsafe_view.default):
        expand = node.args[0]
        if not (isinstance(expand, torch.fx.Node) and expand.target is aten.expand.default):
            return node, 1
        sizes = expand.args[1]
        src = expand.args[0]
        while isinstance(src, torch.fx.Node) and _is_noop_slice(src):
            src = src.args[0]
        if not (isinstance(src, torch.fx.Node) and src.target is aten.unsqueeze.default and src.args[1] == 2):
            return node, 1
        x = src.args[0]
        x_shape = _shape(x)
        if len(sizes) == 5 and isinstance(sizes[2], int) and x_shape and len(x_shape) == 4:
            reps = sizes[2]
            if x_shape[1] * reps == shape[1]:
                return x, reps
    return node, 1


def untranspose(node: torch.fx.Node) -> torch.fx.Node | None:
    """``x`` if ``node`` is ``x`` with its last two dims swapped, else None."""
    if node.op != "call_function":
        return None
    shape = _shape(node)
    rank = len(shape) if shape is not None else 4
    if node.target is aten.transpose.int:
        dims = {d % rank for d in node.args[1:3]}
        return node.args[0] if dims == {rank - 2, rank - 1} else None
    if node.target is aten.permute.default:
        perm = [d % rank for d in node.args[1]]
        return node.args[0] if perm == [*range(rank - 2), rank - 1, rank - 2] else None
    if node.target is aten.mT.default:
        return node.args[0]
    return None


# -- evaluating masks -------------------------------------------------------------------------------
class _Masks:
    """Evaluates a mask subgraph at concrete token counts (only shapes/state may feed it)."""

    def __init__(self, program: Program, gm: torch.fx.GraphModule):
        self.program = program
        self.gm = gm
        self.specs = {s.name: s for s in program.inputs}
        self.symbol = None
        self.range = None
        for node in gm.graph.nodes:
            spec = self.specs.get(node.name)
            if node.op == "placeholder" and spec is not None and spec.kind == USER and spec.target == "input_ids":
                val = _val(node)
                if isinstance(val, torch.Tensor) and val.dim() == 2 and isinstance(val.shape[1], torch.SymInt):
                    free = val.shape[1].node.expr.free_symbols
                    if len(free) == 1:
                        self.symbol = next(iter(free))
                        self.range = val.shape[1].node.shape_env.var_to_range.get(self.symbol)

    def token_counts(self) -> tuple[int | None, ...]:
        if self.symbol is None:
            return (None,)  # static trace: evaluate as traced
        lo, hi = 2, 1 << 16
        if self.range is not None:
            lo = max(lo, int(self.range.lower))
            try:
                hi = min(hi, int(self.range.upper))
            except (TypeError, ValueError, AttributeError, OverflowError):
                pass  # unbounded (int_oo)
        counts = [t for t in (5, 8, 3, 2, 13) if lo <= t <= hi]
        return tuple(counts[:2]) or (lo,)

    def concrete(self, value, tokens: int | None):
        if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            expr = sympy.sympify(value.node.expr)
            if tokens is not None and self.symbol is not None:
                expr = sympy.sympify(expr.xreplace({self.symbol: sympy.Integer(tokens)}))
            if expr.free_symbols:
                raise _Refuse(f"depends on a symbolic size {value} other than the token count")
            if isinstance(value, torch.SymBool):
                return bool(expr)
            return float(expr) if isinstance(value, torch.SymFloat) else int(expr)
        return value

    def shape(self, node: torch.fx.Node, tokens: int | None) -> tuple[int, ...]:
        return tuple(int(self.concrete(s, tokens)) for s in node.meta["val"].shape)

    def evaluate(self, node: torch.fx.Node, tokens: int | None) -> object:
        leaves: dict[torch.fx.Node, object] = {}
        needed: set[torch.fx.Node] = set()
        stack = [node]
        while stack:
            n = stack.pop()
            if n in needed or n in leaves:
                continue
            val = _val(n)
            if n.op == "placeholder":
                spec = self.specs.get(n.name)
                if spec is None or spec.kind not in STATE_KINDS:
                    raise _Refuse(f"is computed from the values of input {n.name!r}")
                leaves[n] = self.program.state[spec.target]
            elif isinstance(val, (int, torch.SymInt, torch.SymFloat, torch.SymBool)) and n is not node:
                leaves[n] = self.concrete(val, tokens)
            else:
                needed.add(n)
                stack.extend(n.all_input_nodes)
        sub = torch.fx.Graph()
        env: dict[torch.fx.Node, torch.fx.Node] = {}
        args = []
        for n in self.gm.graph.nodes:  # graph order is a topological order
            if n in leaves:
                env[n] = sub.placeholder(n.name)
                args.append(leaves[n])
            elif n in needed:
                env[n] = sub.node_copy(n, lambda a: env[a])
        sub.output(env[node])
        with torch.no_grad():
            return torch.fx.GraphModule(self.gm, sub)(*args)


class _Refuse(Exception):
    """A reason to refuse, completed with the location by the caller."""


def _causal_problem(kind: str, mask: object, score_shape: tuple[int, ...], fill: object = None) -> str | None:
    """None if ``mask`` (of ``kind``) keeps exactly the causal positions of every [T, T] slice."""
    if not isinstance(mask, torch.Tensor):
        return f"the mask is a {type(mask).__name__}, not a tensor"
    t_q, t_k = score_shape[-2:]
    if t_q != t_k:
        return f"the scores are {t_q}×{t_k}, not square"
    try:
        mask = torch.broadcast_to(mask, score_shape)
    except RuntimeError:
        return f"the mask of shape {tuple(mask.shape)} does not broadcast to the scores {score_shape}"
    if kind == "masked_fill":
        if mask.dtype is not torch.bool:
            return f"masked_fill with a {mask.dtype} mask"
        if not (isinstance(fill, (int, float)) and fill <= _NEG_FILL):
            return f"masked_fill with fill value {fill!r} (needs -inf)"
        keep = ~mask
    elif kind == "where":
        if mask.dtype is not torch.bool:
            return f"where with a {mask.dtype} condition"
        if not (isinstance(fill, (int, float)) and fill <= _NEG_FILL):
            return f"where with fill value {fill!r} (needs -inf)"
        keep = mask
    elif kind == "sdpa":
        if mask.dtype is torch.bool:
            keep = mask
        else:
            kind = "additive"
    if kind == "additive":
        if mask.dtype is torch.bool or not mask.is_floating_point():
            return f"an additive mask of dtype {mask.dtype}"
        keep = mask == 0
        dropped = mask <= _NEG_FILL
        if not bool((keep | dropped).all()):
            bad = mask[~(keep | dropped)][0].item()
            return f"the additive mask holds {bad} (not 0 or -inf): a position bias such as ALiBi?"
    causal = torch.ones(t_q, t_k, dtype=torch.bool).tril()
    if bool((keep == causal).all()):
        return None
    if bool(keep.all()):
        return "the mask masks nothing (bidirectional attention)"
    if bool((keep & ~causal).any()):
        return "the mask lets queries see later positions (non-causal)"
    return "the mask hides positions the causal mask keeps (sliding window, padding or blocks?)"


# -- planning rewrites ------------------------------------------------------------------------------
@dataclass
class _Plan:
    anchor: torch.fx.Node  # insert before; its uses get the result
    q: torch.fx.Node
    k: torch.fx.Node  # not transposed
    k_transposed: bool  # True: ``k`` is kᵀ and must be transposed back
    v: torch.fx.Node
    scale: float
    dead: tuple[torch.fx.Node, ...]  # nodes to erase, users first
    kind: str


def _refuse(node: torch.fx.Node, what: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"{where(node)}: {what}")


def _check_causal(masks: _Masks, at: torch.fx.Node, kind: str, mask: torch.fx.Node,
                  scores: torch.fx.Node | tuple[torch.fx.Node, torch.fx.Node], fill: object = None) -> None:
    for tokens in masks.token_counts():
        try:
            value = masks.evaluate(mask, tokens)
            if isinstance(scores, tuple):  # SDPA: the scores are [B, Hq, Tq, Tk] of (q, k)
                q_shape, k_shape = (masks.shape(x, tokens) for x in scores)
                shape = (*q_shape[:-1], k_shape[-2])
            else:
                shape = masks.shape(scores, tokens)
        except _Refuse as why:
            raise _refuse(at, f"the attention mask {mask.name} {why}; only masks built from shapes, "
                          "buffers and constants can be proven causal") from None
        except Exception as err:
            raise _refuse(at, f"could not evaluate the attention mask {mask.name} "
                          f"({type(err).__name__}: {err})") from err
        problem = _causal_problem(kind, value, shape, fill)
        if problem is not None:
            where_t = f" at {tokens} tokens" if tokens is not None else ""
            raise _refuse(at, f"unsupported attention mask{where_t}: {problem}")


def _heads(q: torch.fx.Node, k: torch.fx.Node, v: torch.fx.Node, at: torch.fx.Node):
    shapes = [_shape(x) for x in (q, k, v)]
    if any(s is None or len(s) != 4 for s in shapes):
        raise _refuse(at, f"attention expects 4-D [batch, heads, tokens, dim] q/k/v, got {shapes}")
    hq, hk, hv = shapes[0][1], shapes[1][1], shapes[2][1]
    if hk != hv or not all(isinstance(h, int) for h in (hq, hk)) or hq % hk:
        raise _refuse(at, f"{hq} query heads with {hk} key / {hv} value heads")
    return shapes


def _gqa_sources(k: torch.fx.Node, v: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node]:
    k_src, k_rep = unrepeat(k)
    v_src, v_rep = unrepeat(v)
    if k_rep == v_rep and k_rep > 1:
        return k_src, v_src
    return k, v


def _plan_sdpa(node: torch.fx.Node, masks: _Masks) -> _Plan:
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    arg = dict(zip(names, (None, None, None, None, 0.0, False, None, False)))
    arg.update(zip(names, node.args))
    arg.update(node.kwargs)
    if node.target is not aten.scaled_dot_product_attention.default:
        raise _refuse(node, f"{node.target} is not supported; trace before decomposition so "
                      "scaled_dot_product_attention stays one op")
    if arg["dropout_p"]:
        raise _refuse(node, f"attention dropout (dropout_p={arg['dropout_p']}) is not supported")
    q, k, v = arg["query"], arg["key"], arg["value"]
    shapes = _heads(q, k, v, node)
    if arg["attn_mask"] is not None:
        _check_causal(masks, node, "sdpa", arg["attn_mask"], (q, k))
    elif not arg["is_causal"]:
        raise _refuse(node, "non-causal scaled_dot_product_attention (is_causal=False, no mask) "
                      "is not supported")
    scale = arg["scale"]
    if scale is None:
        scale = shapes[0][-1] ** -0.5
    if not isinstance(scale, (int, float)):
        raise _refuse(node, f"a scale of type {type(scale).__name__} is not supported")
    k, v = _gqa_sources(k, v)
    return _Plan(node, q, k, False, v, float(scale), (node,), "sdpa")


def _value_matmul(softmax: torch.fx.Node) -> tuple[torch.fx.Node | None, list[torch.fx.Node]]:
    """``(matmul, pass-through chain)`` when softmax flows into a matmul, else ``(None, [])``."""
    chain: list[torch.fx.Node] = []
    node = softmax
    while True:
        users = list(node.users)
        mm = [u for u in users if u.op == "call_function" and u.target in MATMULS]
        if mm:
            return mm[0], chain
        through = [u for u in users if u.op == "call_function" and u.target in PASS_THROUGH]
        if len(through) != 1:
            return None, chain
        node = through[0]
        chain.append(node)


def attention_softmaxes(graph: torch.fx.Graph) -> list[tuple[torch.fx.Node, torch.fx.Node]]:
    """``(softmax, consumer)`` for every softmax whose value reaches a matmul / bmm / einsum
    through pass-through ops only: what this pass calls softmax attention."""
    found = []
    for node in graph.nodes:
        if node.op != "call_function" or node.target not in SOFTMAX:
            continue
        frontier, seen = [node], {node}
        while frontier:
            current = frontier.pop()
            for user in current.users:
                if user in seen or user.op != "call_function":
                    continue
                seen.add(user)
                if user.target in MATMULS:
                    found.append((node, user))
                    frontier = []
                    break
                if user.target in PASS_THROUGH:
                    frontier.append(user)
    return found


def _chain(node: torch.fx.Node, depth: int = 6) -> str:
    """``softmax ← masked_fill ← mul ← tanh ← …``: the ops feeding ``node``, first operand first."""
    names = []
    for _ in range(depth):
        names.append(getattr(node.target, "__name__", str(node.target)).split(".")[0])
        inputs = node.all_input_nodes
        if node.op != "call_function" or not inputs:
            break
        node = inputs[0] if node.target is not aten.where.ScalarOther else node.args[1]
    return " ← ".join(names)


def _plan_softmax(view: nx.DiGraph, softmax: torch.fx.Node, masks: _Masks) -> _Plan:
    pv, chain = _value_matmul(softmax)
    if pv is None or pv.target is not aten.matmul.default:
        raise _refuse(softmax, "softmax attention whose probabilities reach "
                      f"{pv.target if pv is not None else 'a matmul'} through other ops is not "
                      "recognised (expected softmax → casts/dropout → matmul(p, v))")
    matched = match_scores(view, softmax.name)
    if matched is None:
        raise _refuse(softmax, f"unrecognised attention ({_chain(softmax)}): expected softmax "
                      "over matmul(q, kT) [· scale] [+ causal mask]; soft-capping, biases and other "
                      "score transforms are not supported")
    name, roles = matched
    dim = softmax.args[1] if len(softmax.args) > 1 else softmax.kwargs.get("dim")
    rank = len(_shape(softmax) or ())
    if not isinstance(dim, int) or dim % max(rank, 1) != rank - 1:
        raise _refuse(softmax, f"softmax over dim {dim}, not the key dim")
    if pv.args[0] is not (chain[-1] if chain else softmax):
        raise _refuse(pv, "the probabilities are the right operand of the value matmul")
    for node in chain:
        if node.target is aten.dropout.default and node.args[1] and node.args[2]:
            raise _refuse(node, f"attention dropout (p={node.args[1]}) is not supported")
    # Scale.
    scale = 1.0
    if "scale" in roles:
        s = roles["scale"]
        other = [a for a in s.args[:2] if a is not roles["qk"]]
        if len(other) != 1 or not isinstance(other[0], (int, float)):
            raise _refuse(s, f"the attention scores are scaled by {other} (only a constant number "
                          "is supported)")
        if s.target in (aten.div.Tensor, aten.div.Scalar):
            if s.args[0] is not roles["qk"]:
                raise _refuse(s, "the scores divide a constant (expected scores / c)")
            scale = 1.0 / float(other[0])
        else:
            scale = float(other[0])
    # Mask.
    if "masked" not in roles:
        raise _refuse(softmax, f"non-causal attention (no mask between the scores and the "
                      f"softmax; pattern '{name}') is not supported")
    masked, mask = roles["masked"], roles["mask"]
    kind = next(k for k, op in _MASK_OPS.items() if op is not None and masked.target in op[0])
    fill = masked.args[2] if kind in ("masked_fill", "where") else None
    # Escapes: every intermediate's users must be inside the match.
    internal = [roles["qk"], *([roles["scale"]] if "scale" in roles else []), masked, softmax, *chain]
    inside = set(internal) | {pv}
    for node in internal:
        outside = [u.name for u in node.users if u not in inside]
        if outside:
            raise _refuse(node, f"the attention intermediate {node.name} ({node.target}) is also "
                          f"used by {outside} outside the attention; dcpgraph rewrites only whole "
                          "attentions (no partial rewrite)")
    _check_causal(masks, masked, kind, mask, masked, fill)
    q, k_t, v = roles["q"], roles["kT"], pv.args[1]
    k = untranspose(k_t)
    if k is None:  # kT is not a visible transpose: check the shapes of k = kT.mT
        shape = _shape(k_t)
        if shape is None or len(shape) != 4 or _shape(q) is None or len(_shape(q)) != 4:
            raise _refuse(roles["qk"], "attention expects 4-D [batch, heads, tokens, dim] q/k/v")
        k_final, v_final = k_t, v
    else:
        _heads(q, k, v, roles["qk"])
        k_final, v_final = _gqa_sources(k, v)
    dead = (pv, *reversed(chain), softmax, masked, *([roles["scale"]] if "scale" in roles else []), roles["qk"])
    return _Plan(pv, q, k_final, k is None, v_final, scale, dead, "matmul-softmax")


def _apply(graph: torch.fx.Graph, plan: _Plan) -> None:
    with graph.inserting_before(plan.anchor):
        k = plan.k
        if plan.k_transposed:
            k = graph.call_function(aten.transpose.int, (k, -2, -1))
        out = graph.create_node(
            "call_function", dcp_ops.attention.default, (plan.q, k, plan.v, plan.scale, True), name="attention",
        )
        want = _val(plan.anchor)
        have = _val(plan.q)
        if isinstance(want, torch.Tensor) and isinstance(have, torch.Tensor) and want.dtype != have.dtype:
            out = graph.call_function(aten._to_copy.default, (out,), {"dtype": want.dtype})
    out.meta["nn_module_stack"] = plan.anchor.meta.get("nn_module_stack")
    plan.anchor.replace_all_uses_with(out)
    for node in plan.dead:
        if not node.users:
            graph.erase_node(node)


# -- the invariant and the pass ---------------------------------------------------------------------
def raw_attention(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    """SDPA nodes and softmaxes that feed a matmul: attention not in canonical form."""
    sdpa = [n for n in graph.nodes if n.op == "call_function" and n.target in SDPA_FAMILY]
    return sdpa + [s for s, _ in attention_softmaxes(graph)]


def _canonical_only(program: Program) -> None:
    graph = program.graph_module.graph
    left = raw_attention(graph)
    if left:
        raise VerificationError(f"raw attention left after canonicalization: {[n.name for n in left]}")
    for node in nodes_calling(graph, dcp_ops.attention.default):
        q, k, v, _scale, causal = node.args
        if causal is not True:
            raise VerificationError(f"{node.name}: canonical attention must be causal")
        shapes = [_shape(x) for x in (q, k, v)]
        if any(s is None or len(s) != 4 for s in shapes):
            raise VerificationError(f"{node.name}: q/k/v must be 4-D, got {shapes}")
        if shapes[0][1] % shapes[1][1] or shapes[1][1] != shapes[2][1]:
            raise VerificationError(f"{node.name}: {shapes[0][1]} query heads vs {shapes[1][1]} KV heads")


@program_pass("canonicalize_attention", ensures=[_canonical_only])
def canonicalize_attention(program: Program):
    gm = program.copy_graph()
    graph = gm.graph
    masks = _Masks(program, gm)
    view = graph_view(graph)
    plans: list[_Plan] = []
    for node in graph.nodes:  # plan everything first (read-only), then rewrite
        if node.op == "call_function" and node.target in SDPA_FAMILY:
            plans.append(_plan_sdpa(node, masks))
    for softmax, _consumer in attention_softmaxes(graph):
        plans.append(_plan_softmax(view, softmax, masks))
    claimed: dict[torch.fx.Node, _Plan] = {}
    for plan in plans:
        for node in plan.dead:
            if node in claimed:
                raise _refuse(node, "two attention patterns overlap here")
            claimed[node] = plan
    for plan in plans:
        _apply(graph, plan)
    inputs = program.inputs
    if plans:
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
    for plan in plans:
        counts[plan.kind] = counts.get(plan.kind, 0) + 1
    total = len(nodes_calling(graph, dcp_ops.attention.default))
    done = ", ".join(f"{v} {k}" for k, v in sorted(counts.items())) or "nothing to rewrite"
    state = {s.target: program.state[s.target] for s in inputs if s.target in program.state}
    return (
        program.replace(graph_module=gm, inputs=inputs, state=state),
        f"{done}; {total} dcpgraph.attention nodes",
    )


def _original_users(program: Program, name: str) -> list[torch.fx.Node]:
    node = next(n for n in program.graph_module.graph.nodes if n.op == "placeholder" and n.name == name)
    return list(node.users)


__all__ = [
    "attention_softmaxes", "canonicalize_attention", "graph_view", "match_scores", "raw_attention",
    "unrepeat", "untranspose", "where",
]

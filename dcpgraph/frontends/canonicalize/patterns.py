"""Recognising attention in a traced graph: the SDPA ops, and softmax attention written by hand.

Softmax attention is a softmax whose value reaches a matmul / bmm / einsum through pass-through
ops only (:func:`attention_softmaxes`). What feeds that softmax is matched against the score
patterns: each is the Python function it matches, ``softmax(mask(scale(q @ kT), m), -1)`` for
every scale step (none, ``s * c``, ``s / c``) and mask step (none, ``masked_fill``, ``+ m``,
``where``), traced once with ``make_fx(pre_dispatch=True)`` into the aten IR ``torch.export``
produces, the way inductor's ``register_replacement`` turns a search function into a pattern.

Matching (:func:`match_scores`) walks backwards from the softmax through the pattern graph's
operands, most specific pattern (most ops) first. Invariants:

- a pattern op matches a host ``call_function`` of the same target, or of the same family
  (``mul.Tensor``/``mul.Scalar``, ``div.Tensor``/``div.Scalar``, the softmax variants);
- node operands match position by position, either order for ``add``/``mul``; literal operands
  (the scale constant, the fill value, the softmax dim) are not compared here: the rewrite
  checks them and refuses with a reason;
- a placeholder (``q``, ``kT``, ``mask``) binds any node, and the binding is one-to-one: distinct
  pattern nodes bind distinct host nodes (a subgraph monomorphism, anchored at the softmax).

A graph pattern matcher (networkx's ``DiGraphMatcher``) would find the same matches: the
patterns are trees anchored at one node, so a walk over operands is the whole search.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.fx

aten = torch.ops.aten

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


# -- the score patterns, as code --------------------------------------------------------------------
# scale step -> s ↦ scaled s. The constants only shape the trace: literals are not matched.
SCALE_STEPS: dict[str | None, Callable] = {
    "mul": lambda s: s * 0.125,
    "div": lambda s: s / 8.0,
    None: lambda s: s,
}
# mask step -> ((s, m) ↦ masked s, dtype of the example mask).
MASK_STEPS: dict[str | None, tuple[Callable, torch.dtype]] = {
    "masked_fill": (lambda s, m: s.masked_fill(m, float("-inf")), torch.bool),
    "additive": (lambda s, m: s + m, torch.float32),
    "where": (lambda s, m: torch.where(m, s, float("-inf")), torch.bool),
    None: (lambda s, m: s, torch.bool),
}


def _score_function(scale: Callable, mask: Callable) -> Callable:
    def scores(q, kT, mask_):
        return torch.softmax(mask(scale(torch.matmul(q, kT)), mask_), -1)

    return scores


# Role of each pattern op in the match (placeholders take their parameter's name).
_ROLES = {
    aten.matmul.default: "qk",
    aten.mul.Tensor: "scale",
    aten.div.Tensor: "scale",
    aten.masked_fill.Scalar: "masked",
    aten.add.Tensor: "masked",
    aten.where.ScalarOther: "masked",
    aten.softmax.int: "softmax",
}
_PLACEHOLDER_ROLES = ("q", "kT", "mask")
_FAMILIES = (
    frozenset({aten.mul.Tensor, aten.mul.Scalar}),
    frozenset({aten.div.Tensor, aten.div.Scalar}),
    SOFTMAX,
)
_COMMUTATIVE = frozenset({aten.add.Tensor, aten.mul.Tensor, aten.mul.Scalar})


@dataclass(frozen=True)
class ScorePattern:
    """One traced score function; ``root`` is its softmax node, ``roles`` names its nodes."""

    name: str
    scale: str | None  # "mul", "div" or None
    mask: str | None  # "masked_fill", "additive", "where" or None
    graph: torch.fx.Graph
    root: torch.fx.Node
    roles: dict[torch.fx.Node, str]

    @property
    def num_ops(self) -> int:
        return sum(1 for n in self.graph.nodes if n.op == "call_function")


@dataclass(frozen=True)
class ScoreMatch:
    """A pattern matched at a softmax: role (``q``, ``kT``, ``mask``, ``qk``, ``scale``,
    ``masked``, ``softmax``; only those the pattern has) → host node."""

    pattern: ScorePattern
    roles: dict[str, torch.fx.Node]


def _trace(name: str, scale: str | None, mask: str | None) -> ScorePattern:
    from torch.fx.experimental.proxy_tensor import make_fx

    mask_step, mask_dtype = MASK_STEPS[mask]
    fn = _score_function(SCALE_STEPS[scale], mask_step)
    cpu = {"device": "cpu"}  # explicit, whatever default device or dtype the caller has set
    example = (
        torch.zeros(1, 2, 4, 8, dtype=torch.float32, **cpu),
        torch.zeros(1, 2, 8, 4, dtype=torch.float32, **cpu),
        torch.zeros(4, 4, dtype=mask_dtype, **cpu),
    )
    graph = make_fx(fn, pre_dispatch=True)(*example).graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if not len(placeholders) == len(inspect.signature(fn).parameters) == len(_PLACEHOLDER_ROLES):
        raise AssertionError(f"score pattern {name!r} traced to placeholders {placeholders}")
    roles = dict(zip(placeholders, _PLACEHOLDER_ROLES))
    for node in graph.nodes:
        if node.op == "call_function":
            if node.target not in _ROLES:
                raise AssertionError(f"score pattern {name!r} traced to an unexpected op {node.target}")
            roles[node] = _ROLES[node.target]
    root = next(n for n in graph.nodes if n.op == "output").args[0]
    return ScorePattern(name, scale, mask, graph, root, roles)


@functools.cache
def score_patterns() -> tuple[ScorePattern, ...]:
    """Every scale × mask pattern, traced once per process, most ops first."""
    out = []
    for scale in SCALE_STEPS:
        for mask in MASK_STEPS:
            name = f"{f'{scale}-scaled ' if scale else ''}{mask or 'unmasked'}"
            out.append(_trace(name, scale, mask))
    out.sort(key=lambda p: -p.num_ops)  # stable: scale/mask table order breaks ties
    return tuple(out)


# -- matching ---------------------------------------------------------------------------------------
def _accepts(target) -> frozenset:
    for family in _FAMILIES:
        if target in family:
            return family
    return frozenset({target})


def _operand_orders(pattern_node: torch.fx.Node, host: torch.fx.Node) -> list[tuple]:
    args = tuple(host.args)
    if pattern_node.target in _COMMUTATIVE and len(args) >= 2:
        return [args, (args[1], args[0], *args[2:])]
    return [args]


def _bind(pattern_node: torch.fx.Node, host: torch.fx.Node,
          binding: dict[torch.fx.Node, torch.fx.Node]) -> dict[torch.fx.Node, torch.fx.Node] | None:
    """``binding`` extended so ``pattern_node`` (and its operands) bind ``host``, or None."""
    if pattern_node in binding:
        return binding if binding[pattern_node] is host else None
    if any(bound is host for bound in binding.values()):
        return None  # one host node per pattern node
    if pattern_node.op == "placeholder":
        return {**binding, pattern_node: host}
    if host.op != "call_function" or host.target not in _accepts(pattern_node.target):
        return None
    start = {**binding, pattern_node: host}
    for host_args in _operand_orders(pattern_node, host):
        trial: dict | None = start
        for i, operand in enumerate(pattern_node.args):
            if not isinstance(operand, torch.fx.Node):
                continue  # a literal: checked by the rewrite, not here
            host_arg = host_args[i] if i < len(host_args) else None
            if not isinstance(host_arg, torch.fx.Node):
                trial = None
                break
            trial = _bind(operand, host_arg, trial)
            if trial is None:
                break
        if trial is not None:
            return trial
    return None


def match_scores(softmax: torch.fx.Node) -> ScoreMatch | None:
    """The first score pattern (most ops first) whose softmax binds ``softmax``, or None."""
    for pattern in score_patterns():
        binding = _bind(pattern.root, softmax, {})
        if binding is not None:
            return ScoreMatch(pattern, {pattern.roles[p]: h for p, h in binding.items()})
    return None


def describe_score_chain(node: torch.fx.Node, depth: int = 6) -> str:
    """``softmax ← masked_fill ← mul ← tanh ← …``: the ops feeding ``node``, scores first."""
    names = []
    for _ in range(depth):
        names.append(getattr(node.target, "__name__", str(node.target)).split(".")[0])
        inputs = node.all_input_nodes
        if node.op != "call_function" or not inputs:
            break
        node = inputs[0] if node.target is not aten.where.ScalarOther else node.args[1]
    return " ← ".join(names)


# -- softmax attention and the value side -----------------------------------------------------------
def value_matmul(softmax: torch.fx.Node) -> tuple[torch.fx.Node | None, list[torch.fx.Node]]:
    """``(matmul, pass-through chain)`` when softmax flows into a matmul through a single chain
    of pass-through ops, else ``(None, chain so far)``."""
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
    through pass-through ops only: what counts as softmax attention."""
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


def raw_attention(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    """SDPA nodes and softmaxes that feed a matmul: attention not in canonical form."""
    sdpa = [n for n in graph.nodes if n.op == "call_function" and n.target in SDPA_FAMILY]
    return sdpa + [s for s, _ in attention_softmaxes(graph)]

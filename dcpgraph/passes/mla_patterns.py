"""The MLA preprocess patterns, and a strict matcher of traced patterns against a program's graph.

Each pattern is :func:`dcpgraph.ops.mla_preprocess.mla_preprocess_math` for one variant (with or
without ``q_lora_rank``, one of the rotary kinds), traced with ``make_fx(pre_dispatch=True)`` into
the aten IR ``torch.export`` produces, on example tensors shaped like the layer being matched (its
token count, hidden size, local heads, dims, dtype). The norms' epsilons are traced as sentinel
values that capture the host's literal.

Matching (:func:`bind_outputs`) walks backwards from the pattern's outputs through operands.
Invariants:

- a pattern ``call_function`` binds a host node of the very same target (no op families), with
  ``add``/``mul`` operands in either order;
- every literal operand and keyword is compared: equal values, except an epsilon sentinel (captured,
  and the same host value wherever the sentinel recurs) and an int of the pattern matched by a host
  node whose value is that int (a symbolic size such as the token count);
- a placeholder binds any host node; the binding is one-to-one (distinct pattern nodes bind
  distinct host nodes).

:func:`interior_escapes` then names the matched nodes other than the outputs that something outside
the match reads: fusing those would compute them twice (the pass refuses).
"""

from __future__ import annotations

import functools
import numbers
from dataclasses import dataclass

import torch
import torch.fx

from ..ops.mla_preprocess import ROTARY_KINDS, mla_preprocess_math

aten = torch.ops.aten
EPS_SENTINELS = {"q_eps": 1.2345678901e-7, "kv_eps": 8.7654321098e-7}
_COMMUTATIVE = frozenset({aten.add.Tensor, aten.mul.Tensor})
OUTPUTS = ("q_lat", "kv", "q_c")


@dataclass(frozen=True)
class LayerShape:
    """What a pattern is traced for: sizes of one layer as the host graph holds them."""

    tokens: int
    hidden: int
    heads: int  # local query heads (after TP)
    nope: int
    rope: int
    rank: int  # kv_lora_rank
    q_lora_rank: int | None
    dtype: torch.dtype
    rotary_dtype: torch.dtype  # cos/sin dtype, or the complex dtype of freqs


@dataclass(frozen=True)
class Pattern:
    """A traced variant: ``inputs`` names its placeholders (op argument names), ``outputs`` maps
    ``q_lat``/``kv``/``q_c`` to pattern nodes (``q_c`` absent without ``q_lora_rank``)."""

    rotary_kind: str
    graph: torch.fx.Graph
    inputs: dict[torch.fx.Node, str]
    outputs: dict[str, torch.fx.Node]

    @property
    def num_ops(self) -> int:
        return sum(1 for n in self.graph.nodes if n.op == "call_function")


def _arg_names(q_lora: bool, rotary_kind: str) -> list[str]:
    names = ["x", *(["q_a_weight", "q_a_norm_weight"] if q_lora else []), "q_b_weight", "kv_a_weight",
             "kv_norm_weight", "w_uk", "rotary"]
    return names + ([] if rotary_kind == "complex" else ["rotary_sin"])


@functools.lru_cache(maxsize=64)
def trace_pattern(shape: LayerShape, rotary_kind: str) -> Pattern:
    """The variant for ``shape`` (q_lora or not from ``shape.q_lora_rank``) and ``rotary_kind``."""
    from torch.fx.experimental.proxy_tensor import make_fx

    if rotary_kind not in ROTARY_KINDS:
        raise ValueError(f"rotary_kind must be one of {list(ROTARY_KINDS)}, got {rotary_kind!r}")
    q_lora = shape.q_lora_rank is not None
    names = _arg_names(q_lora, rotary_kind)
    s, opts = shape, {"dtype": shape.dtype, "device": "cpu"}
    q_in = s.q_lora_rank if q_lora else s.hidden
    rot_dim = s.rope // 2 if rotary_kind == "complex" else s.rope
    examples = {
        "x": torch.zeros(1, s.tokens, s.hidden, **opts),
        "q_a_weight": torch.zeros(q_in, s.hidden, **opts),
        "q_a_norm_weight": torch.zeros(q_in, **opts),
        "q_b_weight": torch.zeros(s.heads * (s.nope + s.rope), q_in, **opts),
        "kv_a_weight": torch.zeros(s.rank + s.rope, s.hidden, **opts),
        "kv_norm_weight": torch.zeros(s.rank, **opts),
        "w_uk": torch.zeros(s.heads, s.nope, s.rank, **opts),
        "rotary": torch.zeros(1, s.tokens, rot_dim, dtype=s.rotary_dtype, device="cpu"),
        "rotary_sin": torch.zeros(1, s.tokens, rot_dim, dtype=s.rotary_dtype, device="cpu"),
    }

    def pattern(*args):
        given = dict(zip(names, args))
        q_lat, kv, q_c = mla_preprocess_math(
            given["x"], given.get("q_a_weight"), given.get("q_a_norm_weight"), given["q_b_weight"],
            given["kv_a_weight"], given["kv_norm_weight"], given["w_uk"], given["rotary"], given.get("rotary_sin"),
            EPS_SENTINELS["q_eps"], EPS_SENTINELS["kv_eps"], rotary_kind,
        )
        return (q_lat, kv) if q_c is None else (q_lat, kv, q_c)

    graph = make_fx(pattern, pre_dispatch=True)(*(examples[n] for n in names)).graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    returned = next(n for n in graph.nodes if n.op == "output").args[0]
    return Pattern(rotary_kind, graph, dict(zip(placeholders, names)), dict(zip(OUTPUTS, returned)))


@dataclass
class _State:
    binding: dict  # pattern node -> host node
    captured: dict  # sentinel name -> host literal

    def copy(self) -> _State:
        return _State(dict(self.binding), dict(self.captured))


def _literal_matches(p, h, state: _State) -> bool:
    for name, sentinel in EPS_SENTINELS.items():
        if isinstance(p, float) and p == sentinel:
            if not isinstance(h, numbers.Real) or isinstance(h, bool):
                return False
            if state.captured.setdefault(name, float(h)) != float(h):
                return False
            return True
    if isinstance(h, torch.fx.Node):  # a symbolic size standing for the pattern's int
        value = h.meta.get("val")
        return isinstance(p, int) and not isinstance(p, bool) and isinstance(value, (int, torch.SymInt)) \
            and int(value) == p
    return type(p) is type(h) and p == h


def _bind_arg(p, h, state: _State) -> _State | None:
    if isinstance(p, torch.fx.Node):
        return _bind(p, h, state) if isinstance(h, torch.fx.Node) else None
    if isinstance(p, (list, tuple)):
        if not isinstance(h, (list, tuple)) or len(p) != len(h):
            return None
        for pi, hi in zip(p, h):
            state = _bind_arg(pi, hi, state)
            if state is None:
                return None
        return state
    if isinstance(p, dict):
        if not isinstance(h, dict) or set(p) != set(h):
            return None
        for key in p:
            state = _bind_arg(p[key], h[key], state)
            if state is None:
                return None
        return state
    return state if _literal_matches(p, h, state) else None


def _bind(p: torch.fx.Node, h: torch.fx.Node, state: _State) -> _State | None:
    if p in state.binding:
        return state if state.binding[p] is h else None
    if any(bound is h for bound in state.binding.values()):
        return None
    if p.op == "placeholder":
        state = state.copy()
        state.binding[p] = h
        return state
    if h.op != "call_function" or h.target is not p.target or len(h.args) != len(p.args):
        return None
    orders = [tuple(h.args)]
    if p.target in _COMMUTATIVE:
        orders.append((h.args[1], h.args[0], *h.args[2:]))
    for args in orders:
        trial = state.copy()
        trial.binding[p] = h
        trial = _bind_arg(tuple(p.args), args, trial)
        if trial is not None:
            trial = _bind_arg(dict(p.kwargs), dict(h.kwargs), trial)
        if trial is not None:
            return trial
    return None


@dataclass(frozen=True)
class Match:
    pattern: Pattern
    binding: dict  # pattern node -> host node
    captured: dict  # "q_eps"/"kv_eps" -> float

    def host(self, output: str) -> torch.fx.Node | None:
        node = self.pattern.outputs.get(output)
        return None if node is None else self.binding[node]

    def argument(self, name: str) -> torch.fx.Node | None:
        """The host node bound to the pattern input ``name`` (None if the variant has none)."""
        return next((self.binding[p] for p, n in self.pattern.inputs.items() if n == name), None)


def bind_outputs(pattern: Pattern, hosts: dict[str, torch.fx.Node], start: Match | None = None) -> Match | None:
    """Bind the pattern's ``outputs`` named in ``hosts`` to those host nodes (in order), extending
    ``start``; None when any does not bind."""
    state = _State(dict(start.binding), dict(start.captured)) if start else _State({}, {})
    for name, host in hosts.items():
        state = _bind(pattern.outputs[name], host, state)
        if state is None:
            return None
    return Match(pattern, state.binding, state.captured)


def interior_escapes(match: Match) -> list[torch.fx.Node]:
    """Matched host nodes, other than the outputs, read by a node outside the match."""
    matched = {h for p, h in match.binding.items() if p.op == "call_function"}
    outputs = {match.binding[p] for p in match.pattern.outputs.values()}
    return [h for h in matched - outputs if any(u not in matched for u in h.users)]

"""Proving an attention mask causal by evaluating it.

A mask is never assumed causal from how it is written. :class:`MaskEvaluator` cuts the mask's
subgraph out of the traced graph and runs it at concrete token counts; :func:`causal_problem`
compares the value with the causal mask. Invariants:

- a mask subgraph may read only shapes, parameters, buffers and constants: one that reads the
  value of a user input (``position_ids``, say) raises :class:`MaskRefusal`, since no finite set
  of evaluations proves it causal for every input;
- a symbolic size is substituted only for the one token-count symbol of ``input_ids``; any other
  free symbol is a refusal;
- with a dynamic token count the mask is evaluated at two counts inside export's inferred range
  (one if the range allows only one), with a static trace at the traced size;
- "kept" positions are: ``~m`` for ``masked_fill(s, m, fill)``, ``m`` for ``where(m, s, fill)``
  and a boolean SDPA mask, ``m == 0`` for an additive mask. A finite fill or additive value counts
  as −inf only if it is ≤ ``NEG_FILL`` (−1e9: ``exp`` of it underflows to exactly 0); an additive
  mask holding anything other than 0 or ≤ −1e9 is a position bias and is refused;
- causal means every broadcast ``[T, T]`` slice keeps exactly ``tril(ones(T, T))``.
"""

from __future__ import annotations

import sympy
import torch
import torch.fx

from ...program import STATE_KINDS, USER, Program
from .nodes import example_value, refuse

NEG_FILL = -1e9  # a finite fill at most this is as good as -inf (exp underflows to exactly 0)
MASK_KINDS = ("masked_fill", "where", "additive", "sdpa")

_SAMPLE_TOKENS = (5, 8, 3, 2, 13)  # tried in this order; the first two inside the range are used


class MaskRefusal(Exception):
    """Why a mask cannot be evaluated; the caller adds the location."""


class MaskEvaluator:
    """Evaluates mask subgraphs of ``gm`` (a copy of ``program``'s graph) at a token count."""

    def __init__(self, program: Program, gm: torch.fx.GraphModule):
        self.program = program
        self.gm = gm
        self.specs = {s.name: s for s in program.inputs}
        self.symbol = None  # the token-count symbol of input_ids, if the trace is dynamic
        self.range = None
        for node in gm.graph.nodes:
            spec = self.specs.get(node.name)
            if node.op == "placeholder" and spec is not None and spec.kind == USER and spec.target == "input_ids":
                val = example_value(node)
                if isinstance(val, torch.Tensor) and val.dim() == 2 and isinstance(val.shape[1], torch.SymInt):
                    free = val.shape[1].node.expr.free_symbols
                    if len(free) == 1:
                        self.symbol = next(iter(free))
                        self.range = val.shape[1].node.shape_env.var_to_range.get(self.symbol)

    def token_counts(self) -> tuple[int | None, ...]:
        """The token counts to evaluate at; ``(None,)`` for a static trace (as traced)."""
        if self.symbol is None:
            return (None,)
        lo, hi = 2, 1 << 16
        if self.range is not None:
            lo = max(lo, int(self.range.lower))
            try:
                hi = min(hi, int(self.range.upper))
            except (TypeError, ValueError, AttributeError, OverflowError):
                pass  # unbounded (int_oo)
        counts = [t for t in _SAMPLE_TOKENS if lo <= t <= hi]
        return tuple(counts[:2]) or (lo,)

    def concrete(self, value, tokens: int | None):
        """``value`` with the token-count symbol replaced by ``tokens`` (plain values unchanged)."""
        if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            expr = sympy.sympify(value.node.expr)
            if tokens is not None and self.symbol is not None:
                expr = sympy.sympify(expr.xreplace({self.symbol: sympy.Integer(tokens)}))
            if expr.free_symbols:
                raise MaskRefusal(f"depends on a symbolic size {value} other than the token count")
            if isinstance(value, torch.SymBool):
                return bool(expr)
            return float(expr) if isinstance(value, torch.SymFloat) else int(expr)
        return value

    def shape(self, node: torch.fx.Node, tokens: int | None) -> tuple[int, ...]:
        """The concrete shape of ``node`` at ``tokens`` tokens."""
        return tuple(int(self.concrete(s, tokens)) for s in node.meta["val"].shape)

    def evaluate(self, node: torch.fx.Node, tokens: int | None) -> object:
        """The value of ``node`` at ``tokens`` tokens, computed from state and sizes only."""
        leaves: dict[torch.fx.Node, object] = {}
        needed: set[torch.fx.Node] = set()
        stack = [node]
        while stack:
            n = stack.pop()
            if n in needed or n in leaves:
                continue
            val = example_value(n)
            if n.op == "placeholder":
                spec = self.specs.get(n.name)
                if spec is None or spec.kind not in STATE_KINDS:
                    raise MaskRefusal(f"is computed from the values of input {n.name!r}")
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


def causal_problem(kind: str, mask: object, score_shape: tuple[int, ...], fill: object = None) -> str | None:
    """None if ``mask`` (used as ``kind``, one of :data:`MASK_KINDS`) keeps exactly the causal
    positions of every ``[T, T]`` slice of scores shaped ``score_shape``; else what is wrong."""
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
        if not (isinstance(fill, (int, float)) and fill <= NEG_FILL):
            return f"masked_fill with fill value {fill!r} (needs -inf)"
        keep = ~mask
    elif kind == "where":
        if mask.dtype is not torch.bool:
            return f"where with a {mask.dtype} condition"
        if not (isinstance(fill, (int, float)) and fill <= NEG_FILL):
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
        dropped = mask <= NEG_FILL
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


def check_causal(masks: MaskEvaluator, at: torch.fx.Node, kind: str, mask: torch.fx.Node,
                 scores: torch.fx.Node | tuple[torch.fx.Node, torch.fx.Node], fill: object = None) -> None:
    """Raise :class:`~dcpgraph.errors.UnsupportedModelError` at ``at`` unless ``mask`` is causal at
    every token count of ``masks``. ``scores`` is the scores node, or SDPA's ``(q, k)`` whose
    scores are ``[B, Hq, Tq, Tk]``."""
    for tokens in masks.token_counts():
        try:
            value = masks.evaluate(mask, tokens)
            if isinstance(scores, tuple):
                q_shape, k_shape = (masks.shape(x, tokens) for x in scores)
                shape = (*q_shape[:-1], k_shape[-2])
            else:
                shape = masks.shape(scores, tokens)
        except MaskRefusal as why:
            raise refuse(at, f"the attention mask {mask.name} {why}; only masks built from shapes, "
                         "buffers and constants can be proven causal") from None
        except Exception as err:
            raise refuse(at, f"could not evaluate the attention mask {mask.name} "
                         f"({type(err).__name__}: {err})") from err
        problem = causal_problem(kind, value, shape, fill)
        if problem is not None:
            at_tokens = f" at {tokens} tokens" if tokens is not None else ""
            raise refuse(at, f"unsupported attention mask{at_tokens}: {problem}")

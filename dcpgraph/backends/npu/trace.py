"""Replace one node by a torch function traced on its inputs (inductor's ``replace_by_example``).

The function is traced with ``make_fx(pre_dispatch=True)``, so it is recorded as the aten ops it
calls (``reshape``, ``where.ScalarOther``, ``to.dtype``…), not their lower-level decompositions,
except for the ``decompositions`` given (ops GE cannot convert). Every tensor input is a fake
tensor whose every dimension is a fresh symbol (no duck sizing, no 0/1 specialisation): the
traced graph is generic in every size the function does not fix itself (``-1``, ``flatten``,
``reshape_as``), since the example shapes in ``meta['val']`` are not the shapes a compiled step
runs with. Constant arguments (scales, flags, ``None``) and the rule's params stay Python values.

Invariants of the splice: the traced nodes go right before the replaced node; each of its
``getitem`` users is routed to the matching traced result, which takes over that user's
``meta['val']`` after checking its dtype and shape agree; no traced node creates a tensor on a
fixed device (new tensors derive theirs from an input, since programs are traced on CPU).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

from ...passes.graph_edit import getitem_users
from .rules import NpuLoweringError, value_of


class LoweringTracer:
    """Traces ``fn(*node.args, **params)``; the traced graph's placeholders are ``node``'s tensor
    arguments, in order. Calls that differ only in which nodes they read (the same op in every
    layer) share one trace: the key is the function, the params, the constant arguments and each
    tensor argument's shape, stride and dtype."""

    def __init__(self, decompositions: Mapping):
        self.decompositions = dict(decompositions)
        self._traced: dict[tuple, torch.fx.GraphModule] = {}

    def __call__(self, fn: Callable, node: torch.fx.Node,
                 params: Mapping) -> tuple[torch.fx.GraphModule, list[torch.fx.Node]]:
        tensor_args = [a for a in node.args if isinstance(a, torch.fx.Node)]
        key = (fn, tuple(sorted(params.items())), *(_signature(a) for a in node.args))
        if key not in self._traced:
            self._traced[key] = self._trace(fn, node.args, [value_of(a) for a in tensor_args], params)
        return self._traced[key], tensor_args

    def _trace(self, fn, node_args, values, params) -> torch.fx.GraphModule:
        mode = FakeTensorMode(shape_env=ShapeEnv(duck_shape=False, specialize_zero_one=False))
        mode.cache_enabled = False  # a one-off trace: filling the fake-kernel cache costs more than it saves

        def symbolic(value: torch.Tensor) -> torch.Tensor:
            dynamic = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC] * value.dim())
            return mode.from_tensor(value, symbolic_context=dynamic)

        def call(*tensors):
            given = iter(tensors)
            args = [next(given) if isinstance(a, torch.fx.Node) else a for a in node_args]
            return fn(*args, **params)

        fakes = [symbolic(v) for v in values]
        with mode:
            return make_fx(call, self.decompositions, tracing_mode="real", pre_dispatch=True)(*fakes)


def _signature(arg) -> object:
    if isinstance(arg, torch.fx.Node):
        value = value_of(arg)
        return (tuple(value.shape), value.stride(), value.dtype)
    return arg


def splice(graph: torch.fx.Graph, node: torch.fx.Node, traced: torch.fx.GraphModule,
           inputs: list[torch.fx.Node], label: str) -> list[torch.fx.Node]:
    """Insert ``traced`` before ``node``, route ``node``'s users to its results, erase ``node``.

    Returns the inserted nodes. ``label`` (the rule's name) goes into error messages.
    """
    placeholders = [n for n in traced.graph.nodes if n.op == "placeholder"]
    value_map = dict(zip(placeholders, inputs, strict=True))
    with graph.inserting_before(node):
        result = graph.graph_copy(traced.graph, value_map)
    inserted = [value_map[n] for n in traced.graph.nodes if n.op not in ("placeholder", "output")]
    for new in inserted:
        if new.kwargs.get("device") is not None:
            raise NpuLoweringError(f"{label}: {new.target} creates a tensor on a fixed device "
                                   f"({new.kwargs['device']}); derive it from an input instead")
    traced_vals = {value_map[n]: n.meta.get("val") for n in traced.graph.nodes if n in value_map}
    for new in inserted:
        new.meta = {"lowered_from": node.name}
    results = result if isinstance(result, (tuple, list)) else (result,)
    if isinstance(node.meta.get("val"), torch.Tensor):  # a single-tensor op: its users read it directly
        (target,) = results
        _check_same(label, node, traced_vals.get(target), node.meta["val"])
        target.meta["val"] = node.meta["val"]
        node.replace_all_uses_with(target)
        graph.erase_node(node)
        return inserted
    try:
        users = getitem_users(node)
    except ValueError as err:
        raise NpuLoweringError(str(err)) from err
    for index, getitems in users.items():
        target = results[index] if index < len(results) else None
        if target is None:
            raise NpuLoweringError(f"{node.name}[{index}] is used but {label} does not produce it")
        for user in getitems:
            if target in inserted:
                _check_same(label, user, traced_vals.get(target), user.meta.get("val"))
                target.meta["val"] = user.meta.get("val")
            user.replace_all_uses_with(target)
            graph.erase_node(user)
    graph.erase_node(node)
    return inserted


def _check_same(label: str, user: torch.fx.Node, got, want) -> None:
    """The traced result matches what the op gave (dtype, and shape at the example's sizes)."""
    if not isinstance(want, torch.Tensor) or not isinstance(got, torch.Tensor):
        return
    shape = tuple(d.node.hint if isinstance(d, torch.SymInt) else d for d in got.shape)
    if got.dtype != want.dtype or shape != tuple(want.shape):
        raise NpuLoweringError(f"{label} gives {user.name} as {got.dtype}{list(shape)}, the op "
                               f"as {want.dtype}{list(want.shape)}")

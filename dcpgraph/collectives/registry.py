"""The ``_c10d_functional`` collectives of a dcpgraph graph, each described once.

One :class:`Collective` per op holds everything the rest of dcpgraph knows about it:

- ``op``: the ``torch.ops._c10d_functional`` overload that sits in the graph;
- ``layout``: the op's schema parameter names in order. Every ``params`` tuple in this package is
  in this order with defaults filled in (:func:`bind`); ``group_name`` is always last, and
  ``group_size``, where the op has one, sits at ``size_index``. Checked against torch's schema at
  import, so a torch that changes the layout fails loudly here instead of mis-reading graphs;
- ``emit_args``: how a pass inserts it, ``emit_args(x, group_size, group_name) -> node args``;
  :meth:`Collective.emit` adds the call and the ``wait_tensor`` that completes it;
- ``emulate``: its exact semantics over one group: each member's ``params`` in group-rank order
  in, each member's result out (run by :mod:`dcpgraph.runtime.emulator`). Members whose calls
  cannot complete together (what hangs or corrupts data on real hardware) raise
  :class:`GroupMismatch`;
- ``display`` and ``details``: how :mod:`dcpgraph.explain` prints a call (``all_gather[dcp, 2]``).

Emulated semantics for a group of ``n`` members with inputs ``x_0 … x_{n-1}`` (group-rank order)
and ``s = ((x_0 ∘ x_1) ∘ x_2) ∘ …`` for the reduce op ``∘``:

- ``all_gather_into_tensor(x, n, g)``: every member gets ``cat([x_0, …, x_{n-1}], dim 0)``;
- ``reduce_scatter_tensor(x, op, n, g)``: member ``i`` gets chunk ``i`` of ``s`` cut into ``n``
  equal chunks along dim 0;
- ``all_reduce(x, op, g)``: every member gets ``s``;
- ``all_to_all_single(x, out_splits, in_splits, g)``: member ``i`` cuts ``x_i`` along dim 0 into
  pieces of ``in_splits`` rows; member ``j`` gets ``cat([piece j of x_0, …, piece j of x_{n-1}])``,
  whose row counts must be its ``out_splits``. Both ``None``: equal splits.

Reductions run in group-rank order, so results are deterministic run to run (a backend that
reduces in another order may differ in the last bit). Every result is a fresh contiguous tensor
that no other member shares.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx

from .groups import group_name

__all__ = [
    "ALL_GATHER",
    "ALL_REDUCE",
    "ALL_TO_ALL",
    "COLLECTIVES",
    "REDUCE_OPS",
    "REDUCE_SCATTER",
    "WAIT",
    "Collective",
    "GroupMismatch",
    "bind",
    "collective_name",
    "collective_of",
    "reduce_in_rank_order",
]

NAMESPACE = "_c10d_functional"
_c10d = torch.ops._c10d_functional
WAIT = _c10d.wait_tensor.default  # completes a collective; returns its input
REDUCE_OPS = ("sum", "avg", "product", "min", "max", "band", "bor", "bxor")


class GroupMismatch(Exception):
    """The members of one group called a collective in ways that cannot complete together.

    ``what`` says what differs; ``values``, if given, holds one value per member concerned;
    ``members`` are the group-rank indices concerned (``None``: all of them, in order).
    """

    def __init__(
        self, what: str, values: Sequence[object] | None = None, members: Sequence[int] | None = None
    ) -> None:
        super().__init__(what)
        self.what, self.values, self.members = what, values, members


@dataclass(frozen=True)
class Collective:
    """One ``_c10d_functional`` collective (see the module docstring for each field)."""

    op: torch._ops.OpOverload
    layout: tuple[str, ...]
    display: str
    emit_args: Callable[[Any, int | None, str], tuple]
    emulate: Callable[[Sequence[tuple]], list[torch.Tensor]]
    details: Callable[[tuple], list[str]]
    size_index: int | None = field(init=False)
    group_index: int = field(init=False)

    def __post_init__(self) -> None:
        schema = tuple(a.name for a in self.op._schema.arguments)
        if schema != self.layout or self.layout[-1] != "group_name":
            raise RuntimeError(
                f"{self.op._schema} no longer has the parameters {self.layout} dcpgraph relies on"
            )
        size = self.layout.index("group_size") if "group_size" in self.layout else None
        object.__setattr__(self, "size_index", size)
        object.__setattr__(self, "group_index", len(self.layout) - 1)

    @property
    def name(self) -> str:
        """The op's name in the ``_c10d_functional`` namespace (``"all_gather_into_tensor"``)."""
        return self.op._schema.name.partition("::")[2]

    def emit(
        self, graph: torch.fx.Graph, x: torch.fx.Node, size: int | None, kind: str
    ) -> torch.fx.Node:
        """Insert this collective of ``x`` over the ``kind`` group (``"tp"``/``"dcp"``, of ``size``
        ranks) and its ``wait_tensor``; return the wait node. An unknown kind raises ``ValueError``
        before anything is inserted."""
        node = graph.call_function(self.op, self.emit_args(x, size, group_name(kind)))
        return graph.call_function(WAIT, (node,))


# -- binding calls to the schema ----------------------------------------------------------------------
def collective_name(target: object) -> str | None:
    """The op name (``"all_reduce"``…) if ``target`` is a ``_c10d_functional`` op, else None.

    Accepts both the overload (``….all_reduce.default``, as in make_fx/export graphs) and the
    packet (``….all_reduce``, as in ``symbolic_trace`` graphs).
    """
    if isinstance(target, torch._ops.OpOverload):
        qualified = target._schema.name
    elif isinstance(target, torch._ops.OpOverloadPacket):
        qualified = target._qualified_op_name
    else:
        return None
    namespace, _, name = qualified.partition("::")
    return name if namespace == NAMESPACE else None


def collective_of(target: object) -> Collective | None:
    """The registry entry of a graph node's target (overload or packet), else None."""
    name = collective_name(target)
    return _BY_NAME.get(name) if name is not None else None


def bind(op: torch._ops.OpOverload, args: Sequence[Any], kwargs: dict[str, Any]) -> tuple:
    """A call's ``args``/``kwargs`` as one tuple in ``op``'s schema order, defaults filled in.

    ``TypeError`` (naming the schema) for too many, missing or unexpected arguments."""
    schema = op._schema
    formals = schema.arguments
    kwargs = dict(kwargs)
    if len(args) > len(formals):
        raise TypeError(f"{schema} takes {len(formals)} arguments")
    params = []
    for i, formal in enumerate(formals):
        if i < len(args):
            params.append(args[i])
        elif formal.name in kwargs:
            params.append(kwargs.pop(formal.name))
        elif formal.has_default_value():
            params.append(formal.default_value)
        else:
            raise TypeError(f"missing argument {formal.name!r} of {schema}")
    if kwargs:
        raise TypeError(f"unexpected arguments {sorted(kwargs)} for {schema}")
    return tuple(params)


# -- checks every member of a group must pass ---------------------------------------------------------
def _require_same(params: Sequence[tuple], what: str, get: Callable[[tuple], object]) -> None:
    values = [get(p) for p in params]
    if any(v != values[0] for v in values[1:]):
        raise GroupMismatch(f"ranks disagree on the {what}", values)


def _require_group_size(params: Sequence[tuple], index: int) -> None:
    n = len(params)
    if any(p[index] != n for p in params):
        values = [f"group_size={p[index]}" for p in params]
        raise GroupMismatch(f"the group has {n} ranks but group_size differs from it", values)


def _require_rows(params: Sequence[tuple], name: str) -> None:
    if any(p[0].dim() == 0 for p in params):
        raise GroupMismatch(f"{name} needs inputs with a dim 0", [tuple(p[0].shape) for p in params])


def reduce_in_rank_order(inputs: Sequence[torch.Tensor], op: str) -> torch.Tensor:
    """``((x0 ∘ x1) ∘ x2) ∘ …`` in group-rank order, into a fresh contiguous tensor (the emulator's
    reduction, and the shared-memory transport's, so both give the same bits)."""
    if op not in REDUCE_OPS:
        raise GroupMismatch(f"unknown reduce_op {op!r}; torch accepts {', '.join(REDUCE_OPS)}")
    acc = inputs[0].clone(memory_format=torch.contiguous_format)
    for t in inputs[1:]:
        if op in ("sum", "avg"):
            acc.add_(t)
        elif op == "product":
            acc.mul_(t)
        elif op == "max":
            torch.maximum(acc, t, out=acc)
        elif op == "min":
            torch.minimum(acc, t, out=acc)
        elif op == "band":
            acc.bitwise_and_(t)
        elif op == "bor":
            acc.bitwise_or_(t)
        else:
            acc.bitwise_xor_(t)
    if op == "avg":
        if not (acc.is_floating_point() or acc.is_complex()):
            raise GroupMismatch(f"reduce_op 'avg' of {acc.dtype} tensors is not emulated")
        acc.div_(len(inputs))
    return acc


# -- all_gather_into_tensor(input, group_size, group_name) --------------------------------------------
def _emulate_all_gather(params: Sequence[tuple]) -> list[torch.Tensor]:
    _require_group_size(params, 1)
    _require_rows(params, "all_gather_into_tensor")
    _require_same(params, "input shape", lambda p: tuple(p[0].shape))
    inputs = [p[0] for p in params]
    shape = (len(inputs) * inputs[0].shape[0], *inputs[0].shape[1:])
    out = torch.cat(inputs, 0, out=inputs[0].new_empty(shape))
    return [out, *(out.clone() for _ in inputs[1:])]


ALL_GATHER = Collective(
    op=_c10d.all_gather_into_tensor.default,
    layout=("input", "group_size", "group_name"),
    display="all_gather",
    emit_args=lambda x, size, group: (x, size, group),
    emulate=_emulate_all_gather,
    details=lambda p: [str(p[1])],
)


# -- reduce_scatter_tensor(input, reduce_op, group_size, group_name) ----------------------------------
def _emulate_reduce_scatter(params: Sequence[tuple]) -> list[torch.Tensor]:
    n = len(params)
    _require_group_size(params, 2)
    _require_same(params, "reduce_op", lambda p: p[1])
    _require_rows(params, "reduce_scatter_tensor")
    _require_same(params, "input shape", lambda p: tuple(p[0].shape))
    rows = params[0][0].shape[0]
    if rows % n:
        raise GroupMismatch(f"dim 0 ({rows}) is not divisible by the group size {n}")
    total = reduce_in_rank_order([p[0] for p in params], params[0][1])
    return [chunk.clone() for chunk in total.split(rows // n, 0)]


REDUCE_SCATTER = Collective(
    op=_c10d.reduce_scatter_tensor.default,
    layout=("input", "reduce_op", "group_size", "group_name"),
    display="reduce_scatter",
    emit_args=lambda x, size, group: (x, "sum", size, group),
    emulate=_emulate_reduce_scatter,
    details=lambda p: [str(p[2]), str(p[1])],
)


# -- all_reduce(input, reduce_op, group_name) ---------------------------------------------------------
def _emulate_all_reduce(params: Sequence[tuple]) -> list[torch.Tensor]:
    _require_same(params, "reduce_op", lambda p: p[1])
    _require_same(params, "input shape", lambda p: tuple(p[0].shape))
    total = reduce_in_rank_order([p[0] for p in params], params[0][1])
    return [total, *(total.clone() for _ in params[1:])]


ALL_REDUCE = Collective(
    op=_c10d.all_reduce.default,
    layout=("input", "reduce_op", "group_name"),
    display="all_reduce",
    emit_args=lambda x, size, group: (x, "sum", group),
    emulate=_emulate_all_reduce,
    details=lambda p: [str(p[1])],
)


# -- all_to_all_single(input, output_split_sizes, input_split_sizes, group_name) ----------------------
def _split_sizes(member: int, p: tuple, n: int) -> tuple[list[int], list[int]]:
    """(output_split_sizes, input_split_sizes) of one member; both None means equal splits."""
    rows, out_sizes, in_sizes = p[0].shape[0], p[1], p[2]
    if out_sizes is None and in_sizes is None:
        if rows % n:
            raise GroupMismatch(f"equal splits need dim 0 ({rows}) divisible by {n}", members=[member])
        return [rows // n] * n, [rows // n] * n
    if out_sizes is None or in_sizes is None:
        raise GroupMismatch("split sizes must both be lists or both be None", members=[member])
    out_sizes, in_sizes = [int(s) for s in out_sizes], [int(s) for s in in_sizes]
    if len(out_sizes) != n or len(in_sizes) != n:
        raise GroupMismatch(
            f"split size lists need one entry per group member ({n}): "
            f"output_split_sizes={out_sizes}, input_split_sizes={in_sizes}",
            members=[member],
        )
    if sum(in_sizes) != rows or min(in_sizes + out_sizes) < 0:
        raise GroupMismatch(
            f"input_split_sizes={in_sizes} do not split dim 0 of size {rows}", members=[member]
        )
    return out_sizes, in_sizes


def _emulate_all_to_all(params: Sequence[tuple]) -> list[torch.Tensor]:
    n = len(params)
    _require_rows(params, "all_to_all_single")
    _require_same(params, "input shape after dim 0", lambda p: tuple(p[0].shape[1:]))
    sizes = [_split_sizes(i, p, n) for i, p in enumerate(params)]
    wrong = [
        f"group rank {dst} expects {sizes[dst][0][src]} rows from group rank {src}, "
        f"which sends {sizes[src][1][dst]}"
        for dst in range(n) for src in range(n) if sizes[dst][0][src] != sizes[src][1][dst]
    ]
    if wrong:
        raise GroupMismatch(
            "split sizes do not match: " + "; ".join(wrong),
            [f"output_split_sizes={o}, input_split_sizes={i}" for o, i in sizes],
        )
    pieces = [p[0].split(in_sizes, 0) for p, (_, in_sizes) in zip(params, sizes)]
    first = params[0][0]
    results = []
    for dst in range(n):
        out = first.new_empty((sum(sizes[dst][0]), *first.shape[1:]))
        results.append(torch.cat([pieces[src][dst] for src in range(n)], 0, out=out))
    return results


ALL_TO_ALL = Collective(
    op=_c10d.all_to_all_single.default,
    layout=("input", "output_split_sizes", "input_split_sizes", "group_name"),
    display="all_to_all",
    # Constant splits [1]*size: the graph stays valid for any token count (dim 0 is the group).
    emit_args=lambda x, size, group: (x, [1] * size, [1] * size, group),
    emulate=_emulate_all_to_all,
    details=lambda p: [str(len(p[1]))] if isinstance(p[1], (list, tuple)) else [],
)


COLLECTIVES: tuple[Collective, ...] = (ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE, ALL_TO_ALL)
_BY_NAME = {c.name: c for c in COLLECTIVES}

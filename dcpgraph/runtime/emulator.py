"""Single-process SPMD emulator: run one FX graph per rank, in lockstep, with exact collectives.

:func:`run_spmd` runs every rank in this process. Each rank is a generator that evaluates its
graph node by node exactly as ``gm(*args)`` would (same callables, same arguments, so
non-collective results are bit-for-bit those of ``gm(*args)``) and *suspends* at every
``torch.ops._c10d_functional`` collective. The scheduler then starts every group whose members
are all suspended at a collective on that same group, computes each member's result and resumes
them. ``wait_tensor`` is not a rendezvous: it returns its input, as it does once a real collective
has completed.

Invariants:

- A group is a (kind, ranks) pair from :mod:`dcpgraph.runtime.groups`; a TP collective never
  matches a DCP collective, even on the same ranks (they are different communicators).
- Different groups progress independently (DCP group {0,1} may run two collectives while {2,3}
  runs none), as on real hardware; only the members of one group wait for each other.
- Reductions are evaluated in group-rank order, ``((x0 ∘ x1) ∘ x2) ∘ …``, so results are
  deterministic run to run (but may differ in the last bit from a backend that reduces in another
  order; tests against gloo use exactly representable values).
- Every result is a fresh contiguous tensor owned by one rank (no aliasing between ranks, no
  autograd history: functional collectives are not differentiable).
- A program that would hang or corrupt data on real hardware (ranks of a group at different
  collectives, a rank that returned while its peers wait, incompatible shapes, dtypes, split sizes
  or reduce ops) raises :class:`~dcpgraph.errors.CollectiveMismatchError` naming the ranks, their
  nodes and what differs. Nothing here can block.

Caveat: ranks share whatever one GraphModule holds. Passing one GraphModule for all ranks is right
for pure graphs; a graph that mutates its own buffers needs one GraphModule per rank.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.fx
from torch.fx.node import Node, map_arg

from ..errors import CollectiveMismatchError
from ..mesh import Mesh
from .groups import group_kind

__all__ = ["run_spmd", "collective_name"]

_NAMESPACE = "_c10d_functional"
_WAIT = "wait_tensor"
_RENDEZVOUS = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "all_to_all_single")
_REDUCE_OPS = ("sum", "avg", "product", "min", "max", "band", "bor", "bxor")

# step codes
_PLACEHOLDER, _GET_ATTR, _CALL_FUNCTION, _CALL_METHOD, _CALL_MODULE = range(5)
_OUTPUT, _COLLECTIVE, _IDENTITY, _THAWED_FUNCTION, _THAWED_METHOD, _THAWED_MODULE = range(5, 11)
_THAWED = {
    _CALL_FUNCTION: _THAWED_FUNCTION,
    _CALL_METHOD: _THAWED_METHOD,
    _CALL_MODULE: _THAWED_MODULE,
}
_CODES = {
    "placeholder": _PLACEHOLDER,
    "get_attr": _GET_ATTR,
    "call_function": _CALL_FUNCTION,
    "call_method": _CALL_METHOD,
    "call_module": _CALL_MODULE,
    "output": _OUTPUT,
}
_MISSING = object()


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
    return name if namespace == _NAMESPACE else None


# -- compiling a graph into a flat list of steps -----------------------------------------------
class _Plan:
    """A graph, preprocessed once: one tuple per node and what to free after it.

    Step: ``(code, node, target, args, kwargs, free)``. For collectives ``target`` is the op name
    and ``args`` the schema-ordered parameters (a template that may hold Nodes); for get_attr and
    call_module ``target`` is the attribute path split on dots. Calls whose arguments nest a list
    or dict get code ``_THAWED_*``: FX stores those as immutable containers, generated code passes
    fresh plain ones, and so must we.
    """

    __slots__ = ("steps", "n_inputs", "varargs")

    def __init__(self, graph: torch.fx.Graph) -> None:
        last_users: dict[Node, list[Node]] = {}
        seen: set[Node] = set()
        for node in reversed(graph.nodes):
            for used in node.all_input_nodes:
                if used not in seen:
                    seen.add(used)
                    last_users.setdefault(node, []).append(used)
        steps = []
        self.n_inputs = 0
        self.varargs = False
        for node in graph.nodes:
            code = _CODES.get(node.op)
            if code is None:
                raise ValueError(f"node {node.name!r} has an unknown op {node.op!r}")
            target, args, kwargs = node.target, node.args, node.kwargs
            if code == _PLACEHOLDER:
                self.varargs |= target.startswith("*")
                self.n_inputs += not target.startswith("*")
            elif code in (_GET_ATTR, _CALL_MODULE):
                target = tuple(target.split("."))
            elif code == _OUTPUT:
                args = args[0]
            elif code == _CALL_FUNCTION and (name := collective_name(target)) is not None:
                code, target, args = _collective_step(node, name)
            if _nests(args, kwargs):
                code = _THAWED.get(code, code)
            steps.append((code, node, target, args, kwargs, tuple(last_users.get(node, ()))))
        self.steps = steps


def _collective_step(node: Node, name: str) -> tuple[int, str, Any]:
    params = _bind_schema(node, name)
    if name == _WAIT:
        return _IDENTITY, name, params[0]
    if name in _RENDEZVOUS:
        return _COLLECTIVE, name, params
    raise NotImplementedError(
        f"node {node.name!r}: the emulator does not implement _c10d_functional.{name}; "
        f"supported: {', '.join(_RENDEZVOUS)}, {_WAIT}"
    )


def _nests(args: Any, kwargs: Any) -> bool:
    """Whether a list or dict sits anywhere inside a node's (tuple) args or (dict) kwargs."""
    found = False

    def visit(value: Any) -> Any:
        nonlocal found
        found |= isinstance(value, (list, dict))
        return value

    for value in (*args, *kwargs.values()) if isinstance(args, tuple) else (args,):
        torch.fx.node.map_aggregate(value, visit)
    return found


def _thaw(value: Any) -> Any:
    """Plain lists and dicts for FX's immutable ones, recursively (what generated code builds)."""
    if type(value) is tuple:
        return tuple(_thaw(v) for v in value)
    if isinstance(value, list):
        return [_thaw(v) for v in value]
    if isinstance(value, dict):
        return {k: _thaw(v) for k, v in value.items()}
    return value


def _bind_schema(node: Node, name: str) -> tuple:
    """The node's arguments in schema order (defaults filled in), validated against the schema."""
    schema = getattr(torch.ops._c10d_functional, name).default._schema
    formals = schema.arguments
    kwargs = dict(node.kwargs)
    if len(node.args) > len(formals):
        raise TypeError(f"node {node.name!r}: {schema} takes {len(formals)} arguments")
    params = []
    for i, formal in enumerate(formals):
        if i < len(node.args):
            params.append(node.args[i])
        elif formal.name in kwargs:
            params.append(kwargs.pop(formal.name))
        elif formal.has_default_value():
            params.append(formal.default_value)
        else:
            raise TypeError(f"node {node.name!r}: missing argument {formal.name!r} of {schema}")
    if kwargs:
        raise TypeError(f"node {node.name!r}: unexpected arguments {sorted(kwargs)} for {schema}")
    return tuple(params)


_PLANS: weakref.WeakKeyDictionary[torch.nn.Module, tuple] = weakref.WeakKeyDictionary()


def _plan_for(gm: torch.fx.GraphModule) -> _Plan:
    """The cached plan of ``gm``; rebuilt when ``gm.graph`` is replaced or ``gm.recompile()``d."""
    graph, code = gm.graph, getattr(gm, "_code", None)
    cached = _PLANS.get(gm)
    if cached is not None and cached[0] is graph and cached[1] is code:
        return cached[2]
    plan = _Plan(graph)
    _PLANS[gm] = (graph, code, plan)
    return plan


# -- one rank ----------------------------------------------------------------------------------
def _fetch(module: torch.nn.Module, atoms: tuple[str, ...]) -> Any:
    obj: Any = module
    for atom in atoms:
        obj = getattr(obj, atom)
    return obj


def _rank_program(
    plan: _Plan, gm: torch.fx.GraphModule, args: tuple, rank: int
) -> Iterator[tuple[Node, str, tuple]]:
    """Evaluate ``gm`` on ``args``; yield ``(node, op, params)`` at each collective and receive
    its result; return what ``gm(*args)`` returns."""
    codegen = gm.graph._codegen
    inputs = codegen.process_inputs(*args)
    # _ExportCodeGen keeps the flat inputs on itself between process_inputs and process_outputs;
    # other ranks run in between, so remember this rank's copy.
    io_state = getattr(codegen, "flat_args", _MISSING)
    if len(inputs) > plan.n_inputs and not plan.varargs:
        raise TypeError(
            f"rank {rank}: the graph takes {plan.n_inputs} positional arguments but "
            f"{len(inputs)} were given"
        )
    feed = iter(inputs)
    env: dict[Node, Any] = {}
    load = env.__getitem__
    for code, node, target, nargs, nkwargs, free in plan.steps:
        try:
            if code == _CALL_FUNCTION:
                value = target(*map_arg(nargs, load), **map_arg(nkwargs, load))
            elif code == _CALL_METHOD:
                self_obj, *rest = map_arg(nargs, load)
                value = getattr(self_obj, target)(*rest, **map_arg(nkwargs, load))
            elif code == _IDENTITY:
                value = map_arg(nargs, load)
            elif code == _COLLECTIVE:
                value = yield node, target, map_arg(nargs, load)
            elif code == _PLACEHOLDER:
                value = _next_input(feed, target, nargs, rank)
            elif code == _GET_ATTR:
                value = _fetch(gm, target)
            elif code == _OUTPUT:
                if io_state is not _MISSING:
                    codegen.flat_args = io_state
                return codegen.process_outputs(_thaw(map_arg(nargs, load)))
            else:
                args, kwargs = _thaw(map_arg(nargs, load)), _thaw(map_arg(nkwargs, load))
                if code in (_CALL_MODULE, _THAWED_MODULE):
                    value = _fetch(gm, target)(*args, **kwargs)
                elif code == _THAWED_FUNCTION:
                    value = target(*args, **kwargs)
                else:  # _THAWED_METHOD
                    value = getattr(args[0], target)(*args[1:], **kwargs)
        except Exception as exc:
            if hasattr(exc, "add_note"):
                exc.add_note(f"[dcpgraph emulator] rank {rank}, executing {node.format_node()}")
            raise
        env[node] = value
        for dead in free:
            del env[dead]
    raise ValueError(f"rank {rank}: the graph has no output node")


def _next_input(feed: Iterator, target: str, defaults: tuple, rank: int) -> Any:
    if target.startswith("*"):
        return tuple(feed)
    value = next(feed, _MISSING)
    if value is not _MISSING:
        return value
    if defaults:
        return defaults[0]
    raise TypeError(f"rank {rank}: missing positional argument {target!r}")


# -- collectives -------------------------------------------------------------------------------
class _Call:
    """One rank suspended at one collective."""

    __slots__ = ("rank", "node", "op", "params", "kind", "group")

    def __init__(self, mesh: Mesh, rank: int, node: Node, op: str, params: tuple) -> None:
        self.rank, self.node, self.op, self.params = rank, node, op, params
        try:
            self.kind = group_kind(params[-1])
        except ValueError as exc:
            raise ValueError(f"rank {rank}, node {node.name!r} ({op}): {exc}") from None
        self.group = mesh.group(self.kind, rank)

    def where(self) -> str:
        group = f"{self.kind} group {self.group}"
        return f"rank {self.rank} at {self.op} on {group} (node {self.node.name!r})"


def _mismatch(
    calls: Sequence[_Call], what: str, values: Sequence[object] | None = None
) -> CollectiveMismatchError:
    head = f"{calls[0].kind} group {calls[0].group}: {what}"
    if values is None:
        lines = [f"  {c.where()}" for c in calls]
    else:
        lines = [f"  {c.where()}: {v}" for c, v in zip(calls, values)]
    return CollectiveMismatchError("\n".join([head, *lines]))


def _require_same(calls: Sequence[_Call], what: str, get: Callable[[_Call], object]) -> None:
    values = [get(c) for c in calls]
    if any(v != values[0] for v in values[1:]):
        raise _mismatch(calls, f"ranks disagree on the {what}", values)


def _require_group_size(calls: Sequence[_Call], index: int) -> None:
    n = len(calls)
    if any(c.params[index] != n for c in calls):
        values = [f"group_size={c.params[index]}" for c in calls]
        raise _mismatch(calls, f"the group has {n} ranks but group_size differs from it", values)


def _require_rows(calls: Sequence[_Call], inputs: Sequence[torch.Tensor]) -> None:
    if any(t.dim() == 0 for t in inputs):
        shapes = [tuple(t.shape) for t in inputs]
        raise _mismatch(calls, f"{calls[0].op} needs inputs with a dim 0", shapes)


def _reduce(calls: Sequence[_Call], inputs: Sequence[torch.Tensor], op: str) -> torch.Tensor:
    """``((x0 ∘ x1) ∘ x2) ∘ …`` in group-rank order, into a fresh contiguous tensor."""
    if op not in _REDUCE_OPS:
        raise _mismatch(calls, f"unknown reduce_op {op!r}; torch accepts {', '.join(_REDUCE_OPS)}")
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
            raise _mismatch(calls, f"reduce_op 'avg' of {acc.dtype} tensors is not emulated")
        acc.div_(len(inputs))
    return acc


def _all_gather(calls: Sequence[_Call], inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    _require_group_size(calls, 1)
    _require_rows(calls, inputs)
    _require_same(calls, "input shape", lambda c: tuple(c.params[0].shape))
    shape = (len(inputs) * inputs[0].shape[0], *inputs[0].shape[1:])
    out = torch.cat(list(inputs), 0, out=inputs[0].new_empty(shape))
    return [out, *(out.clone() for _ in inputs[1:])]


def _reduce_scatter(calls: Sequence[_Call], inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    n = len(calls)
    _require_group_size(calls, 2)
    _require_same(calls, "reduce_op", lambda c: c.params[1])
    _require_rows(calls, inputs)
    _require_same(calls, "input shape", lambda c: tuple(c.params[0].shape))
    if inputs[0].shape[0] % n:
        rows = inputs[0].shape[0]
        raise _mismatch(calls, f"dim 0 ({rows}) is not divisible by the group size {n}")
    total = _reduce(calls, inputs, calls[0].params[1])
    return [chunk.clone() for chunk in total.split(total.shape[0] // n, 0)]


def _all_reduce(calls: Sequence[_Call], inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    _require_same(calls, "reduce_op", lambda c: c.params[1])
    _require_same(calls, "input shape", lambda c: tuple(c.params[0].shape))
    total = _reduce(calls, inputs, calls[0].params[1])
    return [total, *(total.clone() for _ in inputs[1:])]


def _split_sizes(call: _Call, rows: int, n: int) -> tuple[list[int], list[int]]:
    """(output_split_sizes, input_split_sizes) of one rank; both None means equal splits."""
    out_sizes, in_sizes = call.params[1], call.params[2]
    if out_sizes is None and in_sizes is None:
        if rows % n:
            raise _mismatch([call], f"equal splits need dim 0 ({rows}) divisible by {n}")
        return [rows // n] * n, [rows // n] * n
    if out_sizes is None or in_sizes is None:
        raise _mismatch([call], "split sizes must both be lists or both be None")
    out_sizes, in_sizes = [int(s) for s in out_sizes], [int(s) for s in in_sizes]
    if len(out_sizes) != n or len(in_sizes) != n:
        raise _mismatch(
            [call], f"split size lists need one entry per group member ({n}): "
            f"output_split_sizes={out_sizes}, input_split_sizes={in_sizes}"
        )
    if sum(in_sizes) != rows or min(in_sizes + out_sizes) < 0:
        raise _mismatch([call], f"input_split_sizes={in_sizes} do not split dim 0 of size {rows}")
    return out_sizes, in_sizes


def _all_to_all(calls: Sequence[_Call], inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    n = len(calls)
    _require_rows(calls, inputs)
    _require_same(calls, "input shape after dim 0", lambda c: tuple(c.params[0].shape[1:]))
    sizes = [_split_sizes(c, t.shape[0], n) for c, t in zip(calls, inputs)]
    wrong = [
        f"rank {calls[dst].rank} expects {sizes[dst][0][src]} rows from rank {calls[src].rank}, "
        f"which sends {sizes[src][1][dst]}"
        for dst in range(n) for src in range(n) if sizes[dst][0][src] != sizes[src][1][dst]
    ]
    if wrong:
        raise _mismatch(calls, "split sizes do not match: " + "; ".join(wrong),
                        [f"output_split_sizes={o}, input_split_sizes={i}" for o, i in sizes])
    pieces = [t.split(in_sizes, 0) for t, (_, in_sizes) in zip(inputs, sizes)]
    trailing = tuple(inputs[0].shape[1:])
    results = []
    for dst in range(n):
        out = inputs[0].new_empty((sum(sizes[dst][0]), *trailing))
        results.append(torch.cat([pieces[src][dst] for src in range(n)], 0, out=out))
    return results


_EXECUTORS = {
    "all_gather_into_tensor": _all_gather,
    "reduce_scatter_tensor": _reduce_scatter,
    "all_reduce": _all_reduce,
    "all_to_all_single": _all_to_all,
}


def _execute(calls: Sequence[_Call]) -> list[torch.Tensor]:
    """Results of one group's collective, member by member (``calls`` in group-rank order)."""
    _require_same(calls, "collective", lambda c: c.op)
    inputs = [c.params[0] for c in calls]
    for c, t in zip(calls, inputs):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{c.where()}: the input is a {type(t).__name__}, not a Tensor")
    _require_same(calls, "dtype", lambda c: c.params[0].dtype)
    _require_same(calls, "device", lambda c: c.params[0].device)
    with torch.no_grad():
        return _EXECUTORS[calls[0].op](calls, inputs)


def _stuck(waiting: dict[int, _Call], finished: set[int], world: int) -> CollectiveMismatchError:
    lines = []
    for rank in range(world):
        if rank in waiting:
            call = waiting[rank]
            absent = [m for m in call.group if m not in waiting or waiting[m].kind != call.kind]
            lines.append(f"  {call.where()}; waits for ranks {absent}")
        elif rank in finished:
            lines.append(f"  rank {rank} has returned")
    return CollectiveMismatchError(
        "no collective can start: the ranks of a group are not all at a collective on that "
        "group (on real hardware this hangs):\n" + "\n".join(lines)
    )


# -- the scheduler -----------------------------------------------------------------------------
def run_spmd(
    graphs: torch.fx.GraphModule | Sequence[torch.fx.GraphModule],
    per_rank_args: Sequence[Sequence[Any]],
    mesh: Mesh,
) -> list[Any]:
    """Run ``graphs`` on every rank of ``mesh`` in one process; return the per-rank outputs.

    ``graphs`` is one GraphModule for every rank, or one per rank; ``per_rank_args[r]`` are rank
    ``r``'s positional arguments. Output ``r`` is what ``graphs[r](*per_rank_args[r])`` returns
    on a real ``mesh.world_size``-process run with the groups of :mod:`.groups`.
    Raises :class:`CollectiveMismatchError` when the ranks' collectives do not line up.
    """
    world = mesh.world_size
    if isinstance(graphs, torch.nn.Module):
        gms = [graphs] * world
    else:
        gms = list(graphs)
        if len(gms) != world:
            raise ValueError(f"got {len(gms)} graphs for a mesh of {world} ranks")
    if len(per_rank_args) != world:
        raise ValueError(f"got {len(per_rank_args)} argument tuples for a mesh of {world} ranks")
    programs = [
        _rank_program(_plan_for(gm), gm, tuple(args), rank)
        for rank, (gm, args) in enumerate(zip(gms, per_rank_args))
    ]
    outputs: list[Any] = [None] * world
    finished: set[int] = set()
    waiting: dict[int, _Call] = {}
    resume: dict[int, Any] = dict.fromkeys(range(world))  # rank -> value its collective returns
    while True:
        for rank in sorted(resume):
            try:
                node, op, params = programs[rank].send(resume[rank])
            except StopIteration as stop:
                outputs[rank] = stop.value
                finished.add(rank)
                continue
            waiting[rank] = _Call(mesh, rank, node, op, params)
        if not waiting:
            return outputs
        resume = {}
        for rank in sorted(waiting):
            call = waiting.get(rank)
            if call is None or rank != call.group[0]:
                continue  # already started, or the group is handled at its first member
            members = [waiting.get(m) for m in call.group]
            if all(m is not None and m.kind == call.kind for m in members):
                for member, result in zip(call.group, _execute(members)):
                    del waiting[member]
                    resume[member] = result
        if not resume:
            raise _stuck(waiting, finished, world)

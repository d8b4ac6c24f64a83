"""Single-process SPMD emulator: run one FX graph per rank, in lockstep, with exact collectives.

:func:`run_spmd` runs every rank in this process. Each rank is a generator that evaluates its
graph node by node exactly as ``gm(*args)`` would (same callables, same arguments, so
non-collective results are bit-for-bit those of ``gm(*args)``) and *suspends* at every
``torch.ops._c10d_functional`` collective. The scheduler then starts every group whose members
are all suspended at a collective on that same group, computes each member's result with the
collective's ``emulate`` from :mod:`dcpgraph.collectives.registry` (its exact semantics, stated
there) and resumes them. ``wait_tensor`` is not a rendezvous: it returns its input, as it does once
a real collective has completed.

Invariants:

- A group is a (kind, ranks) pair from :mod:`dcpgraph.collectives.groups`; a TP collective never
  matches a DCP collective, even on the same ranks (they are different communicators).
- Different groups progress independently (DCP group {0,1} may run two collectives while {2,3}
  runs none), as on real hardware; only the members of one group wait for each other.
- Results are deterministic run to run (reductions in group-rank order; tests against gloo use
  exactly representable values) and carry no autograd history (functional collectives are not
  differentiable).
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

from ..collectives import (
    COLLECTIVES,
    WAIT,
    Collective,
    GroupMismatch,
    bind,
    collective_name,
    collective_of,
    group_kind,
)
from ..errors import CollectiveMismatchError
from ..mesh import Mesh

__all__ = ["run_spmd"]

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
_WAIT_NAME = collective_name(WAIT)


# -- compiling a graph into a flat list of steps -----------------------------------------------
class _StepList:
    """A graph, preprocessed once: one step tuple per node and what to free after it.

    Step: ``(code, node, target, args, kwargs, free)``. For collectives ``target`` is the
    :class:`~dcpgraph.collectives.Collective` and ``args`` its schema-ordered parameters (a
    template that may hold Nodes); for get_attr and
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


def _collective_step(node: Node, name: str) -> tuple[int, Any, Any]:
    """``(code, target, args)`` of a ``_c10d_functional`` node: its registry entry and its
    schema-ordered parameters, or ``_IDENTITY`` of the input for ``wait_tensor``."""
    collective = collective_of(node.target)
    if collective is None and name != _WAIT_NAME:
        supported = ", ".join([*(c.name for c in COLLECTIVES), _WAIT_NAME])
        raise NotImplementedError(
            f"node {node.name!r}: the emulator does not implement _c10d_functional.{name}; "
            f"supported: {supported}"
        )
    try:
        params = bind(WAIT if collective is None else collective.op, node.args, node.kwargs)
    except TypeError as exc:
        raise TypeError(f"node {node.name!r}: {exc}") from None
    if collective is None:
        return _IDENTITY, WAIT, params[0]
    return _COLLECTIVE, collective, params


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


_STEP_LISTS: weakref.WeakKeyDictionary[torch.nn.Module, tuple] = weakref.WeakKeyDictionary()


def _steps_for(gm: torch.fx.GraphModule) -> _StepList:
    """The cached step list of ``gm``; rebuilt when ``gm.graph`` is replaced or ``gm.recompile()``d."""
    graph, code = gm.graph, getattr(gm, "_code", None)
    cached = _STEP_LISTS.get(gm)
    if cached is not None and cached[0] is graph and cached[1] is code:
        return cached[2]
    step_list = _StepList(graph)
    _STEP_LISTS[gm] = (graph, code, step_list)
    return step_list


# -- one rank ----------------------------------------------------------------------------------
def _fetch(module: torch.nn.Module, atoms: tuple[str, ...]) -> Any:
    obj: Any = module
    for atom in atoms:
        obj = getattr(obj, atom)
    return obj


def _rank_program(
    step_list: _StepList, gm: torch.fx.GraphModule, args: tuple, rank: int
) -> Iterator[tuple[Node, Collective, tuple]]:
    """Evaluate ``gm`` on ``args``; yield ``(node, collective, params)`` at each collective, receive
    its result; return what ``gm(*args)`` returns."""
    codegen = gm.graph._codegen
    inputs = codegen.process_inputs(*args)
    # _ExportCodeGen keeps the flat inputs on itself between process_inputs and process_outputs;
    # other ranks run in between, so remember this rank's copy.
    io_state = getattr(codegen, "flat_args", _MISSING)
    if len(inputs) > step_list.n_inputs and not step_list.varargs:
        raise TypeError(
            f"rank {rank}: the graph takes {step_list.n_inputs} positional arguments but "
            f"{len(inputs)} were given"
        )
    feed = iter(inputs)
    env: dict[Node, Any] = {}
    load = env.__getitem__
    for code, node, target, nargs, nkwargs, free in step_list.steps:
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

    __slots__ = ("rank", "node", "collective", "params", "kind", "group")

    def __init__(self, mesh: Mesh, rank: int, node: Node, collective: Collective, params: tuple):
        self.rank, self.node, self.collective, self.params = rank, node, collective, params
        try:
            self.kind = group_kind(params[collective.group_index])
        except ValueError as exc:
            raise ValueError(f"rank {rank}, node {node.name!r} ({collective.name}): {exc}") from None
        self.group = mesh.group(self.kind, rank)

    def where(self) -> str:
        group = f"{self.kind} group {self.group}"
        return f"rank {self.rank} at {self.collective.name} on {group} (node {self.node.name!r})"


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


def _execute(calls: Sequence[_Call]) -> list[torch.Tensor]:
    """Results of one group's collective, member by member (``calls`` in group-rank order)."""
    _require_same(calls, "collective", lambda c: c.collective.name)
    for c in calls:
        if not isinstance(c.params[0], torch.Tensor):
            raise TypeError(f"{c.where()}: the input is a {type(c.params[0]).__name__}, not a Tensor")
    _require_same(calls, "dtype", lambda c: c.params[0].dtype)
    _require_same(calls, "device", lambda c: c.params[0].device)
    try:
        with torch.no_grad():
            return calls[0].collective.emulate([c.params for c in calls])
    except GroupMismatch as bad:
        members = calls if bad.members is None else [calls[i] for i in bad.members]
        raise _mismatch(members, bad.what, bad.values) from None


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
    on a real ``mesh.world_size``-process run with the groups of :mod:`dcpgraph.collectives.groups`.
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
        _rank_program(_steps_for(gm), gm, tuple(args), rank)
        for rank, (gm, args) in enumerate(zip(gms, per_rank_args))
    ]
    outputs: list[Any] = [None] * world
    finished: set[int] = set()
    waiting: dict[int, _Call] = {}
    resume: dict[int, Any] = dict.fromkeys(range(world))  # rank -> value its collective returns
    while True:
        for rank in sorted(resume):
            try:
                node, collective, params = programs[rank].send(resume[rank])
            except StopIteration as stop:
                outputs[rank] = stop.value
                finished.add(rank)
                continue
            waiting[rank] = _Call(mesh, rank, node, collective, params)
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

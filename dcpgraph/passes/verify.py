"""The verifier that runs after every pass.

Generic invariants of any Program (:func:`verify_program` checks them all):

1. ``graph.lint()`` passes (well-formed SSA, targets exist);
2. placeholders match ``Program.inputs`` one to one, in order;
3. fake-tensor shape propagation succeeds on the example inputs of
   :func:`dcpgraph.program.example_specs` (this stores ``meta["val"]`` on every node, which later
   passes and :func:`dcpgraph.explain` read);
4. every functional collective names a dcpgraph group whose size matches the mesh (the EP group:
   ``Lowering.expert_ranks`` where replicas share the experts, else the world);
5. no data-dependent control flow (no ``cond``/``while_loop`` higher-order ops): every rank issues
   the same collectives in the same order.

:func:`check_structure` is 1, 2, 4 and 5; :func:`propagate_shapes` is 2 and 3 (the manager runs it
after every pass even without verification, because later passes need ``meta["val"]``).
Pass-specific invariants live next to each pass (``ensures=``).

An invariant that fails at one node raises a :class:`~dcpgraph.errors.VerificationError` ending
with :func:`node_context`: the program lines around that node, the node marked ``>>``.
"""

from __future__ import annotations

import operator
import threading

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode

from ..errors import VerificationError
from ..program import Program, example_specs
from .collectives import collective_group
from .shape_keys import mutates_metadata, node_key

CONTEXT_LINES = 3


def check_inputs(program: Program) -> None:
    """Invariant 2: placeholder names equal ``[s.name for s in program.inputs]``, in order."""
    names = [n.name for n in program.graph_module.graph.nodes if n.op == "placeholder"]
    specs = [s.name for s in program.inputs]
    if names != specs:
        raise VerificationError(f"placeholders {names} do not match input specs {specs}")


def propagate_shapes(program: Program) -> int:
    """Run the graph on fake tensors, storing ``meta['val']`` on every node; returns how many
    nodes ran.

    A node whose operation and input metadata equal those of the run that stored its value is not
    run again (:mod:`.shape_keys`: the same fake execution would give the same value), so after a
    pass only the nodes it changed, and those downstream whose inputs' shapes changed, run. Every
    run uses one fake mode (:data:`FAKE_MODE`), so kept and new values mix.

    Raises :class:`VerificationError` naming the node that failed, with its context.
    """
    check_inputs(program)
    gm = program.graph_module
    with _FAKE_LOCK, FAKE_MODE:
        args = [torch.empty(shape, dtype=dtype) for shape, dtype in example_specs(program)]
        interpreter = _ShapeInterpreter(gm, reuse=not mutates_metadata(gm.graph))
        try:
            interpreter.run(*args)
            return interpreter.ran
        except Exception as err:
            node = interpreter.current
            where = f" at %{node.name}" if node is not None else ""
            raise VerificationError(
                f"shape propagation failed{where}: {type(err).__name__}: {err}"
                + (f"\n{node_context(node, shapes_after=False)}" if node is not None else "")
            ) from err


FAKE_MODE = FakeTensorMode(allow_non_fake_inputs=True)
_FAKE_LOCK = threading.RLock()


class _ShapeInterpreter(torch.fx.Interpreter):
    """Stores each node's fake result in ``meta['val']``, and ``(key, val)`` in
    ``meta['shape_key']`` where the node has a key; ``current`` is the node being run; ``ran``
    counts the nodes executed (the others kept their value)."""

    def __init__(self, gm: torch.fx.GraphModule, *, reuse: bool = True):
        super().__init__(gm)
        self.extra_traceback = False  # the error names the node itself, with context
        self.current: torch.fx.Node | None = None
        self.reuse = reuse
        self.ran = 0

    def run_node(self, n: torch.fx.Node):
        self.current = n
        key = node_key(n) if self.reuse else None
        stored = n.meta.get("shape_key")
        if key is not None and stored is not None and stored[0] == key and stored[1] is n.meta.get("val"):
            return stored[1]
        result = super().run_node(n)
        self.ran += 1
        n.meta["val"] = result
        if key is not None:
            n.meta["shape_key"] = (key, result)
        else:
            n.meta.pop("shape_key", None)
        return result


def check_structure(program: Program) -> None:
    """Invariants 1, 2, 4 and 5 (everything but shape propagation)."""
    gm = program.graph_module
    try:
        gm.graph.lint()
    except Exception as err:
        raise VerificationError(f"graph lint failed: {err}") from err
    check_inputs(program)
    for node in gm.graph.nodes:
        if node.op == "call_function" and getattr(node.target, "namespace", None) == "higher_order":
            raise VerificationError(
                f"control flow {node.target} at %{node.name}: ranks could diverge\n{node_context(node)}"
            )
        group = collective_group(node)
        if group is not None:
            kind, size = group
            if kind == "pcp" and program.mesh.pcp == 1:  # before shard_tp sets the program's mesh
                continue
            expected = {"tp": program.mesh.tp, "dcp": program.mesh.dcp, "pcp": program.mesh.pcp,
                        "ep": program.lowering.expert_ranks or program.mesh.world_size}[kind]
            if size is not None and size != expected:
                raise VerificationError(
                    f"collective %{node.name} on the {kind} group has size {size}, mesh says {expected}\n"
                    f"{node_context(node)}"
                )


def verify_program(program: Program) -> None:
    """All generic invariants (1-5)."""
    check_structure(program)
    propagate_shapes(program)


# -- context lines ---------------------------------------------------------------------------------
def node_context(node: torch.fx.Node, radius: int = CONTEXT_LINES, *, shapes_after: bool = True) -> str:
    """``radius`` program lines before and after ``node`` in its graph, ``node`` marked ``>>``.

    Lines read like :func:`dcpgraph.explain`'s: ``%name = namespace.op(%arg, ...) : [shape] dtype``
    (shapes from ``meta["val"]`` where known). ``shapes_after=False`` leaves shapes off ``node``
    and the lines after it (a failed propagation did not reach them; their values are stale).
    """
    nodes = list(node.graph.nodes)
    at = nodes.index(node)
    lines = []
    for i in range(max(0, at - radius), min(len(nodes), at + radius + 1)):
        text = _line(nodes[i], with_val=shapes_after or i < at)
        lines.append((">> " if i == at else "   ") + text)
    return "\n".join(lines)


def _line(node: torch.fx.Node, with_val: bool = True) -> str:
    if node.op == "placeholder":
        text = f"%{node.name} = input"
    elif node.op == "output":
        return f"return {_arg(node.args[0])}"
    elif node.op == "call_function" and node.target is operator.getitem:
        text = f"%{node.name} = {_arg(node.args[0])}[{node.args[1]}]"
    else:
        args = [_arg(a) for a in node.args] + [f"{k}={_arg(v)}" for k, v in node.kwargs.items()]
        text = f"%{node.name} = {_target(node)}({', '.join(args)})"
    val = node.meta.get("val") if with_val else None
    if isinstance(val, torch.Tensor):
        text += f" : [{', '.join(str(s) for s in val.shape)}] {str(val.dtype).removeprefix('torch.')}"
    return text


def _target(node: torch.fx.Node) -> str:
    target = node.target
    namespace = getattr(target, "namespace", None)
    if namespace is None:
        return getattr(target, "__name__", str(target))
    overload = getattr(target, "_overloadname", "default")
    return f"{namespace}.{target._opname}" + ("" if overload == "default" else f".{overload}")


def _arg(arg) -> str:
    if isinstance(arg, torch.fx.Node):
        return f"%{arg.name}"
    if isinstance(arg, (list, tuple)):
        inner = ", ".join(_arg(a) for a in arg)
        return f"[{inner}]" if isinstance(arg, list) else f"({inner})"
    return repr(arg)

"""The verifier that runs after every pass.

Generic invariants of any Program:

1. ``graph.lint()`` passes (well-formed SSA, targets exist);
2. placeholders match ``Program.inputs`` one to one, in order;
3. fake-tensor shape propagation succeeds on example inputs built from the input specs (this
   stores ``meta["val"]`` on every node, which :func:`dcpgraph.explain` prints);
4. every functional collective names a dcpgraph group whose size matches the mesh;
5. no data-dependent control flow (no ``cond``/``while_loop`` higher-order ops): every rank issues
   the same collectives in the same order.

Pass-specific invariants live next to each pass (``ensures=``).
"""

from __future__ import annotations

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode

from ..errors import VerificationError
from ..program import CACHE, META, RANK, STATE_KINDS, USER, Program
from .collectives import collective_group

EXAMPLE_TOKENS = 6
EXAMPLE_REQUESTS = 2
EXAMPLE_BLOCKS = 8
EXAMPLE_TABLE_WIDTH = 4

# Shapes and dtypes of user/meta/rank inputs, by role (InputSpec.target).
_ROLE_SHAPES = {
    "input_ids": ((1, EXAMPLE_TOKENS), torch.int64),
    "position_ids": ((1, EXAMPLE_TOKENS), torch.int64),
    "cu_seqlens_q": ((EXAMPLE_REQUESTS + 1,), torch.int32),
    "context_lens": ((EXAMPLE_REQUESTS,), torch.int32),
    "local_context_lens": ((EXAMPLE_REQUESTS,), torch.int32),
    "block_table": ((EXAMPLE_REQUESTS, EXAMPLE_TABLE_WIDTH), torch.int32),
    "slot_mapping": ((EXAMPLE_TOKENS,), torch.int64),
    "logits_indices": ((EXAMPLE_REQUESTS,), torch.int64),
    "tp_rank": ((), torch.int64),
    "dcp_rank": ((), torch.int64),
}


def example_specs(program: Program) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """(shape, dtype) of an example input for every placeholder of ``program`` (rank 0's)."""
    caches = {c.name: c for c in program.caches}
    block_size = int(program.options.get("block_size", 16))
    out = []
    for spec in program.inputs:
        if spec.kind in STATE_KINDS:
            full = program.state[spec.target]
            shape = spec.shard.local_shape(tuple(full.shape), program.mesh.tp)
            out.append((shape, full.dtype))
        elif spec.kind == CACHE:
            c = caches[spec.name]
            out.append(((EXAMPLE_BLOCKS, block_size, c.heads, c.dim), c.dtype))
        elif spec.kind in (USER, META, RANK):
            if spec.target not in _ROLE_SHAPES:
                raise VerificationError(f"input {spec.name!r} has unknown role {spec.target!r}")
            shape, dtype = _ROLE_SHAPES[spec.target]
            out.append((shape, dtype))
        else:
            raise VerificationError(f"input {spec.name!r} has unknown kind {spec.kind!r}")
    return out


def propagate_shapes(program: Program) -> None:
    """Run the graph on fake tensors, storing ``meta['val']`` on every node."""
    with FakeTensorMode(allow_non_fake_inputs=True):
        args = [torch.empty(shape, dtype=dtype) for shape, dtype in example_specs(program)]

        class _Prop(torch.fx.Interpreter):
            def run_node(self, n):
                result = super().run_node(n)
                n.meta["val"] = result
                return result

        _Prop(program.graph_module).run(*args)


def verify_program(program: Program) -> None:
    gm = program.graph_module
    try:
        gm.graph.lint()
    except Exception as err:
        raise VerificationError(f"graph lint failed: {err}") from err
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    specs = [s.name for s in program.inputs]
    if names != specs:
        raise VerificationError(f"placeholders {names} do not match input specs {specs}")
    for node in gm.graph.nodes:
        if node.op == "call_function" and getattr(node.target, "namespace", None) == "higher_order":
            raise VerificationError(f"control flow {node.target} at {node.name}: ranks could diverge")
        group = collective_group(node)
        if group is not None:
            kind, size = group
            expected = program.mesh.tp if kind == "tp" else program.mesh.dcp
            if size is not None and size != expected:
                raise VerificationError(
                    f"collective {node.name} on the {kind} group has size {size}, mesh says {expected}"
                )
    try:
        propagate_shapes(program)
    except VerificationError:
        raise
    except Exception as err:
        raise VerificationError(f"shape propagation failed: {type(err).__name__}: {err}") from err

"""What every front end shares: run ``torch.export`` and turn its result into a :class:`Program`.

Both front ends export a module whose forward is ``(input_ids [1, T], position_ids [1, T]) ->
logits [1, T, V]`` non-strict with a dynamic token dim, then call :func:`program_from_export`:
parameters, buffers and constants become explicit placeholders described by
:class:`~dcpgraph.program.InputSpec` (values kept by reference in ``Program.state``), export's
runtime assertion ops are dropped, and a ``trace`` stage with its provenance record is stamped on
the result so ``dcpgraph.explain(program, stage="trace")`` shows the graph as exported.
Afterwards :func:`finish` runs ``canonicalize_attention`` (verified, like any pass).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.fx

from ..errors import UnsupportedModelError
from ..passes.manager import run_passes
from ..program import BUFFER, CONSTANT, PARAM, USER, InputSpec, ModelFacts, Program, Provenance

USER_ROLES = ("input_ids", "position_ids")
TRACE_STAGE = "trace"


class TokenShapeRefusal(UnsupportedModelError):
    """torch.export could keep the token count dynamic only by constraining it: the model's code
    specialises on it (fixed-size blocks, a scan over tokens…), so no one graph serves every step."""


def _token_shape_refusal(err: Exception) -> TokenShapeRefusal | None:
    text = str(err)
    if "Constraints violated" not in text:
        return None
    guard = next((line.strip(" -") for line in text.splitlines() if "Not all values" in line or "specialized" in line), "")
    return TokenShapeRefusal(
        "data-dependent token shapes in export: the model's code constrains the token count "
        f"({guard[:200]}), so one graph cannot serve every step's token count"
    )


def run_export(
    module: torch.nn.Module, example_inputs: tuple, dynamic_shapes: Mapping[str, Any] | tuple,
) -> tuple[torch.export.ExportedProgram, float]:
    """``torch.export.export`` non-strict; returns ``(exported, seconds)``.

    An :class:`UnsupportedModelError` raised anywhere inside the traced code (and wrapped by
    export) is re-raised as itself, so callers see which layer and feature was refused; export's
    "Constraints violated" on the token dim becomes a :class:`TokenShapeRefusal`.
    """
    start = time.perf_counter()
    try:
        exported = torch.export.export(
            module, tuple(example_inputs), dynamic_shapes=dynamic_shapes, strict=False,
        )
    except UnsupportedModelError:
        raise
    except Exception as err:
        cause: BaseException = err
        while cause.__cause__ is not None or cause.__context__ is not None:
            nxt = cause.__cause__ or cause.__context__
            if isinstance(nxt, UnsupportedModelError):
                raise nxt from err
            cause = nxt
        refusal = _token_shape_refusal(err)
        if refusal is not None:
            raise refusal from err
        if type(err).__name__ == "GuardOnDataDependentSymNode":
            code = [line.split("code:", 1)[1].strip() for line in str(err).splitlines() if "code:" in line]
            where = code[-1] if code else ""  # the last source line traced: where it stopped
            raise UnsupportedModelError(
                "data-dependent control flow in export: the forward branches or loops on tensor values "
                f"(e.g. a loop over the MoE experts that were hit), which one graph cannot hold ({where[-160:]})"
            ) from err
        raise
    return exported, time.perf_counter() - start


def program_from_export(
    exported: torch.export.ExportedProgram,
    facts: ModelFacts,
    *,
    prefix: str = "",
    seconds: float = 0.0,
    summary: str | None = None,
    roles: tuple[str, ...] = USER_ROLES,
) -> Program:
    """A Program over ``exported``'s graph; state keys lose ``prefix`` (a wrapper's attribute).
    ``roles``: the user inputs' names, in order (an MTP layer adds ``hidden_states``).

    The result carries one stage, ``trace``, with a provenance record of ``seconds``.
    """
    from torch.export.graph_signature import InputKind

    kinds = {
        InputKind.PARAMETER: PARAM,
        InputKind.BUFFER: BUFFER,
        InputKind.CONSTANT_TENSOR: CONSTANT,
        InputKind.USER_INPUT: USER,
    }
    state: dict[str, torch.Tensor] = {}
    specs = []
    user_roles = iter(roles)
    for s in exported.graph_signature.input_specs:
        if s.kind not in kinds:
            raise UnsupportedModelError(f"exported input {s.arg.name} of kind {s.kind} is not supported")
        kind = kinds[s.kind]
        if kind == USER:
            role = next(user_roles, None)
            if role is None:
                raise UnsupportedModelError(
                    f"the forward takes more than {len(roles)} inputs {roles}"
                )
            specs.append(InputSpec(s.arg.name, USER, role))
            continue
        target = s.target.removeprefix(prefix) if prefix else s.target
        value = exported.state_dict.get(s.target)
        if value is None:
            value = exported.constants[s.target]
        state[target] = value.detach()
        specs.append(InputSpec(s.arg.name, kind, target))
    if exported.graph_signature.buffers_to_mutate:
        raise UnsupportedModelError(
            f"the model mutates buffers {list(exported.graph_signature.buffers_to_mutate.values())}"
        )
    gm = exported.graph_module
    _refuse_tensor_readback(gm.graph)
    # Drop export's runtime assertion ops: the shape contracts they check are ours to keep.
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target in (
            torch.ops.aten._assert_tensor_metadata.default,
            torch.ops.aten._assert_scalar.default,
        ):
            graph.erase_node(node)
    graph.eliminate_dead_code()
    gm.recompile()
    plain = torch.fx.GraphModule(gm, graph)
    program = Program(graph_module=plain, inputs=tuple(specs), facts=facts, state=state)
    if summary is None:
        calls = sum(1 for n in graph.nodes if n.op == "call_function")
        summary = f"torch.export (non-strict, dynamic tokens): {calls} ops, {len(specs)} inputs"
    return program.with_stage(TRACE_STAGE, plain, Provenance(TRACE_STAGE, seconds, summary))


_READBACK = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default)


def _refuse_tensor_readback(graph: torch.fx.Graph) -> None:
    """A value read back from a tensor into Python (``.item()``, ``.tolist()``: export's
    ``item`` / ``_local_scalar_dense``) makes later shapes or control flow depend on data; one graph cannot
    serve every step, and the passes cannot propagate shapes through it."""
    from .canonicalize.nodes import describe_location

    for node in graph.nodes:
        if node.op == "call_function" and node.target in _READBACK:
            raise UnsupportedModelError(
                f"{describe_location(node)}: data-dependent values (a tensor read back with .item() / "
                ".tolist(), e.g. token counts per expert) are not supported"
            )


def finish(program: Program, *, verify: bool = True) -> Program:
    """Run ``canonicalize_attention`` on a freshly traced Program (verified like any pass), and
    record the attention layers' KV heads and head dims where they differ across layers
    (:mod:`.layer_shapes`)."""
    from .canonicalize import canonicalize_attention
    from .layer_shapes import with_graph_layer_shapes

    program = run_passes(program, [canonicalize_attention], verify=verify)
    facts = with_graph_layer_shapes(program.facts, program)
    return program if facts is program.facts else with_facts(program, lambda _: facts)


def with_facts(program: Program, make: Callable[[Program], ModelFacts]) -> Program:
    """``program`` with facts computed from its (canonical) graph, in every stage snapshot too."""
    facts = make(program)
    stages = tuple((name, snap.replace(facts=facts)) for name, snap in program.stages)
    return program.replace(facts=facts, stages=stages)

"""``dcpgraph.explain``: a Program as readable text, like ``jax.make_jaxpr``.

::

    >>> print(dcpgraph.explain(engine, stage="shard_dcp"))
    # LlamaForCausalLM: gqa attention, 2 layers, 4 q heads / 2 kv heads, head dim 16 (v 16), vocab 128
    # mesh: Mesh(tp=4, dcp=2; dcp groups {0,1} {2,3})
    # lowering: block_size=16, comm=a2a, interleave=1, kv_cache_dtype=auto, new_tokens=fused
    # stage: shard_dcp
    inputs:
      params: 12 tensors, 96.0 KiB (rank 0 holds 32.5 KiB)
      user: %input_ids, %position_ids
      caches: %k_cache_0 (layer 0 k: 1 heads × 16, float32), …
      meta: %cu_seqlens_q, %context_lens, …
      rank: %tp_rank, %dcp_rank
    ops:
      %embedding = aten.embedding(%p_model_embed_tokens_weight, %input_ids) : [1, 6, 64] float32
      …
      %all_gather_into_tensor = all_gather[dcp, 2](%clone) : [4, 6, 16] float32
      …
    provenance:
      # trace (812.3 ms): torch.export (non-strict, dynamic tokens): 143 ops, 16 inputs
      …

Shapes are those of ``node.meta["val"]``: symbolic (``s0`` tokens) for the ``trace`` stage, the
verifier's example shapes (6 tokens, rank 0) after the later passes. Missing values are filled in
by :func:`dcpgraph.passes.verify.propagate_shapes` first.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx

from .api import trace
from .collectives import WAIT, Collective, bind, collective_of, group_kind
from .passes.verify import propagate_shapes
from .program import BUFFER, CACHE, CONSTANT, META, PARAM, RANK, USER, Program


def explain(obj: Any, stage: str | None = None) -> str:
    """Text of a Program (or an Engine's program, or an ``nn.Module`` traced first).

    ``stage=None``: the final program; a pass name (``"trace"``, ``"canonicalize_attention"``,
    ``"insert_kv_cache"``…): the program as it was right after that pass; ``"all"``: every stage
    in order.
    """
    program = _program_of(obj)
    if stage is None:
        return _explain_one(program, None)
    if stage == "all":
        if not program.stages:
            return _explain_one(program, None)
        return "\n\n".join(_explain_one(snap, name) for name, snap in program.stages)
    names = [name for name, _ in program.stages]
    if stage not in names:
        raise KeyError(f"no stage {stage!r}; this program has stages {names}")
    return _explain_one(program.stage(stage), stage)


def _program_of(obj: Any) -> Program:
    if isinstance(obj, Program):
        return obj
    program = getattr(obj, "program", None)
    if isinstance(program, Program):  # an Engine
        return program
    if isinstance(obj, torch.nn.Module):
        return trace(obj)
    raise TypeError(f"explain() takes a Program, an Engine or an nn.Module, not {type(obj).__name__}")


# -- one program ------------------------------------------------------------------------------------
def _explain_one(program: Program, stage: str | None) -> str:
    _ensure_vals(program)
    lines = _header(program, stage)
    lines += _inputs(program)
    lines.append("ops:")
    for node in program.graph_module.graph.nodes:
        if node.op in ("call_function", "call_method", "call_module", "get_attr"):
            lines.append("  " + _op_line(node))
        elif node.op == "output":
            lines.append(f"  return {_fmt_arg(node.args[0])}")
    if program.provenance:
        lines.append("provenance:")
        lines += [f"  {record}" for record in program.provenance]
    return "\n".join(lines)


def _ensure_vals(program: Program) -> None:
    nodes = [n for n in program.graph_module.graph.nodes if n.op == "call_function"]
    if all("val" in n.meta for n in nodes):
        return

    try:
        propagate_shapes(program)
    except Exception:  # noqa: BLE001 - explain prints what it can; the verifier reports errors
        pass


def _header(program: Program, stage: str | None) -> list[str]:
    f = program.facts
    head = (
        f"# {f.architecture}: {f.attention} attention, {f.num_layers} layers, "
        f"{f.num_q_heads} q heads / {f.num_kv_heads} kv heads, head dim {f.head_dim} "
        f"(v {f.v_head_dim}), vocab {f.vocab_size}, hidden {f.hidden_size}, {_dtype(f.dtype)}"
    )
    lines = [head, f"# mesh: {program.mesh}"]
    if f.layer_kv_heads or f.layer_head_dims:
        per_layer = [f"kv heads {list(f.layer_kv_heads)}" if f.layer_kv_heads else "",
                     f"head dims {list(f.layer_head_dims)}" if f.layer_head_dims else ""]
        lines.insert(1, f"# per attention layer: {', '.join(p for p in per_layer if p)}")
    if program.lowering.items():
        decided = ", ".join(f"{k}={v}" for k, v in program.lowering.items())
        lines.append(f"# lowering: {decided}")
    if f.tp_plan:
        lines.append(f"# tp plan: {len(f.tp_plan)} rules")
    lines.append(f"# stage: {stage or (program.stages[-1][0] if program.stages else 'final')}")
    return lines


def _inputs(program: Program) -> list[str]:
    lines = ["inputs:"]
    tp = program.mesh.tp
    for kind, label in ((PARAM, "params"), (BUFFER, "buffers"), (CONSTANT, "constants")):
        specs = program.inputs_of(kind)
        if not specs:
            continue
        values = [program.state[s.target] for s in specs]
        total = sum(v.numel() * v.element_size() for v in values)
        line = f"  {label}: {len(specs)} tensors, {_bytes(total)}"
        if tp > 1:
            local = sum(
                _numel(s.shard.local_shape(tuple(v.shape), tp)) * v.element_size()
                for s, v in zip(specs, values)
            )
            sharded = sum(1 for s in specs if s.shard.dim is not None)
            line += f" ({sharded} sharded; rank 0 holds {_bytes(local)})"
        lines.append(line)
    user = program.inputs_of(USER)
    if user:
        lines.append("  user: " + ", ".join(_named_input(s.name, s.target) for s in user))
    cache_specs = program.inputs_of(CACHE)
    if cache_specs:
        caches = {c.name: c for c in program.caches}
        block = (program.lowering.block_size or "?")
        lines.append(f"  caches ({len(cache_specs)}):")
        for s in cache_specs:
            c = caches.get(s.name)
            if c is None:
                lines.append(f"    %{s.name} ({s.target})")
            else:
                lines.append(
                    f"    %{c.name}: layer {c.layer} {c.role}, "
                    f"[blocks, {block}, {c.heads}, {c.dim}] {_dtype(c.dtype)}"
                )
    pools = program.recurrent_states
    if pools:
        lines.append(f"  recurrent state pools ({len(pools)}), one slot per request:")
        for p in pools:
            shape = ", ".join(str(d) for d in p.shape)
            lines.append(f"    %{p.name}: layer {p.layer} {p.role}, [slots, {shape}] {_dtype(p.dtype)} "
                         f"({_bytes(p.bytes_per_slot)} a slot)")
    for kind, label in ((META, "meta"), (RANK, "rank")):
        specs = program.inputs_of(kind)
        if specs:
            lines.append(f"  {label}: " + ", ".join(_named_input(s.name, s.target) for s in specs))
    return lines


def _named_input(name: str, role: str) -> str:
    return f"%{name}" if name == role else f"%{name} ({role})"


# -- one op -------------------------------------------------------------------------------------------
def _op_line(node: torch.fx.Node) -> str:
    result = f"%{node.name}"
    if node.op == "call_function" and node.target is operator.getitem:
        text = f"{result} = {_fmt_arg(node.args[0])}[{node.args[1]}]"
    else:
        name, args = _op_name_and_args(node)
        text = f"{result} = {name}({args})"
    val = node.meta.get("val")
    if val is not None or node.op == "call_function":
        text += f" : {_fmt_val(val)}"
    return text


def _op_name_and_args(node: torch.fx.Node) -> tuple[str, str]:
    target = node.target
    args = list(node.args)
    kwargs = dict(node.kwargs)
    if node.op != "call_function":
        return f"{node.op}[{target}]", _fmt_args(args, kwargs)
    packet = getattr(target, "_opname", None) or getattr(target, "__name__", str(target))
    namespace = getattr(target, "namespace", None)
    if target is WAIT:
        return "wait", _fmt_args(args, kwargs)
    collective = collective_of(target) if namespace is not None else None
    if collective is not None:
        return _collective(collective, args, kwargs)
    if namespace is not None:
        overload = getattr(target, "_overloadname", "default")
        name = f"{namespace}.{packet}" + ("" if overload == "default" else f".{overload}")
    else:
        module = getattr(target, "__module__", "") or ""
        name = packet if module in ("_operator", "operator", "builtins", "") else f"{module}.{packet}"
    return name, _fmt_args(args, kwargs)


def _collective(collective: Collective, args: list, kwargs: dict) -> tuple[str, str]:
    """``all_gather[dcp, 2]``-style name (group kind, then the entry's details) and the input;
    a call that does not fit the schema is printed as written."""
    try:
        params = bind(collective.op, args, kwargs)
    except TypeError:
        return f"{collective.display}?", _fmt_args(args, kwargs)
    group = params[collective.group_index]
    try:
        kind = group_kind(group)
    except ValueError:
        kind = str(group)
    detail = [kind, *collective.details(params)]
    return f"{collective.display}[{', '.join(detail)}]", _fmt_arg(params[0])


def _fmt_args(args: list, kwargs: dict) -> str:
    parts = [_fmt_arg(a) for a in args]
    parts += [f"{k}={_fmt_arg(v)}" for k, v in kwargs.items()]
    return ", ".join(parts)


def _fmt_arg(arg: Any) -> str:
    if isinstance(arg, torch.fx.Node):
        return f"%{arg.name}"
    if isinstance(arg, (list, tuple)):
        inner = ", ".join(_fmt_arg(a) for a in arg)
        return f"[{inner}]" if isinstance(arg, list) else f"({inner}{',' if len(arg) == 1 else ''})"
    if isinstance(arg, torch.dtype):
        return _dtype(arg)
    if isinstance(arg, float):
        return f"{arg:.6g}"
    if isinstance(arg, int) and abs(arg) >= 2**62:
        return "max" if arg > 0 else "min"
    if isinstance(arg, torch.device):
        return str(arg)
    return repr(arg)


def _fmt_val(val: Any) -> str:
    if isinstance(val, torch.Tensor):
        shape = ", ".join(str(s) for s in val.shape)
        return f"[{shape}] {_dtype(val.dtype)}"
    if isinstance(val, (list, tuple)):
        return "(" + ", ".join(_fmt_val(v) for v in val) + ")"
    if isinstance(val, (torch.SymInt, int)):
        return f"int {val}"
    if val is None:
        return "None"
    return type(val).__name__


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return f"{n} B"

"""``absorb_mla``: decompressed multi-head latent attention → attention in latent space.

HF's DeepSeek attention up-projects the cached latent ``c`` (``kv_lora_rank``, after its norm)
with ``kv_b_proj`` into per-head ``k_nope`` and ``v``, and concatenates ``k_nope`` with the roped,
head-shared ``k_rope``. With ``W = kv_b_proj.weight`` viewed ``[H, nope + v, R]``, ``W_UK = W[:, :nope]``
and ``W_UV = W[:, nope:]``::

    q_nope·k_nope[h] = (q_nope·W_UK[h])·c          Σ_j p_j·v_j[h] = W_UV[h]·(Σ_j p_j·c_j)

so attention can run over one KV head ``[c ‖ k_rope]`` (dim ``R + rope``) with values ``c`` (dim
``R``, a prefix of the key), queries ``[q_nope·W_UK ‖ q_rope]``, and ``W_UV`` applied after — and
after any LSE merge, which is exact because ``W_UV`` is linear and the same on every shard. The
cache then holds ``R + rope`` numbers per token instead of ``H·(nope + v + rope)``.

Recognition is structural: the value's nearest linear is the up-projection (its input is ``c``);
the key is assembled (``cat``, or ``new_empty`` + ``copy_`` into slices) from that projection's
``k_nope`` and a head-broadcast ``k_rope``; the query is ``cat(q_nope, q_rope)``, or one
projection's heads of ``nope + rope`` read whole (Kimi-Linear's MLA, which applies no rotary:
its ``q_nope``/``q_rope`` are then slices of that query). Dims are checked against the config.
An output gate between the attention and the output projection (Bailing's per-head
``σ(g_proj(x))`` multiplying each head's output) is split by heads with the query. The pass also records, as plan data, the TP roles it found: the query
projection is column-parallel (by heads), the output projection row-parallel, and the absorbed
``W_UK``/``W_UV`` are split by heads like the query.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx

from ..errors import UnsupportedModelError, VerificationError
from ..program import PARAM, InputSpec, Program, ShardRule, StateSource
from .graph_edit import Emitter
from .insert_kv_cache import CANONICAL_ATTENTION, attention_nodes
from .manager import not_yet_run, program_pass
from .shard_tp import nearest_linears

aten = torch.ops.aten
dcp_ops = torch.ops.dcpgraph
_VIEWS = {
    aten.view.default, aten.reshape.default, aten.transpose.int, aten.contiguous.default,
    aten.expand.default, aten.clone.default, aten.alias.default, aten.unsqueeze.default,
    aten.permute.default,
}


def _strip_views(node: torch.fx.Node) -> torch.fx.Node:
    while node.op == "call_function" and node.target in _VIEWS:
        node = node.args[0]
    return node


def _parts(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The pieces a tensor was assembled from along its last dim (cat, or new_empty + copy_)."""
    node = _strip_views(node)
    if node.op == "call_function" and node.target is aten.cat.default and node.args[1] in (-1, 3):
        return list(node.args[0])
    if node.op == "call_function" and node.target is aten.new_empty.default:
        pieces = []
        for user in node.users:
            if user.op == "call_function" and user.target is aten.slice.Tensor:
                for copy in user.users:
                    if copy.op == "call_function" and copy.target is aten.copy_.default:
                        pieces.append((user.args[2], copy.args[1]))
        return [src for _, src in sorted(pieces, key=lambda item: item[0])]
    return []


def _shared_head(node: torch.fx.Node) -> torch.fx.Node:
    """The head-shared ``[1, 1, T, rope]`` tensor a key part was broadcast from: views are
    stripped down to the last 4-D one-head node (an unroped ``k_rope`` is a view of the
    projection's split, whose own shape has no head axis)."""
    kept = node
    while node.op == "call_function" and node.target in _VIEWS:
        node = node.args[0]
        shape = getattr(_val(node), "shape", ())
        if len(shape) == 4 and shape[1] == 1:
            kept = node
    shape = getattr(_val(node), "shape", ())
    return node if len(shape) == 4 and shape[1] == 1 else kept


def _val(node: torch.fx.Node):
    return node.meta.get("val")


def _ensure_latent(program: Program) -> None:
    if program.facts.attention != "mla":
        return
    for node in attention_nodes(program.graph_module.graph):
        k, v = node.args[1], node.args[2]
        if not (v.op == "call_function" and v.target is aten.slice.Tensor and v.args[0] is k):
            raise VerificationError(f"{node.name}: MLA attention must read values as a prefix of the latent key")
        if _val(k).shape[1] != 1:
            raise VerificationError(f"{node.name}: latent attention must have one KV head")


@dataclass(frozen=True)
class _MLADims:
    """The config's MLA sizes: latent rank ``R``, per-head ``nope``/``rope``/``v`` dims, heads."""

    rank: int
    nope: int
    rope: int
    vdim: int
    heads: int


@dataclass(frozen=True)
class _MLALayer:
    """One recognised MLA layer: the up-projection's weight (node, full tensor, module path), its
    input latent ``c``, the shared ``k_rope`` and the query's two parts."""

    weight: torch.fx.Node
    full: torch.Tensor
    target: str
    latent: torch.fx.Node
    k_rope: torch.fx.Node
    q_nope: torch.fx.Node | None  # None: the query is read whole (``q_whole``), split here by slices
    q_rope: torch.fx.Node | None
    q_whole: torch.fx.Node | None = None


def _match_layer(program: Program, specs: dict, dims: _MLADims, layer: int, node: torch.fx.Node) -> _MLALayer:
    """Recognise ``node`` as decompressed MLA (see the module docstring), checking every dim
    against the config; raises :class:`UnsupportedModelError` naming what does not match."""
    q, k, v = node.args[:3]
    where = f"layer {layer} ({node.name})"
    up = nearest_linears(v)
    if len(up) != 1:
        raise UnsupportedModelError(f"{where}: MLA value does not come from one up-projection")
    (up,) = up
    weight = up.args[1]
    if len(up.args) > 2 and up.args[2] is not None:
        raise UnsupportedModelError(f"{where}: an up-projection bias cannot be absorbed")
    if specs.get(weight.name) is None or specs[weight.name].kind != PARAM:
        raise UnsupportedModelError(f"{where}: up-projection weight is not a parameter")
    full = program.state[specs[weight.name].target]
    if tuple(full.shape) != (dims.heads * (dims.nope + dims.vdim), dims.rank):
        raise UnsupportedModelError(f"{where}: up-projection {tuple(full.shape)} does not match the config")
    k_parts, q_parts = _parts(k), _parts(q)
    whole_query = not q_parts and _val(q).shape[-1] == dims.nope + dims.rope and len(nearest_linears(q)) == 1
    if len(k_parts) != 2 or (len(q_parts) != 2 and not whole_query):
        raise UnsupportedModelError(f"{where}: key/query are not [nope ‖ rope] concatenations (nor a query "
                                    "projection's heads of nope + rope read whole)")
    k_rope = _shared_head(k_parts[1])
    if nearest_linears(k_parts[0]) != {up} or _val(k_rope).shape[1] != 1 or _val(k_rope).shape[-1] != dims.rope:
        raise UnsupportedModelError(f"{where}: key is not [W_UK·c ‖ shared k_rope]")
    target = specs[weight.name].target.removesuffix(".weight")
    if whole_query:
        return _MLALayer(weight, full, target, up.args[0], k_rope, None, None, q)
    q_nope, q_rope = q_parts
    if _val(q_nope).shape[-1] != dims.nope or _val(q_rope).shape[-1] != dims.rope:
        raise UnsupportedModelError(f"{where}: query parts do not match nope/rope dims")
    return _MLALayer(weight, full, target, up.args[0], k_rope, q_nope, q_rope)


def _add_absorbed_params(graph, first_user, specs: dict, dims: _MLADims, match: _MLALayer, state: dict,
                         sources: dict, new_specs: list[InputSpec]) -> tuple[torch.fx.Node, torch.fx.Node]:
    """Placeholders (before ``first_user``) for ``W_UK [H, nope, R]`` and ``W_UV^T [H, R, v]``,
    computed once from the full weight (functional state, split by heads); returns both nodes."""
    nope, vdim, rank = dims.nope, dims.vdim, dims.rank
    weight_target = specs[match.weight.name].target
    uk_name, uv_name = f"{match.target}.absorbed_uk", f"{match.target}.absorbed_uv_t"
    state[uk_name] = absorbed(match.full, "mla_absorbed_uk", nope, vdim, rank)  # [H, nope, R]
    state[uv_name] = absorbed(match.full, "mla_absorbed_uv_t", nope, vdim, rank)  # [H, R, v]
    for name, op in ((uk_name, "mla_absorbed_uk"), (uv_name, "mla_absorbed_uv_t")):
        sources[name] = StateSource(op, (weight_target,), (nope, vdim, rank))
    with graph.inserting_before(first_user):
        uk_node = graph.placeholder(_safe(uk_name))
        uv_node = graph.placeholder(_safe(uv_name))
    new_specs += [InputSpec(uk_node.name, PARAM, uk_name, ShardRule(0)),
                  InputSpec(uv_node.name, PARAM, uv_name, ShardRule(0))]
    for n in (uk_node, uv_node):
        n.meta["val"] = torch.empty(state[_target_of(n.name, new_specs)].shape, dtype=match.full.dtype, device="meta")
    return uk_node, uv_node


def _emit_latent_attention(e: Emitter, node: torch.fx.Node, match: _MLALayer, dims: _MLADims, uk_node, uv_node):
    """``o = attention([q_nope·W_UK ‖ q_rope], [c ‖ k_rope], c) · W_UV^T`` (insertion point:
    before ``node``); returns ``o [1, H, T, v]``."""
    rank = dims.rank
    q_nope, q_rope = match.q_nope, match.q_rope
    if match.q_whole is not None:
        q_nope = e(aten.slice.Tensor, match.q_whole, -1, 0, dims.nope)
        q_rope = e(aten.slice.Tensor, match.q_whole, -1, dims.nope, dims.nope + dims.rope)
    c = e(aten.view.default, match.latent, [1, 1, -1, rank])  # [1, 1, T, R]
    k_latent = e(aten.cat.default, [c, e(aten.view.default, match.k_rope, [1, 1, -1, dims.rope])], -1)
    v_latent = e(aten.slice.Tensor, k_latent, -1, 0, rank)
    q_latent = e(aten.cat.default, [e(aten.matmul.default, q_nope, uk_node), q_rope], -1)
    o_latent = e(node.target, q_latent, k_latent, v_latent, *node.args[3:])  # same op, latent q/k/v
    return e(aten.matmul.default, o_latent, uv_node)  # [1, H, T, v]


def _drop_unused_params(graph, specs: dict) -> set[str]:
    """Erase parameter placeholders nothing reads any more; returns their state targets."""
    dropped: set[str] = set()
    for p in [n for n in graph.nodes if n.op == "placeholder" and not n.users]:
        spec = specs.get(p.name)
        if spec is not None and spec.kind == PARAM:
            dropped.add(spec.target)
            graph.erase_node(p)
    return dropped


@program_pass(
    "absorb_mla",
    requires=[
        not_yet_run("insert_kv_cache", "it rewrites the canonical attention nodes this pass matches"),
        not_yet_run("shard_tp", "this pass records the TP roles shard_tp reads from the plan"),
        CANONICAL_ATTENTION,
    ],
    ensures=[_ensure_latent],
)
def absorb_mla(program: Program):
    facts = program.facts
    if facts.attention != "mla":
        return program, "not an MLA model: nothing to absorb"
    dims = _MLADims(rank=facts.extra["kv_lora_rank"], nope=facts.extra["qk_nope_head_dim"],
                    rope=facts.extra["qk_rope_head_dim"], vdim=facts.v_head_dim, heads=facts.num_q_heads)
    gm = program.copy_graph()
    graph = gm.graph
    e = Emitter(graph)
    specs = {s.name: s for s in program.inputs}
    state = dict(program.state)
    sources = dict(program.sources)
    new_specs: list[InputSpec] = []
    plan = dict(facts.tp_plan)
    first_user = next(n for n in graph.nodes if n.op == "placeholder" and specs[n.name].kind != PARAM)
    for layer, node in enumerate(attention_nodes(graph)):
        match = _match_layer(program, specs, dims, layer, node)
        k = node.args[1]
        uk_node, uv_node = _add_absorbed_params(graph, first_user, specs, dims, match, state, sources, new_specs)
        with graph.inserting_before(node):
            out = _emit_latent_attention(e, node, match, dims, uk_node, uv_node)
        node.replace_all_uses_with(out)
        graph.erase_node(node)
        _drop_key_assembly(graph, k)
        # TP roles found in the graph (sharding is data): queries by heads, output by rows.
        query_linears = nearest_linears(match.q_whole if match.q_nope is None else match.q_nope)
        for lin in query_linears:
            plan[_module_path(lin, specs)] = "colwise"
        outputs, gates = _output_linears(out)
        for user in outputs:
            plan[_module_path(user, specs)] = "rowwise"
        for gate in gates:
            if gate in query_linears:
                continue  # one projection gives queries and gates per head (AXK2): already split by heads
            width = int(program.state[specs[gate.args[1].name].target].shape[0])
            if width not in (dims.heads, dims.heads * dims.vdim):
                raise UnsupportedModelError(
                    f"layer {layer}: the attention output is multiplied by {_module_path(gate, specs)} of width {width}, "
                    f"neither one gate per head ({dims.heads}) nor per channel ({dims.heads * dims.vdim})")
            plan[_module_path(gate, specs)] = "colwise"
        plan.pop(match.target, None)
    graph.eliminate_dead_code()
    dropped = _drop_unused_params(graph, specs)
    gm.recompile()
    names = [n.name for n in graph.nodes if n.op == "placeholder"]
    all_specs = {s.name: s for s in (*program.inputs, *new_specs)}
    inputs = tuple(all_specs[n] for n in names)
    for t in dropped:
        state.pop(t, None)
    rank, rope = dims.rank, dims.rope
    result = program.replace(
        graph_module=gm, inputs=inputs, state=state, sources=sources,
        facts=_replace(facts, tp_plan=plan, num_kv_heads=1, head_dim=rank + rope, v_head_dim=rank),
    )
    return result, (f"{len(new_specs) // 2} MLA layers absorbed: latent KV {rank}+{rope} per token, "
                    f"dropped {len(dropped)} up-projection weights")


def absorbed(weight: torch.Tensor, op: str, nope: int, vdim: int, rank: int) -> torch.Tensor:
    """``W_UK`` (``op="mla_absorbed_uk"``, ``[h, nope, R]``) or ``W_UV`` transposed
    (``"mla_absorbed_uv_t"``, ``[h, R, v]``) of an up-projection ``weight`` of ``h`` whole heads
    (``[h·(nope + v), R]``, head-major rows): any run of whole heads gives those heads' slices."""
    w = weight.view(-1, nope + vdim, rank)
    if op == "mla_absorbed_uk":
        return w[:, :nope, :].contiguous()
    if op == "mla_absorbed_uv_t":
        return w[:, nope:, :].transpose(1, 2).contiguous()
    raise ValueError(f"unknown absorbed op {op!r}; known: mla_absorbed_uk, mla_absorbed_uv_t")


def _safe(name: str) -> str:
    return "p_" + name.replace(".", "_")


def _target_of(node_name: str, specs: list[InputSpec]) -> str:
    return next(s.target for s in specs if s.name == node_name)


def _module_path(linear: torch.fx.Node, specs: dict[str, InputSpec]) -> str:
    return specs[linear.args[1].name].target.removesuffix(".weight")


def _output_linears(node: torch.fx.Node) -> tuple[list[torch.fx.Node], list[torch.fx.Node]]:
    """``(outputs, gates)``: the linear(s) that consume the attention output through shape-only
    ops and multiplications by an output gate, and the linears those gates are computed from."""
    found, gates, frontier = [], [], [node]
    while frontier:
        n = frontier.pop()
        for user in n.users:
            if user.op == "call_function" and user.target is aten.linear.default:
                found.append(user)
            elif user.op == "call_function" and user.target in _VIEWS:
                frontier.append(user)
            elif user.op == "call_function" and user.target is aten.mul.Tensor:
                other = [a for a in user.all_input_nodes if a is not n]
                gates += [lin for a in other for lin in nearest_linears(a)]
                frontier.append(user)
    return found, gates


def _drop_key_assembly(graph: torch.fx.Graph, key: torch.fx.Node) -> None:
    """Erase the in-place copies that assembled the decompressed key (now dead)."""
    base = _strip_views(key)
    if base.op == "call_function" and base.target is aten.new_empty.default:
        for user in list(base.users):
            for copy in list(user.users):
                if copy.op == "call_function" and copy.target is aten.copy_.default:
                    graph.erase_node(copy)


def _replace(facts, **changes):
    import dataclasses

    return dataclasses.replace(facts, **changes)




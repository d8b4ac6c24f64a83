"""``fuse_mla_preprocess`` (MLAPO): each MLA layer's preprocess → one ``dcpgraph.mla_preprocess``.

The preprocess of an MLA layer (after ``absorb_mla`` and ``insert_kv_cache``) runs from the layer's
normed hidden states ``x`` to the absorbed query ``q_lat = [q_nope·W_UK ‖ q_pe]`` and the latent
row ``kv = [rms_norm(c) ‖ rotary(k_pe)]`` written to the latent cache: the query down-projection,
its norm and up-projection (or the plain ``q_proj``), the KV down-projection with the compressed-KV
norm, the rotary on both rope parts and the cache write (formulas: :mod:`dcpgraph.ops.mla_preprocess`).
The pass replaces it by one op whose outputs take the place of ``q_lat``, ``kv`` and, where something
else reads it (DeepSeek-V3.2's indexer reads the normed query latent), ``q_c``; the write moves into
the op, so the program has one op per layer where a backend can put a fused kernel (vLLM Ascend's
MLAPO, torch_npu's MLA-prolog and KV-RMSNorm-RoPE-cache families).

Recognition keys on structure, not names: from each latent cache write, the written row must be
the ``kv`` output and some absorbed query (a ``cat`` whose first part is a matmul by an absorbed
``W_UK``) the ``q_lat`` output of one traced variant of :func:`~dcpgraph.ops.mla_preprocess.mla_preprocess_math`
(:mod:`.mla_patterns`: with or without ``q_lora_rank``; interleaved, rotate-half or complex
rotary), with every literal equal. DeepSeek-V2, V3 and V3.2 share this preprocess.

It runs last: after ``shard_tp`` (which finds K/V projections from the cache writes, and makes the
query weights local, so the op sees this rank's heads) and after ``shard_dcp`` (the write's slot
mapping is per rank, slot −1 skipped, so the op is the same under every DCP mesh). A layer it does
not match stays unfused, and the provenance says why (an fp8 cache, an unknown rotary, a bias, an
intermediate something else reads); ``enabled=False`` (``mlapo=False``) leaves every layer unfused.
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from ..errors import VerificationError
from ..program import Program
from .graph_edit import Emitter, nodes_calling
from .insert_compressed_cache import COMPRESSED_CACHE_ROLES
from .manager import program_pass, ran
from .mla_patterns import LayerShape, Match, bind_outputs, interior_escapes, trace_pattern

aten = torch.ops.aten
dcp_ops = torch.ops.dcpgraph
ROTARY_ORDER = ("interleave", "rotate_half", "complex")
_ARGS = ("x", "q_a_weight", "q_a_norm_weight", "q_b_weight", "kv_a_weight", "kv_norm_weight", "w_uk",
         "rotary", "rotary_sin")


def _written_row(write: torch.fx.Node) -> torch.fx.Node | None:
    """``kv`` when the write's value is insert_kv_cache's ``kv[0].transpose(0, 1)``."""
    new = write.args[1]
    if not (new.op == "call_function" and new.target is aten.transpose.int and tuple(new.args[1:]) == (0, 1)):
        return None
    sel = new.args[0]
    if not (sel.op == "call_function" and sel.target is aten.select.int and tuple(sel.args[1:]) == (0, 0)):
        return None
    return sel.args[0]


def _absorbed_queries(graph: torch.fx.Graph, specs: dict) -> list[tuple[torch.fx.Node, torch.fx.Node]]:
    """``(cat, w_uk placeholder)`` for every ``cat([matmul(q_nope, W_UK), q_pe], -1)``."""
    found = []
    for node in nodes_calling(graph, aten.cat.default):
        first = node.args[0][0] if node.args[0] else None
        if isinstance(first, torch.fx.Node) and first.op == "call_function" and first.target is aten.matmul.default:
            weight = first.args[1]
            spec = specs.get(weight.name) if isinstance(weight, torch.fx.Node) else None
            if spec is not None and spec.target.endswith(".absorbed_uk"):
                found.append((node, weight))
    return found


def _match_layer(program: Program, kv: torch.fx.Node, queries) -> tuple[Match | None, str]:
    """The first variant binding ``kv`` and one absorbed query, or None and why not."""
    facts = program.facts
    kv_val = kv.meta.get("val")
    if kv_val is None or kv_val.dim() != 4:
        return None, f"the written row {kv.name} is not a [1, 1, T, D] tensor"
    tried = []
    for kind in _likely_rotary_first(kv):
        kv_only = None
        for q_lat, w_uk in queries:
            heads, nope, rank = (int(d) for d in w_uk.meta["val"].shape)
            shape = LayerShape(
                tokens=int(kv_val.shape[2]), hidden=facts.hidden_size, heads=heads, nope=nope,
                rope=int(kv_val.shape[-1]) - rank, rank=rank, q_lora_rank=facts.extra.get("q_lora_rank"),
                dtype=kv_val.dtype, rotary_dtype=torch.complex64 if kind == "complex" else kv_val.dtype,
            )
            pattern = trace_pattern(shape, kind)
            kv_only = bind_outputs(pattern, {"kv": kv})
            if kv_only is None:
                break  # the latent row alone rules this variant out
            match = bind_outputs(pattern, {"q_lat": q_lat}, start=kv_only)
            if match is not None:
                return match, ""
        tried.append(kind)
    q_form = "q_a_proj → norm → q_b_proj" if facts.extra.get("q_lora_rank") else "q_proj"
    return None, (f"the latent row {kv.name} and the absorbed queries match no MLA preprocess variant "
                  f"({q_form}; rotary tried: {', '.join(dict.fromkeys(tried)) or 'none'})")


def _likely_rotary_first(kv: torch.fx.Node) -> list[str]:
    """Every rotary kind, the one the latent row's rope part looks like first (only an order:
    each is still matched in full)."""
    parts = kv.args[0] if kv.op == "call_function" and kv.target is aten.cat.default else []
    rope = parts[1] if len(parts) == 2 else None
    while isinstance(rope, torch.fx.Node) and rope.op == "call_function" and rope.target is aten.view.default:
        rope = rope.args[0]
    guess = "interleave"
    if isinstance(rope, torch.fx.Node) and rope.target is aten.type_as.default:
        guess = "complex"
    elif isinstance(rope, torch.fx.Node) and rope.target is aten.add.Tensor:
        guess = "rotate_half"
    return [guess, *(k for k in ROTARY_ORDER if k != guess)]


def _ensure_writes(program: Program) -> None:
    """Every latent cache is written exactly once, by a cache write or by ``mla_preprocess``
    (DeepSeek-V4's compressed caches are written inside their cached ops, not by cache writes)."""
    graph = program.graph_module.graph
    writers = [*nodes_calling(graph, dcp_ops.kv_cache_write_.default),
               *nodes_calling(graph, dcp_ops.kv_cache_write_fp8_.default),
               *nodes_calling(graph, dcp_ops.mla_preprocess.default)]
    written = sorted(n.args[9].name if n.target is dcp_ops.mla_preprocess.default else n.args[0].name
                     for n in writers)
    data = sorted(c.name for c in program.caches
                  if not c.role.endswith("_scale") and c.role not in COMPRESSED_CACHE_ROLES)
    if written != data:
        raise VerificationError(f"cache writes {written} do not write each data cache {data} once")


@program_pass(
    "fuse_mla_preprocess",
    requires=[
        ran("shard_tp", "shard_tp finds the K/V projections from the cache writes this pass fuses"),
        ran("fuse_new_tokens", "the pass runs last, on the per-rank program"),
    ],
    ensures=[_ensure_writes],
)
def fuse_mla_preprocess(program: Program, enabled: bool = True):
    if program.facts.attention != "mla":
        return program, "not an MLA model: no MLA preprocess to fuse"
    if not enabled:
        return program, "mlapo=False: MLA preprocess left unfused"
    gm = program.copy_graph()
    graph = gm.graph
    specs = {s.name: s for s in program.inputs}
    layers = {c.name: c.layer for c in program.caches}
    queries = _absorbed_queries(graph, specs)
    fused, unfused, variants = [], [], set()
    for write in [*nodes_calling(graph, dcp_ops.kv_cache_write_.default),
                  *nodes_calling(graph, dcp_ops.kv_cache_write_fp8_.default)]:
        cache = write.args[0]
        where = f"layer {layers.get(cache.name, '?')} ({cache.name})"
        if write.target is dcp_ops.kv_cache_write_fp8_.default:
            unfused.append(f"{where}: an fp8 latent cache (mla_preprocess writes unquantised rows)")
            continue
        kv = _written_row(write)
        if kv is None:
            unfused.append(f"{where}: the written value is not a latent row [1, 1, T, D] viewed token-major")
            continue
        order = {n: i for i, n in enumerate(graph.nodes)}  # this layer's query is usually the nearest
        nearest = sorted((q for q in queries if q[0] in order), key=lambda q: abs(order[q[0]] - order[kv]))
        match, why = _match_layer(program, kv, nearest)
        if match is None:
            unfused.append(f"{where}: {why}")
            continue
        escaping = interior_escapes(match)
        if escaping:
            unfused.append(f"{where}: intermediate {[n.name for n in escaping]} also read outside the preprocess")
            continue
        first, late = _placement(graph, match, write)
        if late:
            unfused.append(f"{where}: {late}")
            continue
        _replace(graph, match, write, first)
        fused.append(where)
        variants.add(("q_lora" if match.argument("q_a_weight") is not None else "q_proj", match.pattern.rotary_kind))
    gm.recompile()
    result = program.replace(graph_module=gm)
    summary = f"{len(fused)} MLA layers fused into mla_preprocess"
    if variants:
        summary += " (" + ", ".join(f"{q}, {r} rotary" for q, r in sorted(variants)) + ")"
    if unfused:
        summary += "; left unfused: " + "; ".join(unfused)
    return result, summary


def _placement(graph: torch.fx.Graph, match: Match, write: torch.fx.Node) -> tuple[torch.fx.Node, str]:
    """``(node, "")``: the fused op goes before ``node``, the first reader of its outputs or of the
    write; or ``(node, why)`` when an input of the op is only defined after that point."""
    matched = {h for p, h in match.binding.items() if p.op == "call_function"}
    order = {n: i for i, n in enumerate(graph.nodes)}
    outputs = [match.host(name) for name in ("q_lat", "kv", "q_c")]
    readers = [u for h in outputs if h is not None for u in h.users if u not in matched]
    first = min([*readers, write], key=order.__getitem__)
    inputs = [match.argument(name) for name in _ARGS] + [write.args[0], write.args[2]]
    late = [a.name for a in inputs if isinstance(a, torch.fx.Node) and order[a] >= order[first]]
    return first, (f"inputs {late} are defined after {first.name} reads the preprocess" if late else "")


def _replace(graph: torch.fx.Graph, match: Match, write: torch.fx.Node, first: torch.fx.Node) -> None:
    """Emit the fused op before ``first``, route the outputs' outside readers to it, erase the
    write and the matched nodes."""
    matched = {h for p, h in match.binding.items() if p.op == "call_function"}
    order = {n: i for i, n in enumerate(graph.nodes)}
    args = [match.argument(name) for name in _ARGS]
    e = Emitter(graph)
    with graph.inserting_before(first):
        node = e(dcp_ops.mla_preprocess.default, *args, write.args[0], write.args[2],
                 match.captured.get("q_eps", 0.0), match.captured["kv_eps"], match.pattern.rotary_kind)
        for index, name in enumerate(("q_lat", "kv", "q_c")):
            host = match.host(name)
            if host is not None and any(u not in matched for u in host.users):
                item = graph.call_function(operator.getitem, (node, index))
                host.replace_all_uses_with(item, delete_user_cb=lambda user: user not in matched)
    graph.erase_node(write)
    for host in sorted(matched, key=order.__getitem__, reverse=True):
        if not host.users:
            graph.erase_node(host)

"""``insert_compressed_cache``: DeepSeek-V4's canonical compressed ops → paged caches and open-window slots.

Per compressed layer ``i`` (``facts.extra["compressed_layers"]``, in graph order: each layer's
``compress_windows`` nodes and CSA's ``compressed_topk`` precede its ``compressed_attention``),
over the step's flattened tokens (:mod:`dcpgraph.ops.compressed_cached`)::

    compress_windows(kv, gate, B, m, o)       → compress_windows_(kv, gate, B, open_window_i,
                                                  state_slots, cu_seqlens_q, context_lens, m, o)
                                                  (the indexer's: index_open_window_i)
    compressed_topk(iq, w, keys, p, s, m, k)  → compressed_topk_(iq, w, keys, p, index_entries_i,
                                                  block_table, cu_seqlens_q, context_lens, s, m, k, B)
    compressed_attention(q, kv, e, p, σ, s, W, m, sel)
                                              → compressed_attention_(q, kv, e, p, σ, compressed_kv_i,
                                                  entries_i, block_table, block_table, cu_seqlens_q,
                                                  context_lens, s, W, m, sel, B)

Caches (placeholders of kind ``cache``, ``[blocks, block_size, 1, dim]``, returned as outputs,
written in place): ``compressed_kv_i`` (role ``compressed_kv``: the raw K=V rows by token
position), ``entries_i`` (``compressed_entries``: the entries by entry index) and, for CSA,
``index_entries_i`` (``compressed_index``: the indexer keys by entry index); the entry caches
have ``tokens_per_row = m``, ``ceil(B / m)`` rows per block (entry ``w`` in the block of token
``w·m``). Rows are stored in the model's dtype, or as ``kv_cache_dtype`` says (the lowering's,
decided by ``insert_kv_cache``): ``bf16``, or ``fp8_e4m3`` as packed rows, values then their scales,
in a uint8 cache (:mod:`dcpgraph.ops.fp8_rows`). All three are read
through the request's one block table; an entry index ``w`` is below the request's token count, so
its blocks hold it. The raw rows' table (the second ``block_table``) is the one
``layer_group_tables`` rewires to the sliding group's under ``hybrid_kv_cache``. Open windows (kind ``recurrent``, ``[slots, rows, 2·width]`` in the model's
dtype, ``rows = 2m`` for an overlapping compressor and ``m`` otherwise) are per-request state:
``state_slots`` is the step input the engine fills from the request's slot.

At ``dcp = N > 1`` (option ``dcp``) an entry cache holds ``R`` rows per block, ``R = ceil(B / m)``
rounded up to a multiple of the interleave ``I`` (``tokens_per_row = B // R``, so ``R`` must divide
``B``), and ``shard_dcp`` deals the entries over the group by entry index
(:mod:`dcpgraph.ops.compressed_dcp`).

Runs after ``insert_kv_cache`` (whose step metadata it reads); what the cached layer does not
support is refused by :func:`dcpgraph.frontends.compressed_layers.refuse_compiling_compressed_layers`.
"""

from __future__ import annotations

import torch

from ..errors import ConfigError, VerificationError
from ..ops import compressed_cached as _cached_ops  # noqa: F401  (registers the cached forms)
from ..ops.fp8_rows import PACKED_DTYPE, packed_width
from ..program import CACHE, META, RECURRENT, CacheSpec, InputSpec, Program, RecurrentStateSpec
from .graph_edit import add_placeholders, output_node
from .manager import holds, program_pass

dcp_ops = torch.ops.dcpgraph
CANONICAL = (dcp_ops.compress_windows.default, dcp_ops.compressed_topk.default, dcp_ops.compressed_attention.default)
SLOTS_ROLE = "state_slots"
ROLES = {"compressed_kv": "compressed_kv", "entries": "compressed_entries", "index_entries": "compressed_index"}
COMPRESSED_CACHE_ROLES = frozenset(ROLES.values())  # written inside the cached ops, not by kv_cache_write_


def _canonical(program: Program) -> list:
    return [n for n in program.graph_module.graph.nodes if n.op == "call_function" and n.target in CANONICAL]


HAS_COMPRESSED = holds("canonical compress_windows / compressed_topk / compressed_attention nodes (DeepSeek-V4)",
                       lambda p: bool(_canonical(p)))
HAS_STEP_METADATA = holds("the 'cu_seqlens_q', 'context_lens' and 'block_table' inputs (insert_kv_cache)",
                          lambda p: {"cu_seqlens_q", "context_lens", "block_table"} <= {s.name for s in p.inputs})


def _none_left(program: Program) -> None:
    left = _canonical(program)
    if left:
        raise VerificationError(f"canonical compressed ops left after insert_compressed_cache: {[n.name for n in left]}")


def _ancestors(node) -> set:
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        for a in n.all_input_nodes:
            if a not in seen:
                seen.add(a)
                stack.append(a)
    return seen


def layer_nodes(program: Program) -> list[tuple[int, list, object, object]]:
    """``(layer, compress nodes, topk node or None, attention node)`` per compressed layer."""
    layers = sorted(program.facts.extra.get("compressed_layers") or {})
    groups, pending = [], []
    for n in _canonical(program):
        pending.append(n)
        if n.target is dcp_ops.compressed_attention.default:
            groups.append(pending)
            pending = []
    if pending or len(groups) != len(layers):
        raise VerificationError(f"insert_compressed_cache: {len(groups)} compressed attentions (and {len(pending)} "
                                f"ops after the last) for compressed layers {layers}")
    out = []
    for layer, group in zip(layers, groups):
        compress = [n for n in group if n.target is dcp_ops.compress_windows.default]
        topk = [n for n in group if n.target is dcp_ops.compressed_topk.default]
        if len(topk) > 1 or len(compress) != 1 + len(topk):
            raise VerificationError(f"insert_compressed_cache: layer {layer} has {len(compress)} compressors and "
                                    f"{len(topk)} selections (one compressor, plus an indexer and a selection for CSA)")
        out.append((layer, compress, topk[0] if topk else None, group[-1]))
    return out


def _replace(graph, node, target, args) -> None:
    with graph.inserting_before(node):
        new = graph.call_function(target, args)
    new.meta = dict(node.meta)
    node.replace_all_uses_with(new)
    graph.erase_node(node)


def entry_tokens_per_row(rate: int, block_size: int, dcp: int, interleave: int) -> int:
    """``CacheSpec.tokens_per_row`` of an entry cache: ``m`` at ``dcp = 1``; at ``dcp > 1``
    ``B // R`` with ``R = ceil(B / m)`` rounded up to a multiple of ``I`` (entries dealt in runs of
    ``I`` over blocks of ``R`` entries), which needs ``R`` to divide ``B``."""
    if dcp == 1:
        return rate
    rows = -(-block_size // rate)
    rows = -(-rows // interleave) * interleave
    if block_size % rows:
        raise ConfigError(f"DeepSeek-V4 entries at dcp={dcp}: {rows} entry rows per block (ceil(block_size / "
                          f"{rate}) rounded up to interleave={interleave}) must divide block_size={block_size}; "
                          "valid: interleave=block_size, or rates m dividing block_size with interleave "
                          "dividing block_size // m")
    return block_size // rows


def stored_row(dim: int, dtype: torch.dtype, kv_cache_dtype: str) -> tuple[int, torch.dtype]:
    """``(dim, dtype)`` a compressed cache stores a ``dim``-element row in: the model's dtype
    (``auto``), bfloat16 (``bf16``), or a packed fp8 row with its scales (``fp8_e4m3``: uint8 of
    :func:`dcpgraph.ops.fp8_rows.packed_width` bytes)."""
    if kv_cache_dtype == "fp8_e4m3":
        return packed_width(dim), PACKED_DTYPE
    if kv_cache_dtype == "bf16":
        return dim, torch.bfloat16
    return dim, dtype


@program_pass("insert_compressed_cache", requires=[HAS_COMPRESSED, HAS_STEP_METADATA], ensures=[_none_left])
def insert_compressed_cache(program: Program, dcp: int = 1):
    gm = program.copy_graph()
    graph = gm.graph
    found = layer_nodes(program.replace(graph_module=gm))
    caches: list[CacheSpec] = []
    pools: list[RecurrentStateSpec] = []
    block, interleave = int(program.lowering.block_size), int(program.lowering.interleave)
    kv_cache_dtype = program.lowering.kv_cache_dtype or "auto"
    plan = []  # (node, its pool or caches names)
    for layer, compress, topk, attention in found:
        index_of = {}
        if topk is not None:
            feeding = _ancestors(topk.args[2])
            index_of = {n: n in feeding for n in compress}
        for node in compress:
            kv, rate, overlap = node.args[0].meta["val"], int(node.args[3]), bool(node.args[4])
            name = f"{'index_' if index_of.get(node) else ''}open_window_{layer}"
            pools.append(RecurrentStateSpec(name, layer, "open_window", ((2 if overlap else 1) * rate,
                                                                         2 * int(kv.shape[-1])), kv.dtype))
            plan.append((node, name))
        dim, dtype = stored_row(int(attention.args[1].meta["val"].shape[-1]), attention.args[1].meta["val"].dtype,
                                kv_cache_dtype)
        caches.append(CacheSpec(f"compressed_kv_{layer}", layer, ROLES["compressed_kv"], 1, dim, dtype))
        rate = int(attention.args[7])
        caches.append(CacheSpec(f"entries_{layer}", layer, ROLES["entries"], 1, dim, dtype,
                                tokens_per_row=entry_tokens_per_row(rate, block, dcp, interleave)))
        plan.append((attention, (f"compressed_kv_{layer}", f"entries_{layer}")))
        if topk is not None:
            keys = topk.args[2].meta["val"]
            key_dim, key_dtype = stored_row(int(keys.shape[-1]), keys.dtype, kv_cache_dtype)
            caches.append(CacheSpec(f"index_entries_{layer}", layer, ROLES["index_entries"], 1, key_dim,
                                    key_dtype, tokens_per_row=entry_tokens_per_row(int(topk.args[5]), block, dcp,
                                                                                   interleave)))
            plan.append((topk, f"index_entries_{layer}"))
    has_slots = any(s.name == SLOTS_ROLE for s in program.inputs)
    names = [c.name for c in caches] + [p.name for p in pools] + ([] if has_slots else [SLOTS_ROLE])
    add_placeholders(graph, names)
    by_name = {n.name: n for n in graph.nodes if n.op == "placeholder"}
    slots, cu, context, table = (by_name[k] for k in (SLOTS_ROLE, "cu_seqlens_q", "context_lens", "block_table"))
    for node, where in plan:
        if node.target is dcp_ops.compress_windows.default:
            kv, gate, bias, rate, overlap = node.args
            _replace(graph, node, dcp_ops.compress_windows_.default,
                     (kv, gate, bias, by_name[where], slots, cu, context, rate, overlap))
        elif node.target is dcp_ops.compressed_topk.default:
            iq, weights, keys, positions, scale, rate, k = node.args
            _replace(graph, node, dcp_ops.compressed_topk_.default,
                     (iq, weights, keys, positions, by_name[where], table, cu, context, scale, rate, k, block))
        else:
            q, kv, entries, positions, sinks, scale, window, rate, selected = node.args
            _replace(graph, node, dcp_ops.compressed_attention_.default,
                     (q, kv, entries, positions, sinks, by_name[where[0]], by_name[where[1]], table, table, cu,
                      context, scale, window, rate, selected, block))
    out_node = output_node(graph)
    outputs = out_node.args[0]
    outputs = list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]
    out_node.args = (tuple(outputs + [by_name[c.name] for c in caches] + [by_name[p.name] for p in pools]),)
    gm.recompile()
    inputs = [*program.inputs, *(InputSpec(c.name, CACHE, c.role) for c in caches),
              *(InputSpec(p.name, RECURRENT, p.role) for p in pools)]
    if not has_slots:
        inputs.append(InputSpec(SLOTS_ROLE, META, SLOTS_ROLE))
    result = program.replace(graph_module=gm, inputs=tuple(inputs), caches=(*program.caches, *caches),
                             recurrent_states=(*program.recurrent_states, *pools))
    return result, (f"{len(found)} compressed layers -> {len(caches)} paged caches, "
                    f"{len(pools)} open-window pools (one slot per request)")

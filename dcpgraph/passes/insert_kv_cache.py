"""``insert_kv_cache``: canonical attention → cached attention over a paged KV cache.

Per layer, the canonical ``attention(q, k, v)`` over this step's tokens becomes (token-major,
``q [T, Hq, D]``)::

    kv_cache_write_(k_cache, k, slot_mapping); kv_cache_write_(v_cache, v, slot_mapping)
    o_ctx, lse_ctx = paged_attention(q, k_cache, v_cache, block_table, cu_seqlens_q, context_lens)
    o_new, lse_new = partial_attention(q, k, v, cu_seqlens_q, cu_seqlens_q, causal=True)
    o, _           = merge_attention(stack(o_ctx, o_new), stack(lse_ctx, lse_new))

which is exact because every cached context token precedes every new token of its request
(the context/new split). One graph therefore serves prefill chunks, decode rows and draft tokens
in the same step, with requests separated by ``cu_seqlens_q``. The caches are explicit program
state: placeholders, returned as outputs, written in place (donated), so a step costs nothing
proportional to cache capacity. Tokens with slot −1 are not written (DCP's non-owners).

Score modifiers of the canonical op carry over to both halves: a soft-cap to the paged and the
varlen attention alike; a sliding window ``W`` to the new-token part as ``window`` (aligned
positions) and to the context part as a per-query lower bound ``kv_start = max(position − W + 1, 0)``
computed in the graph from the ``position_ids`` input (global positions; ``shard_dcp`` turns it
into each rank's local index). A chunked layer (chunk ``C``) bounds its paged read the same way
by its chunk's start ``kv_start = ⌊position / C⌋·C``; its new-token attention knows no positions,
so such a layer is exact only once ``fuse_new_tokens`` folds the new tokens into that read (the
split form is refused for it). Attention sinks enter as a third partial ``(0, sink_h)`` of the
final merge, which runs once per query after any DCP merge, so a sink is counted exactly once.

MLA in latent form (values = a prefix of the key, see ``absorb_mla``) gets one cache per layer
(``latent_cache_i`` holding ``[c ‖ k_rope]``) and reads its values as a view of it. A sparse
(DSA) layer adds its indexer's key cache (``index_cache_i``, role ``index_k``) and reads both
through its selection (:mod:`dcpgraph.passes.sparse_cache`).

``kv_cache_dtype`` (vLLM's option): ``"auto"`` stores K/V in the model's dtype, ``"bf16"`` in
bfloat16, ``"fp8_e4m3"`` in ``float8_e4m3fn`` with a companion fp32 scale cache per data cache
(``<name>_scale``, role ``<role>_scale``, ``[blocks, block, heads, ceil(dim/128)]``): the writes
become ``kv_cache_write_fp8_(cache, new, slot_mapping, scales)`` and the paged read passes the
scales (``v_scales`` None for MLA, whose values are a prefix of the latent). The separate
new-token attention reads this step's unquantised K/V; where ``fuse_new_tokens`` folds it into
the paged read, the new tokens are read back from the fp8 cache like every context token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..capacity import KV_CACHE_DTYPES, SCALE_SUFFIX, scale_groups
from ..errors import ConfigError, VerificationError
from ..program import CACHE, META, CacheSpec, InputSpec, Program
from .graph_edit import Emitter, add_placeholders, nodes_calling, output_node
from .manager import holds, program_pass
from .sparse_cache import INDEX_ROLE, emit_sparse_layer, is_sparse
from .sparse_cache import cache_names as sparse_cache_names

aten = torch.ops.aten
dcp_ops = torch.ops.dcpgraph

META_ROLES = ("cu_seqlens_q", "context_lens", "block_table", "slot_mapping")
FP8 = torch.float8_e4m3fn


def cache_dtype_of(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The storage dtype of the K/V caches for a ``kv_cache_dtype`` option value."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ConfigError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    return {"auto": model_dtype, "bf16": torch.bfloat16, "fp8_e4m3": FP8}[kv_cache_dtype]


def _latent_value_dim(node) -> int:
    """Dv when the attention's values are ``k[..., :Dv]`` (MLA latent form), else 0."""
    k, v = node.args[1], node.args[2]
    if (v.op == "call_function" and v.target is aten.slice.Tensor and v.args[0] is k
            and v.args[1] in (-1, 3) and v.args[2] == 0):
        return int(v.args[3])
    return 0


def attention_modifiers(node) -> tuple[int, float, object]:
    """``(window, softcap, sinks)`` of a canonical ``dcpgraph.attention`` node (0, 0.0, None: off)."""
    names = ("window", "softcap", "sinks")
    defaults = (0, 0.0, None)
    values = []
    for i, (name, default) in enumerate(zip(names, defaults)):
        values.append(node.args[5 + i] if len(node.args) > 5 + i else node.kwargs.get(name, default))
    return int(values[0] or 0), float(values[1] or 0.0), values[2]


def attention_chunk(node) -> int:
    """The chunk size of a canonical ``dcpgraph.attention`` node (0: not chunked)."""
    return int((node.args[8] if len(node.args) > 8 else node.kwargs.get("chunk", 0)) or 0)


CHUNK_META = "dcpgraph_chunk"
"""``node.meta`` key on the paged read of a chunked layer: its chunk size. The new-token attention
emitted beside it does not know the chunk, so only the fused read (``fuse_new_tokens``) is exact."""


def _add_cache(specs: list, scales: dict, by_name: dict, node, layer: int, role: str, value, dtype) -> None:
    """Append the CacheSpec of ``node`` (heads and dim from the written ``value [1, H, T, D]``),
    and for fp8 its scale cache's spec, recording that placeholder in ``scales``."""
    heads, dim = int(value.shape[1]), int(value.shape[-1])
    specs.append(CacheSpec(node.name, layer, role, heads, dim, dtype))
    if dtype == FP8:
        scales[node.name] = by_name[node.name + SCALE_SUFFIX]
        specs.append(CacheSpec(node.name + SCALE_SUFFIX, layer, role + SCALE_SUFFIX, heads,
                               scale_groups(dim), torch.float32))


def _write(e: Emitter, cache, new, slot_mapping, scale_cache) -> None:
    if scale_cache is None:
        e(dcp_ops.kv_cache_write_.default, cache, new, slot_mapping)
    else:
        e(dcp_ops.kv_cache_write_fp8_.default, cache, new, slot_mapping, scale_cache)


def attention_nodes(graph) -> list:
    """Canonical attention nodes in graph order: ``attention(q, k, v, scale, causal, …)`` and
    DSA's ``sparse_attention(q, k, v, indices, scale)``."""
    return [n for n in graph.nodes if n.op == "call_function"
            and n.target in (dcp_ops.attention.default, dcp_ops.sparse_attention.default)]


def has_attention(program: Program) -> bool:
    """Canonical attention nodes, or a model whose every attention layer is DeepSeek-V4's compressed
    attention (its canonical ``compressed_attention`` nodes; the released V4 has no other kind):
    there this pass only adds the step's metadata inputs, which ``insert_compressed_cache`` reads."""
    graph = program.graph_module.graph
    return bool(attention_nodes(graph)) or any(
        n.op == "call_function" and n.target is torch.ops.dcpgraph.compressed_attention.default for n in graph.nodes)


CANONICAL_ATTENTION = holds(
    "canonical dcpgraph.attention nodes (made by canonicalize_attention, replaced by insert_kv_cache), "
    "or DeepSeek-V4's canonical compressed_attention nodes",
    has_attention,
)
# MLA caches hold the latent form; decompressed K/V would cost H·(nope + v + rope) per token.
_MLA_ABSORBED = holds(
    "'absorb_mla' to have run on an MLA model (its cache holds the latent form)",
    lambda p: p.facts.attention != "mla" or "absorb_mla" in p.passes_run(),
)


def _no_canonical_attention_left(program: Program) -> None:
    left = attention_nodes(program.graph_module.graph)
    if left:
        raise VerificationError(f"canonical attention left after insert_kv_cache: {[n.name for n in left]}")
    graph = program.graph_module.graph
    reads = nodes_calling(graph, dcp_ops.paged_attention.default) + nodes_calling(
        graph, dcp_ops.paged_sparse_attention.default)
    extra = program.facts.extra
    # Decoder layers without attention: recurrent (unless attention runs beside the mixer, as in
    # falcon_h1), attention-free MLP/MoE layers (nemotron_h) and DeepSeek-V4's compressed layers
    # (insert_compressed_cache gives them their caches).
    without = (len(extra.get("recurrent_layers") or {}) - len(extra.get("attention_beside_recurrent") or [])
               + len(extra.get("stateless_layers") or []) + len(extra.get("compressed_layers") or {}))
    if len(reads) != program.facts.num_layers - without:
        raise VerificationError("expected one paged attention per attention layer")


class _CacheRewrite:
    """One ``insert_kv_cache`` run's state: the cache and metadata placeholders, the CacheSpecs in
    placeholder order (each data cache, then its fp8 scales), and nodes emitted once and shared by
    layers (a window's ``kv_start``, the sparse layers' position bound and selections)."""

    def __init__(self, graph, kv_cache_dtype: str, fp8: bool, latent: list[int], shares: dict[int, bool]):
        self.graph, self.e = graph, Emitter(graph)
        self.kv_cache_dtype, self.fp8 = kv_cache_dtype, fp8
        self.latent, self.shares = latent, shares  # value dim per layer (MLA), sparse layer -> reuses a selection
        self.cache_specs: list[CacheSpec] = []
        self.scales: dict = {}  # data cache name -> its scale cache placeholder (fp8 only)
        self.window_starts: dict[int, object] = {}  # window (or −chunk) -> kv_start node (global positions)
        self.sparse_memo: dict = {}

    def add_placeholders(self, cache_names: list[str]) -> None:
        names = [*cache_names, *META_ROLES]
        self.meta = dict(zip(META_ROLES, add_placeholders(self.graph, names)[len(cache_names):]))
        self.by_name = {n.name: n for n in self.graph.nodes if n.op == "placeholder"}

    def add_cache(self, node, layer: int, role: str, value, dtype) -> None:
        _add_cache(self.cache_specs, self.scales, self.by_name, node, layer, role, value, dtype)

    def dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        return cache_dtype_of(self.kv_cache_dtype, model_dtype)

    def write(self, cache, new) -> None:
        _write(self.e, cache, new, self.meta["slot_mapping"], self.scales.get(cache.name))


@dataclass(frozen=True)
class AttentionKind:
    """How one kind of attention layer is cached: ``applies(node, value_dim)`` picks it (the
    first registered kind that applies wins), ``cache_names(rewrite, layer)`` names its data
    caches, ``emit(rewrite, layer, node)`` emits the cached form before ``node`` and returns the
    node replacing its output ``[1, H, T, Dv]``."""

    name: str
    applies: Callable[[torch.fx.Node, int], bool]
    cache_names: Callable[[_CacheRewrite, int], list[str]]
    emit: Callable[[_CacheRewrite, int, torch.fx.Node], torch.fx.Node]


ATTENTION_KINDS: list[AttentionKind] = []


def register_kind(name: str, *, applies, cache_names):
    """Decorator: register ``emit`` for the attention kind ``name``, after the kinds already
    registered."""
    def decorate(emit):
        ATTENTION_KINDS.append(AttentionKind(name, applies, cache_names, emit))
        return emit
    return decorate


def kind_of(node: torch.fx.Node, value_dim: int) -> AttentionKind:
    return next(kind for kind in ATTENTION_KINDS if kind.applies(node, value_dim))


@register_kind("sparse", applies=lambda node, dv: is_sparse(node),
               cache_names=lambda rw, layer: sparse_cache_names(layer, rw.shares[layer]))
def _emit_sparse(rw: _CacheRewrite, layer: int, node):
    """DSA: the latent cache and (unless the selection is an earlier layer's) the indexer's key
    cache, read through the layer's top-k selection (:func:`~.sparse_cache.emit_sparse_layer`)."""
    latent_cache = rw.by_name[f"latent_cache_{layer}"]
    index_cache = None if rw.shares[layer] else rw.by_name[f"index_cache_{layer}"]
    rw.add_cache(latent_cache, layer, "latent", node.args[1].meta["val"], rw.dtype(node.args[1].meta["val"].dtype))
    if index_cache is not None:
        index_key = node.args[3].args[1].meta["val"]  # [1, T, Di]
        rw.add_cache(index_cache, layer, INDEX_ROLE, index_key.unsqueeze(1), rw.dtype(index_key.dtype))
    return emit_sparse_layer(rw.graph, rw.e, node, latent_cache, index_cache, rw.latent[layer], rw.meta,
                             rw.sparse_memo)


@register_kind("latent", applies=lambda node, dv: bool(dv), cache_names=lambda rw, layer: [f"latent_cache_{layer}"])
def _emit_latent(rw: _CacheRewrite, layer: int, node):
    """MLA: one cache of ``[c ‖ k_rope]``; the values are its first ``Dv`` dims (a view)."""
    qt, kt, vt = _token_major(rw.e, node)
    k_cache = rw.by_name[f"latent_cache_{layer}"]
    rw.add_cache(k_cache, layer, "latent", node.args[1].meta["val"], rw.dtype(node.args[1].meta["val"].dtype))
    rw.write(k_cache, kt)
    v_cache = rw.e(aten.slice.Tensor, k_cache, -1, 0, rw.latent[layer])
    scale_args = (rw.scales[k_cache.name], None) if rw.fp8 else ()
    return _context_and_new(rw, node, (qt, kt, vt), k_cache, v_cache, scale_args)


@register_kind("dense", applies=lambda node, dv: True,
               cache_names=lambda rw, layer: [f"k_cache_{layer}", f"v_cache_{layer}"])
def _emit_dense(rw: _CacheRewrite, layer: int, node):
    """Separate K and V caches."""
    qt, kt, vt = _token_major(rw.e, node)
    k_val, v_val = node.args[1].meta["val"], node.args[2].meta["val"]
    dtype = rw.dtype(k_val.dtype)
    k_cache, v_cache = rw.by_name[f"k_cache_{layer}"], rw.by_name[f"v_cache_{layer}"]
    rw.add_cache(k_cache, layer, "k", k_val, dtype)
    rw.add_cache(v_cache, layer, "v", v_val, dtype)
    rw.write(k_cache, kt)
    rw.write(v_cache, vt)
    scale_args = (rw.scales[k_cache.name], rw.scales[v_cache.name]) if rw.fp8 else ()
    return _context_and_new(rw, node, (qt, kt, vt), k_cache, v_cache, scale_args)


def _token_major(e: Emitter, node) -> tuple:
    """``q, k, v`` of ``node`` from ``[1, H, T, D]`` to ``[T, H, D]``."""
    return tuple(e(aten.transpose.int, e(aten.select.int, x, 0, 0), 0, 1) for x in node.args[:3])


def _context_and_new(rw: _CacheRewrite, node, qkv: tuple, k_cache, v_cache, scale_args: tuple):
    """The paged read of the context, the attention among this step's new tokens, and (with a
    sink) the sink's partial, merged by LSE; returns ``[1, H, T, Dv]``."""
    e, meta = rw.e, rw.meta
    qt, kt, vt = qkv
    q, scale = node.args[0], node.args[3]
    window, softcap, sinks = attention_modifiers(node)
    chunk = attention_chunk(node)
    paged_extra, partial_extra = (), ()
    if chunk:
        paged_extra = (_chunk_start(rw.graph, e, rw.window_starts, chunk), softcap)
    elif window or softcap or rw.fp8:
        paged_extra = (_window_start(rw.graph, e, rw.window_starts, window) if window else None, softcap)
    if window or softcap:
        partial_extra = (window, softcap)
    o_ctx, lse_ctx = e.pair(
        dcp_ops.paged_attention.default, qt, k_cache, v_cache, meta["block_table"],
        meta["cu_seqlens_q"], meta["context_lens"], None, scale, *paged_extra, *scale_args,
    )
    if chunk:
        o_ctx.args[0].meta[CHUNK_META] = chunk
    o_new, lse_new = e.pair(
        dcp_ops.partial_attention.default, qt, kt, vt,
        meta["cu_seqlens_q"], meta["cu_seqlens_q"], scale, True, *partial_extra,
    )
    outs, lses = [o_ctx, o_new], [lse_ctx, lse_new]
    if sinks is not None:
        # The sink as one more partial: no value (0) with logit sink_h for every query.
        # Shaped after the context read, which every later pass keeps (fusion drops o_new).
        outs.append(e(aten.zeros_like.default, o_ctx))
        lses.append(e(aten.add.Tensor, e(aten.zeros_like.default, lse_ctx),
                      e(aten._to_copy.default, sinks, dtype=lse_new_dtype(q))))
    merged, _ = e.pair(
        dcp_ops.merge_attention.default, e(aten.stack.default, outs), e(aten.stack.default, lses),
    )
    return e(aten.unsqueeze.default, e(aten.transpose.int, merged, 0, 1), 0)


def _shared_selections(attn_nodes) -> dict[int, bool]:
    """Sparse layer -> whether it reuses an earlier layer's selection (the same indexer node)."""
    shares: dict[int, bool] = {}
    seen_indexers: set = set()
    for i, node in enumerate(attn_nodes):
        if is_sparse(node):
            shares[i] = node.args[3] in seen_indexers
            seen_indexers.add(node.args[3])
    return shares


@program_pass(
    "insert_kv_cache", requires=[CANONICAL_ATTENTION, _MLA_ABSORBED], ensures=[_no_canonical_attention_left],
)
def insert_kv_cache(program: Program, block_size: int = 16, kv_cache_dtype: str = "auto"):
    gm = program.copy_graph()
    graph = gm.graph
    attn_nodes = attention_nodes(graph)
    if not attn_nodes and not has_attention(program):
        raise VerificationError("insert_kv_cache found no canonical attention node")
    fp8 = cache_dtype_of(kv_cache_dtype, program.facts.dtype) == FP8
    if fp8 and any(is_sparse(n) for n in attn_nodes):
        raise ConfigError("kv_cache_dtype='fp8_e4m3' is not supported with sparse (DSA) attention; "
                          "use 'auto' or 'bf16'")
    latent = [_latent_value_dim(n) for n in attn_nodes]
    kinds = [kind_of(n, dv) for n, dv in zip(attn_nodes, latent)]
    rw = _CacheRewrite(graph, kv_cache_dtype, fp8, latent, _shared_selections(attn_nodes))
    cache_names = []
    for layer, kind in enumerate(kinds):
        for name in kind.cache_names(rw, layer):  # the order of cache_specs: each data cache, then its scales
            cache_names += [name, name + SCALE_SUFFIX] if fp8 else [name]
    rw.add_placeholders(cache_names)
    for layer, (node, kind) in enumerate(zip(attn_nodes, kinds)):
        with graph.inserting_before(node):
            out = kind.emit(rw, layer, node)
        node.replace_all_uses_with(out)
        graph.erase_node(node)
    for indexer in nodes_calling(graph, dcp_ops.indexer_topk.default):
        if not indexer.users:
            graph.erase_node(indexer)
    out_node = output_node(graph)
    outputs = out_node.args[0]
    outputs = list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]
    out_node.args = (tuple(outputs + [rw.by_name[name] for name in cache_names]),)
    gm.recompile()
    # add_placeholders appended caches then metadata after every existing placeholder.
    specs = list(program.inputs)
    specs += [InputSpec(c.name, CACHE, c.role) for c in rw.cache_specs]
    specs += [InputSpec(name, META, name) for name in META_ROLES]
    result = program.replace(
        graph_module=gm,
        inputs=tuple(specs),
        caches=tuple(rw.cache_specs),
        lowering=program.lowering.decided(block_size=block_size, kv_cache_dtype=kv_cache_dtype),
    )
    windows = sorted(w for w in rw.window_starts if w > 0)
    chunks = sorted(-w for w in rw.window_starts if w < 0)
    modified = (f"; sliding windows {windows}" if windows else "") + (f"; chunks {chunks}" if chunks else "")
    if not rw.cache_specs:  # every layer compressed: only the step metadata, for insert_compressed_cache
        return result, f"no dense attention node; step metadata inputs added (block {block_size})"
    return result, (f"{len(attn_nodes)} attention nodes -> paged KV cache (block {block_size}, "
                    f"{kv_cache_dtype}: {rw.cache_specs[0].dtype}){modified}")


def lse_new_dtype(q) -> torch.dtype:
    """The LSE dtype of an attention over ``q``: fp32, or fp64 for fp64 queries."""
    return torch.promote_types(q.meta["val"].dtype, torch.float32)


def _first_positions(graph) -> tuple:
    positions = next((n for n in graph.nodes if n.op == "placeholder" and n.name == "position_ids"), None)
    if positions is None:
        raise VerificationError("a sliding window or chunk needs the 'position_ids' input, which the graph lacks")
    return positions, next(n for n in graph.nodes if n.op != "placeholder")


def _chunk_start(graph, e: Emitter, cache: dict, chunk: int):
    """``⌊position / C⌋·C`` per new token (the first global position of its chunk), emitted once
    per chunk size (keyed ``-C`` beside the windows' starts) right after the placeholders."""
    if cache.get(-chunk) is None:
        positions, first = _first_positions(graph)
        with graph.inserting_before(first):
            index = e(aten.div.Tensor_mode, e(aten.view.default, positions, [-1]), chunk, rounding_mode="floor")
            cache[-chunk] = e(aten.mul.Tensor, index, chunk)
    return cache[-chunk]


def _window_start(graph, e: Emitter, cache: dict, window: int):
    """``max(position − window + 1, 0)`` per new token, emitted once per window size right after
    the ``position_ids`` placeholder: the first global position a query still sees."""
    if cache.get(window) is None:
        positions = next((n for n in graph.nodes if n.op == "placeholder" and n.name == "position_ids"), None)
        if positions is None:
            raise VerificationError("a sliding window needs the 'position_ids' input, which the graph lacks")
        first = next(n for n in graph.nodes if n.op != "placeholder")
        with graph.inserting_before(first):
            shifted = e(aten.sub.Tensor, e(aten.view.default, positions, [-1]), window - 1)
            cache[window] = e(aten.clamp_min.default, shifted, 0)
    return cache[window]

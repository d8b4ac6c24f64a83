"""DeepSeek-V4's compressed attention layers (CSA/HCA), traced as canonical ops.

While a model is exported, every attention module recognised structurally here (a per-head
``sinks``, the grouped output projection ``o_a_proj``/``o_b_proj`` and a ``compressor`` with
value/gate projections, a ``[m, ·]`` position bias, a norm and a rotary) runs this forward instead
of its own. Everything but the cache-dependent parts stays HF's math on the module's own
parameters: the low-rank query with its norms and partial RoPE, the single K=V head, the
compressor's projections, the entries' norm and the compress RoPE at position ``w·m``, CSA's
indexer queries and head weights, the conjugate rotation of the output and the grouped output
projection. The parts that need the request's history become
``dcpgraph.compress_windows`` (the pooling of each closed window of ``m`` source rows),
``dcpgraph.compressed_topk`` (CSA's lightning-indexer selection) and
``dcpgraph.compressed_attention`` (one softmax over the raw window, the visible or selected
entries and the sink) from :mod:`dcpgraph.ops.compressed`. The traced forward is one whole
sequence from position 0 (an empty open window), so this is the layer's exact function of it.

V4's sliding-only layers hold no compressor and trace through the ordinary attention front end
(``dcpgraph.attention`` with its window and sinks).
"""

from __future__ import annotations

import contextlib
import math
import types
from collections.abc import Iterator

import torch

from ..errors import UnsupportedModelError
from ..ops import compressed as _ops  # noqa: F401 - registers the ops the forward calls
from .compressed_tp import grouped_output_forward, is_v4_attention, output_groups
from .recurrent_layers import decoder_layers

COMPRESSED_LAYER_TYPES = ("compressed_sparse_attention", "heavily_compressed_attention")
_ATTENTION_PARTS = ("sinks", "o_a_proj", "o_b_proj", "q_a_proj", "q_a_norm", "q_b_proj", "q_b_norm",
                    "kv_proj", "kv_norm", "compressor")
_COMPRESSOR_PARTS = ("kv_proj", "gate_proj", "position_bias", "kv_norm", "rotary_emb", "compress_rate")
_INDEXER_PARTS = (*_COMPRESSOR_PARTS, "q_b_proj", "scorer", "index_topk", "head_dim")


def _has(module, names) -> bool:
    return all(getattr(module, n, None) is not None for n in names)


def is_compressed_attention(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a V4 attention with a compressor (and, if it has an indexer, a
    complete one)."""
    if not _has(module, _ATTENTION_PARTS) or not _has(module.compressor, _COMPRESSOR_PARTS):
        return False
    indexer = getattr(module.compressor, "indexer", None)
    return indexer is None or _has(indexer, _INDEXER_PARTS)


def compressed_modules(model: torch.nn.Module) -> dict[int, tuple[str, torch.nn.Module]]:
    """Layer index → (layer type, attention module) of every recognised compressed layer."""
    found = {}
    for i, layer in enumerate(decoder_layers(model) or ()):
        attn = getattr(layer, "self_attn", None)
        if attn is not None and is_compressed_attention(attn):
            csa = getattr(attn.compressor, "indexer", None) is not None
            found[i] = ("compressed_sparse_attention" if csa else "heavily_compressed_attention", attn)
    return found


def _rotate(hf, x, cos, sin):
    return hf.apply_rotary_pos_emb(x, cos, sin)


def _entries(hf, module, hidden: torch.Tensor, position_ids: torch.Tensor, overlap: bool) -> torch.Tensor:
    """The compressor's (or the indexer's) entries in row form ``[B, T, D]`` (the entry a token
    closes on its row, see :mod:`dcpgraph.ops.compressed`): pooled, normed, rotated at position
    ``p + 1 − m = w·m``."""
    rate = int(module.compress_rate)
    pooled = torch.ops.dcpgraph.compress_windows(module.kv_proj(hidden), module.gate_proj(hidden),
                                                 module.position_bias, rate, overlap)
    entries = module.kv_norm(pooled)
    cos, sin = module.rotary_emb(entries, position_ids=position_ids + (1 - rate), layer_type="compress")
    return _rotate(hf, entries.unsqueeze(1), cos, sin).squeeze(1)


def _canonical_forward(self, hidden_states, position_embeddings, position_ids, attention_mask=None, **_):
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

    batch, seq, _ = hidden_states.shape
    cos, sin = position_embeddings[self.rope_layer_type]
    q_residual = self.q_a_norm(self.q_a_proj(hidden_states))
    q = self.q_b_norm(self.q_b_proj(q_residual).view(batch, seq, -1, self.head_dim).transpose(1, 2))
    q = _rotate(hf, q, cos, sin)
    kv = self.kv_norm(self.kv_proj(hidden_states)).view(batch, seq, 1, self.head_dim).transpose(1, 2)
    kv = _rotate(hf, kv, cos, sin)
    comp = self.compressor
    indexer = getattr(comp, "indexer", None)
    entries = _entries(hf, comp, hidden_states, position_ids, overlap=indexer is not None)
    selected = None
    if indexer is not None:
        keys = _entries(hf, indexer, hidden_states, position_ids, overlap=True)
        cos_i, sin_i = indexer.rotary_emb(hidden_states, position_ids=position_ids, layer_type="compress")
        iq = indexer.q_b_proj(q_residual).view(batch, seq, -1, indexer.head_dim).transpose(1, 2)
        iq = _rotate(hf, iq, cos_i, sin_i).transpose(1, 2)  # [B, T, Hi, Di]
        weights = indexer.scorer.weights_proj(hidden_states).float() * indexer.scorer.weights_scaling
        selected = torch.ops.dcpgraph.compressed_topk(iq, weights, keys, position_ids,
                                                      float(indexer.scorer.softmax_scale), int(indexer.compress_rate),
                                                      int(indexer.index_topk))
    out = torch.ops.dcpgraph.compressed_attention(q, kv, entries, position_ids, self.sinks, float(self.scaling),
                                                  int(self.sliding_window), int(comp.compress_rate), selected)
    out = _rotate(hf, out, cos, -sin).transpose(1, 2)  # [B, T, H, D]
    grouped = self.o_a_proj(out).flatten(2)  # [B, T, H, D]: grouped_output_forward regroups it
    return self.o_b_proj(grouped), None


@contextlib.contextmanager
def canonical_compressed_layers(model: torch.nn.Module) -> Iterator[dict[int, str]]:
    """Inside the block, every recognised compressed attention computes its canonical form and
    every V4 attention's grouped output projection takes its group count from its weight
    (:func:`~.compressed_tp.grouped_output_forward`, exact when TP splits the groups); yields
    layer index → layer type. The modules' own forwards are restored on exit."""
    found = compressed_modules(model)
    patched = []
    try:
        for _, module in found.values():
            patched.append(module)
            module.forward = types.MethodType(_canonical_forward, module)
        for module in model.modules():
            if is_v4_attention(module):
                patched.append(module.o_a_proj)
                module.o_a_proj.forward = types.MethodType(grouped_output_forward, module.o_a_proj)
        yield {i: kind for i, (kind, _) in found.items()}
    finally:
        for module in patched:
            del module.forward


def compressed_layer_indices(model) -> list[int]:
    """The compressed layers of ``model``: an ``nn.Module`` (before it is traced), a traced
    Program, or an HF config (before a checkpoint is opened)."""
    if isinstance(model, torch.nn.Module):
        return sorted(compressed_modules(model))
    if hasattr(model, "facts"):
        return sorted(model.facts.extra.get("compressed_layers") or {})
    kinds = getattr(model, "layer_types", None) or ()
    return [i for i, kind in enumerate(kinds) if kind in COMPRESSED_LAYER_TYPES]


def compress_rates(model) -> dict[int, int]:
    """Layer index → compress rate ``m`` of each compressed layer: from an ``nn.Module``'s (or an
    HF config's) ``compress_rates`` by layer type, or a traced Program's facts."""
    if hasattr(model, "facts"):
        return dict(model.facts.extra.get("compress_rates") or {})
    config = getattr(model, "config", model)
    rates = getattr(config, "compress_rates", None) or {}
    return {i: int(rates[kind]) for i, kind in enumerate(getattr(config, "layer_types", None) or ())
            if kind in COMPRESSED_LAYER_TYPES}


def prefix_block_misaligned(model, *, block_size: int, dcp: int = 1, interleave: int = 1) -> str | None:
    """Why a cached prefix (a whole number of virtual blocks of ``block_size·dcp`` tokens) would not
    hold exactly its own entries, None when it does.

    * ``dcp = 1``: ``block_size`` must be a multiple of ``lcm(m)`` over the layers' rates, so the
      prefix ends on an entry boundary of every layer: its entries are closed (entry ``w`` in the
      block of token ``w·m``) and its open windows start empty or hold exactly the tokens after the
      last closed window.
    * ``dcp = N > 1``: entries are dealt by entry index over blocks of ``R`` entries per rank
      (:mod:`dcpgraph.passes.shard_dcp_compressed`), so virtual block ``k`` of an entry cache holds
      entries ``[k·R·N, (k+1)·R·N)``. They are the entries of the virtual block's own tokens
      ``[k·B·N, (k+1)·B·N)`` iff ``R·m = B``: every ``m`` divides ``B`` and the interleave ``I``
      divides ``B / m``, that is ``B`` a multiple of ``I·lcm(m)``. Otherwise a later entry would
      be written into a cached (shared) block."""
    rates = sorted(set(compress_rates(model).values()))
    if not rates:
        return None
    need = math.lcm(*rates)
    if dcp > 1:
        if block_size % (need * interleave) == 0:
            return None
        return (f"block_size={block_size} at dcp={dcp} with interleave={interleave}: each compress rate m in {rates} "
                f"must divide block_size and interleave must divide block_size // m, so a cached block holds exactly "
                f"its own tokens' entries (valid block_size: multiples of interleave·lcm = {need * interleave})")
    if block_size % need == 0:
        return None
    return (f"block_size·dcp={block_size * dcp} is not a multiple of lcm of the compress rates {rates} = {need} "
            f"(valid block_size: multiples of {need // math.gcd(need, dcp)})")


def _named(layers: list[int]) -> str:
    return f"DeepSeek-V4 compressed attention (CSA/HCA) at layers {layers[:8]}{'…' if len(layers) > 8 else ''}"


def refuse_compiling_compressed_layers(model, *, tp: int = 1, dcp: int = 1, pcp: int = 1, opts=None) -> None:
    """``dcpgraph.compile`` of a V4 model with what its cached layer does not support, refused by
    name before any pass or collective. Compiled: any ``tp`` dividing the grouped output
    projection's ``o_groups`` (:mod:`.compressed_tp`), any ``pcp`` (each compressed layer's
    compressors, indexer and attention computed on the whole step on every PCP rank,
    :mod:`dcpgraph.passes.split_pcp_prefill`) and any ``dcp`` dividing ``tp·pcp`` (the entries dealt
    by entry index, :mod:`dcpgraph.passes.shard_dcp_compressed`), with any ``kv_cache_dtype``
    (fp8 rows packed with their scales, :mod:`dcpgraph.ops.fp8_rows`); ngram and MTP speculative decoding (the open windows are recurrent state: :mod:`dcpgraph.runtime.state_rollback`,
    and the engine keeps block 0 as the scratch block padding rows write into); on the emulated and the
    distributed executor (the DCP group's all-gathers and all-to-all are the pass's collectives);
    prefix caching where a cached block holds exactly its own tokens' entries
    (:func:`prefix_block_misaligned`: ``block_size`` a multiple of every compress rate at ``dcp = 1``,
    of ``interleave·lcm(m)`` at ``dcp > 1``; the open windows kept at block boundaries as recurrent
    state, :mod:`dcpgraph.runtime.state_prefix_cache`); P/D in one process between any two meshes
    (``Engine.prefill`` / ``continue_from``, entries placed by :mod:`dcpgraph.runtime.entry_placement`);
    with ``hybrid_kv_cache`` the raw window joins the sliding group at any ``dcp``
    (:mod:`dcpgraph.passes.layer_group_tables`). Between serving instances (``dcpgraph serve``
    with a KV connector) the same entries and open windows move across meshes too
    (:mod:`dcpgraph.serving.kv_connector.plan`, by the same placement)."""
    layers = compressed_layer_indices(model)
    if not layers:
        return
    opts = opts or {}
    unsupported = []
    groups = output_groups(model)
    if tp > 1 and (groups is None or groups % tp):
        unsupported.append(f"tp={tp} (tp must divide o_groups={groups}: the grouped output projection is split "
                           "by whole groups)")
    if opts.get("enable_prefix_caching"):
        misaligned = prefix_block_misaligned(model, block_size=opts.get("block_size", 16), dcp=dcp,
                                             interleave=opts.get("interleave", 1))
        if misaligned:
            unsupported.append(f"enable_prefix_caching=True with {misaligned}")
    spec = opts.get("speculative_config")
    method = spec.get("method") if isinstance(spec, dict) else getattr(spec, "method", None)
    if spec is not None and method not in ("ngram", "mtp"):
        unsupported.append(f"speculative_config method={method!r} (only 'ngram' and 'mtp' are checked against HF; "
                           "a V4 draft model's compressed layers are not built)")
    if unsupported:
        raise UnsupportedModelError(
            f"{_named(layers)}: dcpgraph.compile does not support " + "; ".join(unsupported)
            + ". Supported: tp dividing o_groups, dcp dividing tp·pcp, kv_cache_dtype 'auto', 'bf16' or 'fp8_e4m3', "
            "ngram or mtp speculative decoding; "
            "prefix caching (block_size a multiple of the compress rates at dcp=1, of interleave·lcm of them at "
            "dcp>1); P/D in one process (Engine.prefill / continue_from) and between serving instances; "
            "per-rank bytes: dcpgraph plan")

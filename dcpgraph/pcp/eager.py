"""Eager PCP prefill and DCP decode of a transformers Llama/Qwen3 model on a (tp, pcp, dcp) mesh.

Every rank holds its TP rank's slice of the model (:mod:`.tp_shard`; the whole model at tp = 1)
and, per layer, a DCP shard of the sequence's KV: the
positions ``x`` with ``owner(x) = dcp_rank`` (:mod:`.kv_placement`). A rank is a generator that
yields each collective it needs as ``(op, payload)`` and receives the result, so one rank program
runs emulated (:func:`.emulated.run_emulated`, every rank in this process, in lockstep) or on real
process groups (:func:`.distributed.run_distributed`). The collectives:

- ``"pcp_all_gather"``: a tensor from every rank of the PCP group, in PCP-rank order;
- ``"dcp_all_gather"``: a tensor from every rank of the rank's DCP group, in DCP-rank order;
- ``"dcp_all_to_all"``: a list whose entry ``j`` goes to DCP rank ``j``; returns what each sent;
- ``"tp_all_reduce"``: the sum over the rank's TP group (``o_proj`` and the MLP's partials).

Prefill of ``n`` new tokens at positions ``c..c+n-1``, per layer: each rank computes Q/K/V of its
zigzag tokens (:mod:`.split`), all-gathers the new K/V over the PCP group (one collective of
``2·n_r·Hkv·D`` elements per rank), attends its chunks causally over the new keys, and over the
cached context: with dcp = 1 every rank holds all of it; with dcp > 1 the queries are all-gathered
over the DCP group, every rank attends them over its own shard, and the partials go back to the
query's rank (all-to-all) to be merged by LSE. It then stores the new positions it owns.
Decode is DCP decode: the new token's K/V is stored by its owner, and the one query per rank is
attended over the DCP group's shards exactly as the cached context is in prefill.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from ..errors import UnsupportedModelError
from ..mesh import Mesh
from ..ops.kernels import attend
from .attention import in_prompt_order, merge_partials, new_token_attention
from .kv_placement import owned_rows
from .split import rank_chunks, rank_token_indices
from .tp_shard import LayerShard, model_shards

SUPPORTED_MODEL_TYPES = ("llama", "qwen3")
RankProgram = Generator[tuple[str, Any], Any, Any]


@dataclass
class RankCache:
    """One rank's DCP shard: per layer the positions it owns and their K/V ``[L, Hkv, D]``."""

    positions: list[torch.Tensor] = field(default_factory=list)
    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)

    def truncated(self, length: int) -> RankCache:
        """The shard of the first ``length`` positions (a reused prompt prefix)."""
        keep = [p < length for p in self.positions]
        return RankCache([p[m] for p, m in zip(self.positions, keep)], [k[m] for k, m in zip(self.keys, keep)],
                         [v[m] for v, m in zip(self.values, keep)])


def check_eager_pcp(model: torch.nn.Module, mesh: Mesh) -> None:
    """The eager path's limits, each refused by name: a Llama/Qwen3 model without sliding windows
    or logit soft-capping, on a mesh :meth:`Mesh.validate` accepts for it."""
    config = model.config
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(f"the eager PCP path supports {list(SUPPORTED_MODEL_TYPES)} (GQA), "
                                    f"not model_type={config.model_type!r}")
    if getattr(config, "use_sliding_window", False) or getattr(config, "attn_logit_softcapping", None):
        raise UnsupportedModelError("the eager PCP path has no sliding window or logit soft-capping")
    mesh.validate(attention="gqa", num_q_heads=config.num_attention_heads,
                  num_kv_heads=config.num_key_value_heads)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _qkv(model, layer, shard: LayerShard, hidden: torch.Tensor, positions: torch.Tensor):
    """Q ``[T, Hq/tp, D]``, K/V ``[T, Hkv_local, D]`` of one layer on one TP rank, rotary applied
    at ``positions``."""
    attn, rows = layer.self_attn, hidden.shape[0]
    x = layer.input_layernorm(hidden)
    d = attn.head_dim
    q = F.linear(x, shard.wq, shard.bq).view(rows, shard.wq.shape[0] // d, d)
    k = F.linear(x, shard.wk, shard.bk).view(rows, shard.wk.shape[0] // d, d)
    v = F.linear(x, shard.wv, shard.bv).view(rows, shard.wv.shape[0] // d, d)
    if hasattr(attn, "q_norm"):
        q, k = attn.q_norm(q), attn.k_norm(k)
    cos, sin = model.model.rotary_emb(x.unsqueeze(0), positions.unsqueeze(0))
    cos, sin = cos[0].unsqueeze(1), sin[0].unsqueeze(1)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin, v


def _tp_sum(partial: torch.Tensor, tp: int):
    """The sum of ``partial`` over the TP group (no collective at tp = 1)."""
    if tp == 1:
        return partial
    return (yield ("tp_all_reduce", partial))


def _finish_layer(layer, shard: LayerShard, hidden: torch.Tensor, attn_out: torch.Tensor, tp: int):
    """Residual + ``o_proj``, then residual + MLP, each TP partial summed over the TP group."""
    attn = yield from _tp_sum(F.linear(attn_out.flatten(1), shard.wo), tp)
    hidden = hidden + (attn if shard.bo is None else attn + shard.bo)
    x = layer.post_attention_layernorm(hidden)
    inner = layer.mlp.act_fn(F.linear(x, shard.w_gate)) * F.linear(x, shard.w_up)
    return hidden + (yield from _tp_sum(F.linear(inner, shard.w_down), tp))


def _context_attention(q: torch.Tensor, cache: RankCache, layer: int, scale: float, dcp: int):
    """``(out, lse)`` of ``q`` over the whole cached context: local when dcp = 1, else over the DCP
    group's shards — queries all-gathered over the group (its ranks may hold different query heads
    of the one KV head they share), each attended over this rank's shard, the partials returned to
    their rank by an all-to-all and merged by LSE."""
    k, v = cache.keys[layer], cache.values[layer]
    if dcp == 1:
        return attend(q, k, v, scale)
    queries = yield ("dcp_all_gather", q)
    back = yield ("dcp_all_to_all", [pack(*attend(qj, k, v, scale)) for qj in queries])
    return merge_partials([unpack(p, q.dtype) for p in back])


def pack(out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """``(out, lse)`` as one fp32 (or wider) tensor ``[..., Dv + 1]`` for a single collective."""
    acc = torch.promote_types(out.dtype, torch.float32)
    return torch.cat([out.to(acc), lse.to(acc).unsqueeze(-1)], dim=-1)


def unpack(packed: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`pack`: ``out`` back in ``dtype``, ``lse`` kept in fp32 or wider."""
    return packed[..., :-1].to(dtype), packed[..., -1]


def prefill_rank(model, mesh: Mesh, rank: int, new_ids: torch.Tensor, start: int, cache: RankCache,
                 interleave: int = 1) -> RankProgram:
    """Rank ``rank``'s PCP prefill of ``new_ids`` at positions ``start..`` (``start`` tokens already
    in the DCP group's ``cache``); returns the last new token's logits (shared with every PCP rank
    by the rank that computes them) and extends ``cache`` by the new positions this rank owns."""
    pcp, dcp, p = mesh.pcp, mesh.dcp, mesh.pcp_rank(rank)
    n = int(new_ids.shape[0])
    indices = torch.tensor(rank_token_indices(n, pcp, p), dtype=torch.long)
    chunks = rank_chunks(n, pcp, p)
    all_positions = torch.arange(start, start + n)
    mine = owned_rows(all_positions, mesh.dcp_rank(rank), dcp, interleave)
    shards = model_shards(model, mesh.tp, mesh.tp_rank(rank))
    hidden = model.model.embed_tokens(new_ids[indices])
    for li, layer in enumerate(model.model.layers):
        q, k, v = _qkv(model, layer, shards[li], hidden, start + indices)
        gathered = yield ("pcp_all_gather", torch.stack([k, v], dim=1))
        kv_new = in_prompt_order(gathered, n, pcp)  # [n, 2, Hkv, D]
        k_new, v_new = kv_new[:, 0], kv_new[:, 1]
        partials = [new_token_attention(q, k_new, v_new, chunks, layer.self_attn.scaling)]
        if start:
            partials.append((yield from _context_attention(q, cache, li, layer.self_attn.scaling, dcp)))
        out, _ = merge_partials(partials)
        hidden = yield from _finish_layer(layer, shards[li], hidden, out, mesh.tp)
        if li == len(cache.keys):
            cache.positions.append(all_positions[mine])
            cache.keys.append(k_new[mine])
            cache.values.append(v_new[mine])
        else:
            cache.positions[li] = torch.cat([cache.positions[li], all_positions[mine]])
            cache.keys[li] = torch.cat([cache.keys[li], k_new[mine]])
            cache.values[li] = torch.cat([cache.values[li], v_new[mine]])
    last = (indices == n - 1).nonzero().flatten()  # one PCP rank computes the last new token
    logits = model.lm_head(model.model.norm(hidden[last]))
    shared = yield ("pcp_all_gather", logits)
    return torch.cat(shared)[0]


def decode_rank(model, mesh: Mesh, rank: int, token: int, position: int, cache: RankCache,
                interleave: int = 1) -> RankProgram:
    """Rank ``rank``'s DCP decode of one token at ``position``; returns its logits."""
    dcp = mesh.dcp
    positions = torch.tensor([position])
    stores = int(owned_rows(positions, mesh.dcp_rank(rank), dcp, interleave).numel()) == 1
    shards = model_shards(model, mesh.tp, mesh.tp_rank(rank))
    hidden = model.model.embed_tokens(torch.tensor([token]))
    for li, layer in enumerate(model.model.layers):
        q, k, v = _qkv(model, layer, shards[li], hidden, positions)
        if stores:
            cache.positions[li] = torch.cat([cache.positions[li], positions])
            cache.keys[li] = torch.cat([cache.keys[li], k])
            cache.values[li] = torch.cat([cache.values[li], v])
        o, _ = yield from _context_attention(q, cache, li, layer.self_attn.scaling, dcp)
        hidden = yield from _finish_layer(layer, shards[li], hidden, o, mesh.tp)
    return model.lm_head(model.model.norm(hidden))[0]

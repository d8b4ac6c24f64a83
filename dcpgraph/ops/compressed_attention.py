"""DeepSeek-V4 attention over a DCP-sharded cache: a raw sliding window plus compressed entries.

One attention layer of V4 is shared-KV MQA (one KV head, keys = values). A query at global position
``p`` (window ``W``, compressor rate ``m``) reads

* the raw tokens ``j`` with ``p − W < j <= p`` (the sliding window),
* the compressed entries ``w < (p + 1) // m`` (:func:`.compressor.visible_entries`), all of them
  (HCA) or, with an indexer (CSA), only the ``k`` it selects,
* and a per-head sink ``s_h``: one more term ``exp(s_h)`` of the softmax denominator, no value.

**Layout under DCP** (``N`` ranks, interleave ``I``): raw token ``t`` lives on rank
``owner(t) = (t // I) % N`` and entry ``w`` (with its indexer key) on ``owner(w)``, the interleave
rule applied to entry indices (:mod:`dcpgraph.layout`), so a rank holds ``1/N`` of the entries
and of the raw window. Each rank attends over the window tokens and entries it holds in one
softmax, giving ``(o_r, lse_r)``; every key is held by exactly one rank, so the log-sum-exp merge
(:mod:`.merge`) over ranks is the dense result, and the sink joins the merged result once::

    lse = logsumexp_r(lse_r)     o = Σ_r exp(lse_r − lse)·o_r     out = o · exp(lse − logaddexp(lse, s_h))

**Sharded top-k** (CSA): each rank scores its own indexer keys, keeps its local top-``k`` by the
tie rule of :mod:`.sparse_kernels`, and the union of the ranks' candidates ranked by the same rule
is exactly the global top-``k`` (:func:`.sparse_kernels.merge_topk`); each rank then reads only the
selected entries it holds.

:class:`ShardedCompressedCache` keeps one request's shards for one layer (the reference the
paged kernels must match); raw tokens no future query can see are dropped after each step, so a
rank holds at most ``(W − 1)``'s share of the window between steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .. import layout
from ..errors import ConfigError
from .kernels import acc_dtype
from .merge import merge_attention_reference
from .sparse_kernels import attend_selected, index_scores, merge_topk, select_topk

NEG_INF = float("-inf")


def dcp_group_heads(num_heads: int, tp: int, dcp: int) -> list[range]:
    """Query heads each DCP group attends for, group ``g`` being TP ranks ``[g·dcp, (g+1)·dcp)``.

    TP splits the ``num_heads`` query heads in ``tp`` runs; the single KV head, and with it the
    window and the entries, is the same for every head, so each DCP group shards one copy of the
    cache over its ``dcp`` ranks and attends for the heads of all its ranks (queries gathered in
    the group, outputs merged and handed back per rank). Needs ``num_heads % tp == 0`` and
    ``tp % dcp == 0``."""
    if not (isinstance(tp, int) and isinstance(dcp, int) and tp >= 1 and dcp >= 1):
        raise ConfigError(f"tp and dcp must be positive ints, got tp={tp!r}, dcp={dcp!r}")
    valid_tp = [t for t in range(1, num_heads + 1) if num_heads % t == 0 and t % dcp == 0]
    if num_heads % tp or tp % dcp:
        raise ConfigError(
            f"compressed attention over tp={tp}, dcp={dcp}: needs num_heads ({num_heads}) % tp == 0 and "
            f"tp % dcp == 0; valid tp for dcp={dcp}: {valid_tp}")
    per_group = num_heads // tp * dcp
    return [range(g * per_group, (g + 1) * per_group) for g in range(tp // dcp)]


def with_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Attention ``out [T, H, D]`` with log-sum-exp ``lse [T, H]`` over all keys → the output once
    the per-head sink ``sinks [H]`` joins the denominator: ``out · exp(lse − logaddexp(lse, s))``
    (0 where no key is visible)."""
    acc = acc_dtype(out.dtype)
    lse = lse.to(acc)
    share = torch.exp(lse - torch.logaddexp(lse, sinks.to(acc).unsqueeze(0)))
    share = torch.where(lse == NEG_INF, 0.0, share)
    return (out.to(acc) * share.unsqueeze(-1)).to(out.dtype)


@dataclass
class RankShard:
    """What one DCP rank holds of one request's layer: raw window tokens (global positions and
    rows ``[n, D]``), compressed entries (global entry indices and rows ``[e, D]``) and, with an
    indexer, the entries' indexer keys ``[e, Di]``."""

    window_positions: torch.Tensor
    window_kv: torch.Tensor
    entry_indices: torch.Tensor
    entry_kv: torch.Tensor
    index_keys: torch.Tensor | None


@dataclass
class ShardedCompressedCache:
    """One request's cache of one V4 attention layer over a DCP group of ``dcp`` ranks."""

    dcp: int
    window: int
    rate: int
    head_dim: int
    index_dim: int = 0
    interleave: int = 1
    dtype: torch.dtype = torch.float32
    shards: list[RankShard] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.window < 1 or self.rate < 1:
            raise ValueError(f"window and rate must be positive ints; got window={self.window}, rate={self.rate}")
        layout.owner(0, self.dcp, self.interleave)  # validates dcp and interleave
        long = torch.empty(0, dtype=torch.int64)
        self.shards = [
            RankShard(long, torch.empty(0, self.head_dim, dtype=self.dtype), long,
                      torch.empty(0, self.head_dim, dtype=self.dtype),
                      torch.empty(0, self.index_dim, dtype=self.dtype) if self.index_dim else None)
            for _ in range(self.dcp)
        ]

    def _owners(self, indices: torch.Tensor) -> torch.Tensor:
        return layout.owner(indices, self.dcp, self.interleave)

    def append_tokens(self, positions: torch.Tensor, kv: torch.Tensor) -> None:
        """Store raw rows ``kv [n, D]`` of global ``positions [n]``, each on its owner rank."""
        owners = self._owners(positions)
        for rank, shard in enumerate(self.shards):
            mine = owners == rank
            shard.window_positions = torch.cat([shard.window_positions, positions[mine]])
            shard.window_kv = torch.cat([shard.window_kv, kv[mine].to(self.dtype)])

    def append_entries(self, first: int, kv: torch.Tensor, index_keys: torch.Tensor | None = None) -> None:
        """Store entries ``first, first + 1, …`` (rows ``kv [e, D]``, indexer keys ``[e, Di]``),
        each on the owner rank of its entry index."""
        if (index_keys is None) != (self.index_dim == 0):
            raise ValueError("indexer keys are given exactly when the layer has an indexer (index_dim > 0)")
        indices = torch.arange(first, first + kv.shape[0], dtype=torch.int64)
        owners = self._owners(indices)
        for rank, shard in enumerate(self.shards):
            mine = owners == rank
            shard.entry_indices = torch.cat([shard.entry_indices, indices[mine]])
            shard.entry_kv = torch.cat([shard.entry_kv, kv[mine].to(self.dtype)])
            if index_keys is not None:
                shard.index_keys = torch.cat([shard.index_keys, index_keys[mine].to(self.dtype)])

    def drop_unreachable(self, next_position: int) -> None:
        """Drop raw tokens ``j <= next_position − W``: no query at ``p >= next_position`` sees them."""
        for shard in self.shards:
            keep = shard.window_positions > next_position - self.window
            shard.window_positions, shard.window_kv = shard.window_positions[keep], shard.window_kv[keep]

    def select(self, index_q: torch.Tensor, weights: torch.Tensor, positions: torch.Tensor, *, topk: int,
               scale: float) -> torch.Tensor:
        """Sharded top-``k``: ``index_q [T, Hi, Di]``, ``weights [T, Hi]`` → the selected global
        entry indices ``[T, topk]`` (−1 padded) of each query, among the entries it may see."""
        if not self.index_dim:
            raise ValueError("this layer has no indexer; only compressed sparse attention layers select entries")
        limit = torch.div(positions + 1, self.rate, rounding_mode="floor")
        values, found = [], []
        for shard in self.shards:
            scores = index_scores(index_q, shard.index_keys, weights, scale)  # [T, e]
            visible = shard.entry_indices.unsqueeze(0) < limit.unsqueeze(1)
            local_values, local = select_topk(scores.masked_fill(~visible, NEG_INF), topk)
            values.append(local_values)
            global_of = torch.cat([shard.entry_indices, shard.entry_indices.new_full((1,), -1)])
            found.append(global_of[torch.where(local >= 0, local, shard.entry_indices.numel())])
        return merge_topk(torch.stack(values), torch.stack(found), topk)

    def rank_partial(self, rank: int, q: torch.Tensor, positions: torch.Tensor, *, scale: float,
                     selected: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank ``rank``'s partial ``(out [T, H, D], lse [T, H])`` of queries ``q [T, H, D]`` at
        global ``positions [T]`` over its window tokens and visible (selected) entries."""
        shard = self.shards[rank]
        p = positions.unsqueeze(1)
        in_window = (shard.window_positions.unsqueeze(0) <= p) & (shard.window_positions.unsqueeze(0) > p - self.window)
        limit = torch.div(positions + 1, self.rate, rounding_mode="floor").unsqueeze(1)
        entries = shard.entry_indices.unsqueeze(0)
        readable = entries < limit
        if selected is not None:
            readable &= (entries.unsqueeze(-1) == selected.unsqueeze(1)).any(-1)
        keys = torch.cat([shard.window_kv, shard.entry_kv]).to(q.dtype).unsqueeze(1)
        return attend_selected(q, keys, keys, torch.cat([in_window, readable], dim=1), scale)

    def attend(self, q: torch.Tensor, positions: torch.Tensor, sinks: torch.Tensor, *, scale: float,
               selected: torch.Tensor | None = None) -> torch.Tensor:
        """The layer's attention output ``[T, H, D]``: every rank's partial, merged by LSE, sinks once."""
        parts = [self.rank_partial(r, q, positions, scale=scale, selected=selected) for r in range(self.dcp)]
        out, lse = merge_attention_reference(torch.stack([o for o, _ in parts]), torch.stack([s for _, s in parts]))
        return with_sinks(out, lse, sinks)

    def held_rows(self) -> list[tuple[int, int]]:
        """Per rank: ``(raw window rows, compressed entries)`` it holds now."""
        return [(int(s.window_positions.numel()), int(s.entry_indices.numel())) for s in self.shards]

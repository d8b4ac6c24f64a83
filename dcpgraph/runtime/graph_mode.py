"""Graph mode for decode: static-shape buckets.

A decode-only step (every scheduled request has exactly one new token) of ``R`` requests is
padded to the smallest bucket ``R_b >= R`` from ``sizes`` (powers of two up to the capture limit),
and the block table to a fixed width, so each bucket is one static-shape graph a backend can
capture once and replay. Per-step lengths, tables and slots stay graph *inputs*, never constants.
Steps beyond the largest bucket, and prefill or mixed steps, run the dynamic-shape graph.

Padding rows are dummy requests of one token each: position 0, context 0, slot −1 (nothing is
written), block-table row 0 (never read: the context is empty), logits index 0. Every attention
op is per request (the context part is empty: ``lse = −inf``, contributing nothing), and every
other op is per token, so real rows are unaffected. With ``pcp > 1`` the padded step's PCP rows are
split anew (:func:`dcpgraph.pcp.step_rows.add_pcp_rows`): every one-token row on PCP rank 0, the
other PCP ranks computing padding, as in a dynamic decode step.
"""

from __future__ import annotations

import torch

from ..mesh import Mesh
from ..pcp.step_rows import add_pcp_rows


def default_buckets(capture_limit: int) -> tuple[int, ...]:
    sizes, size = [], 1
    while size <= capture_limit:
        sizes.append(size)
        size *= 2
    return tuple(sizes)


class DecodeBuckets:
    def __init__(self, sizes: tuple[int, ...], table_width: int):
        self.sizes = tuple(sorted(sizes))
        self.table_width = table_width

    def bucket_for(self, requests: int) -> int | None:
        return next((s for s in self.sizes if s >= requests), None)

    def pad(
        self, shared: dict[str, torch.Tensor], per_rank: list[dict[str, torch.Tensor]], bucket: int, mesh: Mesh
    ) -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
        real = shared["cu_seqlens_q"].numel() - 1
        extra = bucket - real
        if shared["block_table"].shape[1] > self.table_width:
            raise ValueError("block table wider than the graph-mode width")
        table = torch.zeros(bucket, self.table_width, dtype=torch.int32)
        table[:real, : shared["block_table"].shape[1]] = shared["block_table"]
        zeros_i32 = torch.zeros(extra, dtype=torch.int32)
        padded = {
            "input_ids": torch.cat([shared["input_ids"], torch.zeros(1, extra, dtype=torch.int64)], 1),
            "position_ids": torch.cat([shared["position_ids"], torch.zeros(1, extra, dtype=torch.int64)], 1),
            "cu_seqlens_q": torch.arange(bucket + 1, dtype=torch.int32),
            "context_lens": torch.cat([shared["context_lens"], zeros_i32]),
            "block_table": table,
            "logits_indices": torch.arange(bucket, dtype=torch.int64),
        }
        if "block_table_sliding" in shared:  # hybrid_kv_cache: the sliding layers' table, padded alike
            sliding = torch.zeros(bucket, self.table_width, dtype=torch.int32)
            sliding[:real, : shared["block_table_sliding"].shape[1]] = shared["block_table_sliding"]
            padded["block_table_sliding"] = sliding
        no_slot = torch.full((extra,), -1, dtype=torch.int64)
        if "state_slots" in shared:  # recurrent layers: padding rows read and write no state
            padded["state_slots"] = torch.cat([shared["state_slots"], no_slot])
        ranks = []
        for own in per_rank:
            ranks.append({
                **own,
                **{k: torch.cat([own[k], no_slot]) for k in ("slot_mapping", "slot_mapping_sliding") if k in own},
                "local_context_lens": torch.cat([own["local_context_lens"], zeros_i32]),
            })
        if mesh.pcp > 1:  # the bucket's rows split anew: its PCP shapes depend on the bucket alone
            add_pcp_rows(padded, ranks, [1] * bucket, mesh)
        return padded, ranks

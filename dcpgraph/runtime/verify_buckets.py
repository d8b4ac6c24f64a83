"""Graph mode for verification steps: static-shape ``(R_b, q)`` buckets.

A step whose every row is a decode row, each carrying ``0 <= d <= k`` drafts (``1 + d`` query
tokens), is padded to ``R_b`` rows (the smallest decode bucket size ``>= R``) of exactly
``q = 1 + k`` query tokens each, and the block table to the fixed width, so the step is one
static-shape graph per ``(R_b, q)``. The padding follows decode's rules:

- a real row's missing query tokens are appended *after* its real ones: token 0, the following
  positions, slot −1 (nothing is written). New tokens attend causally within their row, so the
  real tokens never see them;
- a padding row is ``q`` dummy tokens at positions ``0 … q−1``, context 0, slot −1, block-table
  row 0 (never read: the context is empty), state slot −1 (recurrent layers: no state read or
  written). A real row's recurrent state does run over its padding tokens;
  :mod:`.state_rollback` restores it to the kept tokens.

Every row yields ``q`` logits rows; :meth:`VerifyBuckets.real_rows` picks the real ones back out
in the unpadded order. Lengths, tables and slots stay graph inputs. With ``pcp > 1`` (``mesh``
given) the padded rows' ``q`` tokens are split over the PCP ranks anew, like a prefill chunk's.
"""

from __future__ import annotations

import torch

from ..mesh import Mesh
from ..pcp.step_rows import add_pcp_rows


class VerifyBuckets:
    def __init__(self, sizes: tuple[int, ...], table_width: int, query_len: int):
        self.sizes = tuple(sorted(sizes))
        self.table_width = table_width
        self.query_len = query_len

    def bucket_for(self, counts: list[int]) -> int | None:
        """The bucket for rows of ``counts`` query tokens, or ``None`` (a row longer than
        ``query_len``, or more rows than the largest bucket)."""
        if any(n > self.query_len for n in counts):
            return None
        return next((s for s in self.sizes if s >= len(counts)), None)

    def pad(self, shared: dict[str, torch.Tensor], per_rank: list[dict[str, torch.Tensor]], bucket: int,
            mesh: Mesh | None = None):
        q = self.query_len
        cu = shared["cu_seqlens_q"].to(torch.int64)
        counts = (cu[1:] - cu[:-1]).tolist()
        real = len(counts)
        if shared["block_table"].shape[1] > self.table_width:
            raise ValueError("block table wider than the graph-mode width")
        # where each real token goes in the padded [bucket * q] layout
        dest = torch.cat([torch.arange(n) + i * q for i, n in enumerate(counts)])
        starts = torch.zeros(bucket, dtype=torch.int64)
        starts[:real] = shared["context_lens"].to(torch.int64)
        positions = (starts[:, None] + torch.arange(q)[None, :]).reshape(1, -1)
        positions[0, dest] = shared["position_ids"][0]
        ids = torch.zeros(1, bucket * q, dtype=torch.int64)
        ids[0, dest] = shared["input_ids"][0]
        zeros_i32 = torch.zeros(bucket - real, dtype=torch.int32)
        padded = {
            "input_ids": ids,
            "position_ids": positions,
            "cu_seqlens_q": torch.arange(bucket + 1, dtype=torch.int32) * q,
            "context_lens": torch.cat([shared["context_lens"], zeros_i32]),
            "logits_indices": torch.arange(bucket * q, dtype=torch.int64),
        }
        for name in ("block_table", "block_table_sliding"):  # the sliding one with hybrid_kv_cache
            if name in shared:
                table = torch.zeros(bucket, self.table_width, dtype=torch.int32)
                table[:real, : shared[name].shape[1]] = shared[name]
                padded[name] = table
        if "state_slots" in shared:  # recurrent layers: padding rows read and write no state
            padded["state_slots"] = torch.cat([shared["state_slots"], torch.full((bucket - real,), -1, dtype=torch.int64)])
        ranks = []
        for own in per_rank:
            slots = {}
            for name in ("slot_mapping", "slot_mapping_sliding"):
                if name in own:
                    slots[name] = torch.full((bucket * q,), -1, dtype=torch.int64)
                    slots[name][dest] = own[name]
            ranks.append({**own, **slots, "local_context_lens": torch.cat([own["local_context_lens"], zeros_i32])})
        if mesh is not None and mesh.pcp > 1:  # every padded row's q tokens split over the PCP ranks anew
            add_pcp_rows(padded, ranks, [q] * bucket, mesh)
        return padded, ranks

    def real_rows(self, shared: dict[str, torch.Tensor], logits_rows: list[int]) -> torch.Tensor:
        """Indices into the padded step's logits of the unpadded step's logits rows."""
        cu = shared["cu_seqlens_q"].to(torch.int64)
        counts = (cu[1:] - cu[:-1]).tolist()
        return torch.cat([torch.arange(n - r, n) + i * self.query_len
                          for i, (n, r) in enumerate(zip(counts, logits_rows))])

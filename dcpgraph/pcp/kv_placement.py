"""Where a PCP prefill's new K/V goes: each DCP rank keeps exactly the positions it owns.

After the per-layer exchange every PCP rank holds the new K/V of all ``n`` tokens, so the write
into the DCP layout needs no further communication: DCP rank ``d`` keeps the positions ``x`` with
``owner(x) = (x // I) mod dcp = d`` (:func:`dcpgraph.layout.owner`).
"""

from __future__ import annotations

import torch

from ..layout import owner


def owned_rows(positions: torch.Tensor, dcp_rank: int, dcp: int, interleave: int) -> torch.Tensor:
    """Indices into ``positions`` of the tokens DCP rank ``dcp_rank`` stores."""
    return torch.nonzero(owner(positions, dcp, interleave) == dcp_rank).flatten()

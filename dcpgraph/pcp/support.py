"""What runs with ``pcp > 1``, refused by name before any tracing, pass or collective.

``dcpgraph.compile`` runs ``pcp > 1`` for GQA and MLA models (no sparse/SFA or compressed
attention, no sliding windows, soft-caps or sinks — refused by :mod:`dcpgraph.passes.split_pcp_prefill`
— and no recurrent layers), emulated or on a ``torch.distributed`` world of ``tp·pcp`` ranks, without speculative decoding, ``hybrid_kv_cache``,
data-parallel expert replicas or graph-mode decode buckets (the engine turns those off):
:mod:`dcpgraph.passes.split_pcp_prefill` splits each step's tokens over the PCP ranks. ``LLM`` and
``dcpgraph serve`` (which start one worker process per TP rank, and P/D) refuse ``pcp > 1``. The
eager path (:mod:`dcpgraph.pcp.eager`) runs Llama/Qwen3 on real process groups.
"""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError
from ..mesh import Mesh

COMPILED = ("GQA (Llama, Qwen3, ...) and MLA (DeepSeek-V2/V3) models through dcpgraph.compile, emulated or on a torch.distributed world "
            "of tp·pcp ranks, with chunked prefill and prefix caching")


def refuse_pcp_execution(mesh: Mesh) -> None:
    """``LLM`` / ``dcpgraph serve``: raise :class:`ConfigError` for ``pcp > 1``, naming what runs."""
    if mesh.pcp == 1:
        return
    raise ConfigError(
        f"prefill_context_parallel_size={mesh.pcp} (tp={mesh.tp}, dcp={mesh.dcp}) is a valid mesh, but LLM and "
        "dcpgraph serve (worker processes, P/D) run prefill_context_parallel_size=1 only. pcp > 1 runs for "
        f"{COMPILED}; and eagerly on process groups in dcpgraph.pcp.eager (see docs/user-guide/pcp.md)"
    )


def refuse_pcp_compile(mesh: Mesh, facts: Any, opts: dict[str, Any]) -> None:
    """``dcpgraph.compile``: raise :class:`ConfigError` for what ``pcp > 1`` does not run, by name."""
    if mesh.pcp == 1:
        return
    extra = facts.extra
    refused = []
    if extra.get("compressed_layers"):
        refused.append("compressed attention layers (only dense GQA and MLA attention is split over PCP ranks)")
    if extra.get("recurrent_layers") or extra.get("stateless_layers"):
        refused.append("recurrent (hybrid) layers")
    if opts.get("speculative_config") is not None:
        refused.append("speculative decoding")
    if opts.get("hybrid_kv_cache"):
        refused.append("hybrid_kv_cache")
    if opts.get("expert_replicas") is not None:
        refused.append("expert_replicas (data-parallel expert replicas)")
    if refused:
        raise ConfigError(
            f"prefill_context_parallel_size={mesh.pcp} (tp={mesh.tp}, dcp={mesh.dcp}) does not run with "
            f"{'; '.join(refused)}. pcp > 1 runs for {COMPILED}; use pcp=1 for the rest"
        )

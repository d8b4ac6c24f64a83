"""What runs with ``pcp > 1``, refused by name before any tracing, pass or collective.

``dcpgraph.compile`` runs ``pcp > 1`` for GQA, MLA, sparse (SFA/DSA) and compressed (DeepSeek-V4
CSA/HCA) attention, with sliding windows, soft-caps, sinks or chunks (no recurrent layers; layers without
attention are refused by :mod:`dcpgraph.passes.split_pcp_prefill`), emulated or on a ``torch.distributed``
world of ``tp·pcp`` ranks, with ngram speculative decoding (a verify step of ``k + 1`` tokens a
request is split over the PCP ranks like a prefill chunk), draft-model speculative decoding (the
draft is compiled on the same mesh, so its own steps are split the same way) and MTP speculative
decoding (the MTP layer's program is split the same way: its ``hidden_states`` input, the target's
gathered final hidden states, is read at the rank's rows and its output state gathered back), with
graph-mode decode and verification buckets (a padded bucket's PCP rows are split anew,
:func:`dcpgraph.pcp.step_rows.add_pcp_rows`), without ``hybrid_kv_cache`` or data-parallel expert
replicas:
:mod:`dcpgraph.passes.split_pcp_prefill` splits each step's tokens over the PCP ranks. ``LLM`` and
``dcpgraph serve`` run ``pcp > 1`` with one worker process per rank of the ``tp·pcp`` world (or the
emulator), on one node, with the same speculative methods, without data-parallel replicas;
as a P/D producer (``kv_role`` ``kv_producer``: the connector places its ranks in attention order)
but not as a consumer. The
eager path (:mod:`dcpgraph.pcp.eager`) runs Llama/Qwen3 on real process groups.
"""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError
from ..mesh import Mesh

COMPILED = ("GQA (Llama, Qwen3, ...), MLA (DeepSeek-V2/V3), SFA (DeepSeek-V3.2) and compressed (DeepSeek-V4) "
            "models, sliding-window, soft-capped "
            "and sink attention included, through dcpgraph.compile, emulated or on a torch.distributed world "
            "of tp·pcp ranks, with chunked prefill, prefix caching and ngram, draft-model or MTP speculative "
            "decoding")


def refuse_pcp_execution(mesh: Mesh, *, data_parallel: int = 1, nnodes: int = 1,
                         kv_role: str | None = None) -> None:
    """``LLM`` / ``dcpgraph serve``: raise :class:`ConfigError` for what ``pcp > 1`` does not run
    there (data-parallel replicas, several nodes, a P/D consumer: ``kv_role`` ``kv_consumer`` or
    ``kv_both``), naming what runs. Every speculative method runs: each worker's proposer drives
    its rank's copy of the draft or MTP program, split over the PCP group like the target's. A P/D
    producer runs: after a PCP prefill its ``tp·pcp`` ranks hold the DCP layout, moved by the
    connector's plan in attention order. A consumer only decodes, where PCP replicas repeat the dense work: the same
    ranks at ``tp·pcp`` TP with DCP hold the same KV shards and split that work instead."""
    if mesh.pcp == 1:
        return
    consumer = kv_role in ("kv_consumer", "kv_both")
    refused = [name for name, on in ((f"data_parallel_size={data_parallel}", data_parallel > 1),
                                     (f"nnodes={nnodes}", nnodes > 1),
                                     (f"P/D kv_role={kv_role!r} (a PCP instance runs P/D as kv_producer only: "
                                      "serve the decode side at prefill_context_parallel_size=1)", consumer)) if on]
    if refused:
        raise ConfigError(
            f"prefill_context_parallel_size={mesh.pcp} (tp={mesh.tp}, dcp={mesh.dcp}) does not run in LLM / "
            f"dcpgraph serve with {'; '.join(refused)}. LLM and dcpgraph serve run pcp > 1 with one worker process "
            f"per rank of the tp·pcp world on one node, for {COMPILED} (and as a P/D kv_producer); use "
            "prefill_context_parallel_size=1 for the "
            "rest (see docs/user-guide/pcp.md)"
        )


def refuse_pcp_compile(mesh: Mesh, facts: Any, opts: dict[str, Any]) -> None:
    """``dcpgraph.compile``: raise :class:`ConfigError` for what ``pcp > 1`` does not run, by name."""
    if mesh.pcp == 1:
        return
    extra = facts.extra
    refused = []
    if extra.get("recurrent_layers") or extra.get("stateless_layers"):
        refused.append("recurrent (hybrid) layers")
    if opts.get("hybrid_kv_cache"):
        refused.append("hybrid_kv_cache")
    if opts.get("expert_replicas") is not None:
        refused.append("expert_replicas (data-parallel expert replicas)")
    if refused:
        raise ConfigError(
            f"prefill_context_parallel_size={mesh.pcp} (tp={mesh.tp}, dcp={mesh.dcp}) does not run with "
            f"{'; '.join(refused)}. pcp > 1 runs for {COMPILED}; use pcp=1 for the rest"
        )

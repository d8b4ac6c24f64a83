"""Start-up capture: every graph a step can select is compiled before the engine takes work.

:func:`capture_graphs` runs each decode bucket's static-shape graph, each verification bucket's
(speculative decoding), and the mixed graph, once with inputs that neither read nor write the KV
cache: every row is a request with an empty
context (``context_lens = 0``: attention reads no cache block) whose new tokens all have slot
−1 (nothing is written). Block-table entries are block 0, which an empty context never reads.
The caches and every later step are therefore exactly as without capture; only the backend's
compiled code (and its guards) exist afterwards.

The mixed graph runs twice, with one request (one block-table column, one logits row) and with
two requests of different lengths and more logits rows than requests: the shapes serving meets,
so a dynamic-shape backend compiles for both before any request arrives.

A draft model (``speculative_config`` method ``draft_model``) and an MTP module (``mtp``) have
their own executor and compiled graphs: they are captured the same way, named ``draft …``; the MTP
program's extra ``hidden_states`` input is zeros, one row per token.

The wall time of each capture run is reported per graph (``Engine.report()["compile"]``) and
logged once at INFO on ``dcpgraph.runtime.capture``; :class:`~dcpgraph.backends.compile_log.CompileLog`
counts compiles from then on.
"""

from __future__ import annotations

import logging
import time

import torch

from .step_inputs import Chunk, build_step_inputs

log = logging.getLogger(__name__)

# (new tokens per request, logits rows per request): one request; two with drafts verified.
MIXED_SHAPES = (((3,), (1,)), ((4, 3), (2, 3)))
BLOCK_TABLE_WIDTHS = (1, 3)


def _quiet_inputs(tokens: tuple[int, ...], logits_rows: tuple[int, ...], width: int, runner):
    sliding = (0,) * width if runner.program.lowering.sliding_caches else None  # hybrid_kv_cache
    chunks = [
        Chunk(request_id=-1 - i, tokens=(0,) * n, start=0, block_table=(0,) * width, logits_rows=rows,
              sliding_table=sliding)
        for i, (n, rows) in enumerate(zip(tokens, logits_rows))
    ]
    shared, per_rank = build_step_inputs(chunks, runner.mesh, runner.block_size, runner.interleave)
    for own in per_rank:
        for name in ("slot_mapping", "slot_mapping_sliding"):  # write nothing
            if name in own:
                own[name].fill_(-1)
    return shared, per_rank


def _run(runner, shared, per_rank, key) -> None:
    """One quiet step; a program with a ``hidden_states`` input (MTP) gets zero rows for it."""
    hidden = next((n for n in runner.program.graph_module.graph.nodes
                   if n.op == "placeholder" and n.name == "hidden_states"), None)
    if hidden is not None:
        val = hidden.meta["val"]
        shared = {**shared, "hidden_states": torch.zeros(1, shared["input_ids"].shape[1], val.shape[-1],
                                                         dtype=val.dtype)}
    runner.executor.run(shared, per_rank, key)


def _capture_runner(runner, seconds: dict[str, float], prefix: str) -> None:
    for bucket in runner.buckets.sizes if runner.buckets is not None else ():
        shared, per_rank = _quiet_inputs((1,), (1,), 1, runner)
        shared, per_rank = runner.buckets.pad(shared, per_rank, bucket, runner.mesh)
        start = time.perf_counter()
        _run(runner, shared, per_rank, ("decode", bucket))
        seconds[f"{prefix}decode[{bucket}]"] = time.perf_counter() - start
    verify = getattr(runner, "verify_buckets", None)
    for bucket in verify.sizes if verify is not None else ():
        q = verify.query_len
        shared, per_rank = _quiet_inputs((q,), (q,), 1, runner)
        shared, per_rank = verify.pad(shared, per_rank, bucket, runner.mesh)
        start = time.perf_counter()
        _run(runner, shared, per_rank, ("verify", f"{bucket}x{q}"))
        seconds[f"{prefix}verify[{bucket}x{q}]"] = time.perf_counter() - start
    start = time.perf_counter()
    for (tokens, rows), width in zip(MIXED_SHAPES, BLOCK_TABLE_WIDTHS):
        _run(runner, *_quiet_inputs(tokens, rows, width, runner), "mixed")
    seconds[f"{prefix}mixed"] = time.perf_counter() - start


def capture_graphs(runner, graphs) -> dict[str, float]:
    """Compile and run once every decode and verification bucket of ``runner``, its mixed graph,
    and the same for a draft model's runner; returns the wall seconds of each graph's capture and
    marks ``graphs.log`` (and the draft's) started."""
    seconds: dict[str, float] = {}
    if graphs is None or not graphs.runs_compiled:
        return seconds
    _capture_runner(runner, seconds, "")
    proposer = runner.proposer
    draft = getattr(proposer, "runner", None) or (proposer if hasattr(proposer, "executor") else None)
    draft_graphs = getattr(getattr(draft, "executor", None), "graphs", None)
    if draft is not None and draft_graphs is not None and draft_graphs.runs_compiled:
        draft_seconds: dict[str, float] = {}
        _capture_runner(draft, draft_seconds, "draft ")
        draft_graphs.log.mark_started(draft_seconds)
        seconds.update(draft_seconds)
    graphs.log.mark_started(seconds)
    log.info("dcpgraph: %s graphs captured at start-up in %.1f s (%s)", graphs.name, sum(seconds.values()),
             ", ".join(f"{k} {v:.1f} s" for k, v in seconds.items()))
    return seconds

"""Start-up capture: every graph a step can select is compiled before the engine takes work.

:func:`capture_graphs` runs each decode bucket's static-shape graph, and the mixed graph, once
with inputs that neither read nor write the KV cache: every row is a request with an empty
context (``context_lens = 0``: attention reads no cache block) whose new tokens all have slot
−1 (nothing is written). Block-table entries are block 0, which an empty context never reads.
The caches and every later step are therefore exactly as without capture; only the backend's
compiled code (and its guards) exist afterwards.

The mixed graph runs twice, with one request (one block-table column, one logits row) and with
two requests of different lengths and more logits rows than requests: the shapes serving meets,
so a dynamic-shape backend compiles for both before any request arrives.

The wall time of each capture run is reported per graph (``Engine.report()["compile"]``) and
logged once at INFO on ``dcpgraph.runtime.capture``; :class:`~dcpgraph.backends.compile_log.CompileLog`
counts compiles from then on.
"""

from __future__ import annotations

import logging
import time

from .step_inputs import Chunk, build_step_inputs

log = logging.getLogger(__name__)

# (new tokens per request, logits rows per request): one request; two with drafts verified.
MIXED_SHAPES = (((3,), (1,)), ((4, 3), (2, 3)))
BLOCK_TABLE_WIDTHS = (1, 3)


def _quiet_inputs(tokens: tuple[int, ...], logits_rows: tuple[int, ...], width: int, runner):
    chunks = [
        Chunk(request_id=-1 - i, tokens=(0,) * n, start=0, block_table=(0,) * width, logits_rows=rows)
        for i, (n, rows) in enumerate(zip(tokens, logits_rows))
    ]
    shared, per_rank = build_step_inputs(chunks, runner.mesh, runner.block_size, runner.interleave)
    for own in per_rank:
        own["slot_mapping"].fill_(-1)  # write nothing
    return shared, per_rank


def capture_graphs(runner, graphs) -> dict[str, float]:
    """Compile and run once every decode bucket of ``runner`` and its mixed graph; returns the
    wall seconds of each graph's capture and marks ``graphs.log`` started."""
    seconds: dict[str, float] = {}
    if graphs is None or not graphs.runs_compiled:
        return seconds
    executor = runner.executor
    for bucket in runner.buckets.sizes if runner.buckets is not None else ():
        shared, per_rank = _quiet_inputs((1,), (1,), 1, runner)
        shared, per_rank = runner.buckets.pad(shared, per_rank, bucket, runner.mesh)
        start = time.perf_counter()
        executor.run(shared, per_rank, ("decode", bucket))
        seconds[f"decode[{bucket}]"] = time.perf_counter() - start
    start = time.perf_counter()
    for (tokens, rows), width in zip(MIXED_SHAPES, BLOCK_TABLE_WIDTHS):
        executor.run(*_quiet_inputs(tokens, rows, width, runner), "mixed")
    seconds["mixed"] = time.perf_counter() - start
    graphs.log.mark_started(seconds)
    log.info("dcpgraph: %s graphs captured at start-up in %.1f s (%s)", graphs.name, sum(seconds.values()),
             ", ".join(f"{k} {v:.1f} s" for k, v in seconds.items()))
    return seconds

"""How many KV blocks a cache budget buys on one rank: the sizing shared by the engine
(:mod:`dcpgraph.runtime.engine`, :mod:`dcpgraph.runtime.layer_groups`) and by compile-time
choices that depend on it (``comm="auto"``, :mod:`dcpgraph.passes.shard_dcp_auto`). Pure
functions of a program's caches and options; bytes come from :mod:`dcpgraph.capacity`'s one
formula, shared with the planner.
"""

from __future__ import annotations

import math

from .capacity import bytes_per_block, cache_shapes
from .program import Program


def kv_bytes_per_block(program: Program) -> int:
    """Bytes of one physical block (``block_size`` tokens) of every cache on one rank."""
    return bytes_per_block(cache_shapes(program.caches), int(program.lowering.block_size))


def scratch_blocks(program: Program) -> int:
    """Blocks a rank's caches hold beyond the ones requests get: 1 for a program with compressed
    (DeepSeek-V4) layers, whose ops write padding rows into block 0, never handed out
    (:mod:`dcpgraph.runtime.blocks`); 0 otherwise."""
    return 1 if program.facts.extra.get("compressed_layers") else 0


def kv_bytes_per_block_by_layer(program: Program) -> dict[int, int]:
    """Layer -> bytes of one physical block of that layer's caches on one rank (fp8 scales
    included); the values sum to :func:`kv_bytes_per_block`. Layers of different shapes (head dim,
    KV heads) differ here."""
    block = int(program.lowering.block_size)
    layers = sorted({c.layer for c in program.caches})
    return {layer: bytes_per_block(cache_shapes(c for c in program.caches if c.layer == layer), block)
            for layer in layers}


def group_bytes_per_block(program: Program) -> tuple[int, int]:
    """Bytes of one physical block of the full group's caches and of the sliding group's, per rank."""
    sliding = set(program.lowering.sliding_caches)
    block = int(program.lowering.block_size)
    full = bytes_per_block(cache_shapes(c for c in program.caches if c.name not in sliding), block)
    return full, bytes_per_block(cache_shapes(c for c in program.caches if c.name in sliding), block)


def window_blocks(window: int, chunk_tokens: int, tokens_per_block: int) -> int:
    """Most sliding blocks one request holds: the ``window − 1`` keys before its first new token,
    a chunk of ``chunk_tokens`` new tokens (drafts included), and one block of misalignment."""
    return math.ceil((window - 1 + chunk_tokens) / tokens_per_block) + 1


def sliding_pool_blocks(full_blocks: int, window: int, *, decode_tokens: int, step_tokens: int,
                        tokens_per_block: int, max_num_seqs: int) -> int:
    """Sliding-pool size: ``max_num_seqs`` requests' :func:`window_blocks` for a decode row of
    ``decode_tokens`` (1 + draft tokens), ``ceil(step_tokens / tokens_per_block)`` blocks for one
    step's token budget, and the null block; at most the full pool's size plus the null block
    (what uniform sizing gives every layer). It is at least ``window_blocks(W, step_tokens) + 1``,
    so any one request fits alone."""
    wanted = (max_num_seqs * window_blocks(window, decode_tokens, tokens_per_block)
              + math.ceil(step_tokens / tokens_per_block) + 1)
    return min(wanted, full_blocks + 1)


def split_byte_budget(budget: int, full_bytes_per_block: int, sliding_bytes_per_block: int, window: int, *,
                      decode_tokens: int, step_tokens: int, tokens_per_block: int, max_num_seqs: int) -> int:
    """Full-pool blocks for a per-rank byte budget, the sliding pool taking
    :func:`sliding_pool_blocks` of it (at least one full block)."""
    uniform = max(1, budget // (full_bytes_per_block + sliding_bytes_per_block))
    sliding = sliding_pool_blocks(uniform, window, decode_tokens=decode_tokens, step_tokens=step_tokens,
                                  tokens_per_block=tokens_per_block, max_num_seqs=max_num_seqs)
    return max(1, (budget - sliding * sliding_bytes_per_block) // full_bytes_per_block)


def blocks_for_budget(program: Program, *, num_blocks=None, kv_cache_tokens=None, kv_cache_bytes_per_rank=None,
                      max_model_len: int, max_num_seqs: int, decode_tokens: int = 1, step_tokens: int = 1) -> int:
    """Cache size in blocks from whichever budget the user gave (default: every sequence slot
    at ``max_model_len``). For a ``hybrid_kv_cache`` program these are the full group's blocks;
    a byte budget is split with the sliding pool (``decode_tokens``: 1 + draft tokens,
    ``step_tokens``: one step's token budget; see :func:`split_byte_budget`). A byte budget pays
    for :func:`scratch_blocks` too; the count returned is the blocks requests get."""
    per_block = kv_bytes_per_block(program)
    tokens_per_block = int(program.lowering.block_size) * program.mesh.dcp
    given = [x is not None for x in (num_blocks, kv_cache_tokens, kv_cache_bytes_per_rank)]
    if sum(given) > 1:
        raise ValueError("give at most one of num_blocks, kv_cache_tokens, kv_cache_bytes_per_rank")
    if num_blocks is not None:
        return int(num_blocks)
    if kv_cache_bytes_per_rank is not None and program.lowering.sliding_caches:
        full_bpb, sliding_bpb = group_bytes_per_block(program)
        return split_byte_budget(int(kv_cache_bytes_per_rank), full_bpb, sliding_bpb, int(program.lowering.sliding_window),
                                 decode_tokens=decode_tokens, step_tokens=step_tokens,
                                 tokens_per_block=tokens_per_block, max_num_seqs=max_num_seqs)
    if kv_cache_bytes_per_rank is not None:  # the scratch block is paid from the same bytes
        return max(1, int(kv_cache_bytes_per_rank) // per_block - scratch_blocks(program))
    tokens = kv_cache_tokens if kv_cache_tokens is not None else max_model_len * max_num_seqs
    return max(1, math.ceil(tokens / tokens_per_block))

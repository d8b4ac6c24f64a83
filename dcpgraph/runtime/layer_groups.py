"""Per-layer-group KV cache sizing (``hybrid_kv_cache=True``): sliding-window layers keep only
their window.

A program compiled with ``hybrid_kv_cache`` (pass ``layer_group_tables``) addresses its caches in
two groups: the *full* group (full-attention layers) through ``block_table``/``slot_mapping``, the
*sliding* group (every layer with a window, the largest window ``W``) through
``block_table_sliding``/``slot_mapping_sliding``. Both tables index the same virtual blocks of
``tokens_per_block = block_size · dcp`` consecutive positions; they differ in which physical block
backs each entry:

- the full group: one block per virtual block, as :class:`~.blocks.BlockManager` always did;
- the sliding group: a separate, smaller pool. Once a request has ``computed`` tokens, every
  future query is at a position ``>= computed`` and sees keys ``>= computed − W + 1`` only, so
  virtual block ``j`` is dead for it when ``(j + 1) · tokens_per_block <= computed − W + 1``
  (:meth:`HybridBlockManager.trim`). A dead entry is returned to the pool and replaced by the
  null block ``0``, which nothing ever writes (its values stay zero, finite) and which the paged
  read gathers but masks (keys before ``kv_start``). Under DCP a virtual block is one physical
  block on every rank of the group and covers one contiguous range of positions, so "dead" is
  the same decision on every rank.

A request therefore holds at most ``window_blocks(W, chunk)`` sliding blocks, however long its
context: the window, the step's chunk (tokens and drafts) and one block of misalignment. The
sliding pool (:func:`sliding_pool_blocks`) holds ``max_num_seqs`` decoding requests' windows, the
blocks of one step's token budget on top, and the null block, never more than uniform sizing
would give it; it always fits the largest single request, and when concurrent prefill chunks
need more the scheduler preempts as for the full pool. Allocation and growth
are all or nothing across both groups, so the scheduler's preemption works unchanged: a request
that cannot grow in either group preempts the youngest, and every request fits both pools alone.

Not supported with ``hybrid_kv_cache`` (refused by :func:`check_hybrid_options`): prefix caching
(a dead sliding block cannot be revived for a later request's prefix hit), ``whole_request``
allocation, and KV transfer between engines.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from ..errors import ConfigError
from ..kv_budget import (  # noqa: F401  (re-exported: the engine sizes pools with them)
    group_bytes_per_block,
    scratch_blocks,
    sliding_pool_blocks,
    split_byte_budget,
    window_blocks,
)
from .blocks import BlockManager

NULL_BLOCK = 0


def check_hybrid_options(*, enable_prefix_caching: bool, kv_allocation: str, draft_model: bool = False) -> None:
    if draft_model:
        raise ConfigError("hybrid_kv_cache=True cannot be combined with a draft_model speculative_config: the "
                          "draft's cache is addressed by the target's one block table, which sliding layers no "
                          "longer share; use method='ngram' or hybrid_kv_cache=False")
    if enable_prefix_caching:
        raise ConfigError("hybrid_kv_cache=True cannot be combined with enable_prefix_caching=True: a "
                          "sliding layer's dropped blocks cannot serve a later prefix hit")
    if kv_allocation != "on_demand":
        raise ConfigError(f"hybrid_kv_cache=True needs kv_allocation='on_demand', got {kv_allocation!r}")


class HybridBlockManager(BlockManager):
    """:class:`BlockManager` for the full group, plus a window-bounded sliding group.

    ``table(r)`` is the full group's table, :meth:`group_table` the sliding group's (same length,
    dead entries :data:`NULL_BLOCK`)."""

    def __init__(self, num_blocks: int, sliding_blocks: int, tokens_per_block: int, window: int, *,
                 scratch_block: bool = False):
        super().__init__(num_blocks, tokens_per_block, enable_prefix_caching=False, scratch_block=scratch_block)
        if sliding_blocks < 2:
            raise ValueError(f"the sliding pool needs the null block and at least one more, got {sliding_blocks}")
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.sliding_blocks = sliding_blocks
        self.window = window
        self._sliding_free: deque[int] = deque(range(sliding_blocks - 1, NULL_BLOCK, -1))
        self._sliding: dict[int, list[int]] = {}
        self._dead: dict[int, int] = {}  # request -> leading entries already nulled
        self._frozen_sliding: dict[int, tuple[int, ...]] = {}  # request -> its sliding table, until it changes
        self.sliding_stats = {"peak_used": 0, "dropped": 0}

    # -- the sliding group ---------------------------------------------------------------------
    @property
    def sliding_free_blocks(self) -> int:
        return len(self._sliding_free)

    @property
    def sliding_used_blocks(self) -> int:
        return self.sliding_blocks - 1 - len(self._sliding_free)

    def group_table(self, request_id: int) -> list[int]:
        return self._sliding[request_id]

    def frozen_group_table(self, request_id: int) -> tuple[int, ...]:
        """The sliding table as a tuple, made again only after :meth:`trim` nulled an entry or the
        table grew: between block boundaries a decode step copies none of it."""
        frozen = self._frozen_sliding.get(request_id)
        if frozen is None:
            frozen = self._frozen_sliding[request_id] = tuple(self._sliding[request_id])
        return frozen

    def dead_blocks(self, computed: int) -> int:
        """Leading virtual blocks no query at a position ``>= computed`` can see."""
        return max(0, (computed - self.window + 1) // self.tokens_per_block)

    def trim(self, request_id: int, computed: int) -> None:
        """Return the sliding blocks of ``request_id`` that fell out of the window."""
        table = self._sliding[request_id]
        dead = min(self.dead_blocks(computed), len(table))
        first = self._dead.get(request_id, 0)
        for j in range(first, dead):
            self._sliding_free.append(table[j])
            table[j] = NULL_BLOCK
            self.sliding_stats["dropped"] += 1
        if dead > first:
            self._frozen_sliding.pop(request_id, None)
        self._dead[request_id] = max(dead, first)

    def _take(self, request_id: int, count: int) -> None:
        if count:
            self._frozen_sliding.pop(request_id, None)
        self._sliding[request_id].extend(self._sliding_free.pop() for _ in range(count))
        self.sliding_stats["peak_used"] = max(self.sliding_stats["peak_used"], self.sliding_used_blocks)

    # -- BlockManager's interface, all or nothing across both groups ----------------------------
    def can_allocate(self, tokens: int, prefix: Sequence[int] = ()) -> bool:
        return self.blocks_for(tokens) <= self.sliding_free_blocks and super().can_allocate(tokens, prefix)

    def allocate(self, request_id: int, tokens: int, prefix: Sequence[int] = ()) -> list[int]:
        if self.blocks_for(tokens) > self.sliding_free_blocks:
            raise MemoryError(f"need {self.blocks_for(tokens)} sliding blocks, {self.sliding_free_blocks} free")
        table = super().allocate(request_id, tokens, prefix)
        self._sliding[request_id] = []
        self._take(request_id, self.blocks_for(tokens))
        return table

    def room(self, request_id: int) -> int:
        sliding = (len(self._sliding[request_id]) + self.sliding_free_blocks) * self.tokens_per_block
        return min(super().room(request_id), sliding)

    def grow(self, request_id: int, tokens: int) -> bool:
        table = self._sliding[request_id]
        need = max(0, self.blocks_for(tokens) - len(table))
        if need > self.sliding_free_blocks or not super().grow(request_id, tokens):
            return False
        self._take(request_id, need)
        return True

    def release(self, request_id: int) -> None:
        for block in self._sliding.pop(request_id):
            if block != NULL_BLOCK:
                self._sliding_free.append(block)
        self._dead.pop(request_id, None)
        self._frozen_sliding.pop(request_id, None)
        super().release(request_id)


def make_block_manager(program, num_blocks: int, *, enable_prefix_caching: bool, kv_allocation: str,
                       max_num_seqs: int, decode_tokens: int, step_tokens: int):
    """``(block manager, cache block counts)`` for ``program``: a plain :class:`BlockManager` and
    one count for every cache, or for a ``hybrid_kv_cache`` program a :class:`HybridBlockManager`
    and ``{"full": …, "sliding": pool}``. A program with compressed layers (V4) gets the scratch
    block 0 (:class:`BlockManager`), so its caches hold ``num_blocks + 1`` blocks."""
    tokens_per_block = int(program.lowering.block_size) * program.mesh.dcp
    scratch = bool(scratch_blocks(program))  # V4: padding rows write into block 0
    if not program.lowering.sliding_caches:
        blocks = BlockManager(num_blocks, tokens_per_block, enable_prefix_caching, scratch_block=scratch)
        return blocks, blocks.cache_blocks
    check_hybrid_options(enable_prefix_caching=enable_prefix_caching, kv_allocation=kv_allocation)
    window = int(program.lowering.sliding_window)
    pool = sliding_pool_blocks(num_blocks, window, decode_tokens=decode_tokens, step_tokens=step_tokens,
                               tokens_per_block=tokens_per_block, max_num_seqs=max_num_seqs)
    blocks = HybridBlockManager(num_blocks, pool, tokens_per_block, window, scratch_block=scratch)
    return blocks, {"full": blocks.cache_blocks, "sliding": pool}


def layer_group_report(program, blocks: HybridBlockManager) -> dict:
    """``memory_report``'s per-group figures: blocks and bytes per rank of each group, and the
    bytes uniform sizing (every layer one block per virtual block) would take for the same
    capacity."""
    full_bpb, sliding_bpb = group_bytes_per_block(program)
    full, sliding = blocks.num_blocks * full_bpb, blocks.sliding_blocks * sliding_bpb
    return {
        "full": {"num_blocks": blocks.num_blocks, "bytes_per_rank": full},
        "sliding": {"num_blocks": blocks.sliding_blocks, "bytes_per_rank": sliding, "window": blocks.window,
                    "peak_used_blocks": blocks.sliding_stats["peak_used"],
                    "dropped_blocks": blocks.sliding_stats["dropped"]},
        "uniform_bytes_per_rank": blocks.num_blocks * (full_bpb + sliding_bpb),
        "saved_bytes_per_rank": blocks.num_blocks * (full_bpb + sliding_bpb) - full - sliding,
    }

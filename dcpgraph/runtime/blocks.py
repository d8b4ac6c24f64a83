"""Virtual-block manager.

The scheduler deals in *virtual blocks* of ``block_size · dcp`` tokens. Virtual block ``b`` is
physical block ``b`` on every rank of a DCP group (each holding its own share of the block's
tokens), so one block table serves the whole group. Admission reserves every block a request can
ever need (prompt + max new tokens), so a running request never waits for memory and nothing is
ever preempted or half-written.
"""

from __future__ import annotations

import math


class BlockManager:
    def __init__(self, num_blocks: int, tokens_per_block: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.tokens_per_block = tokens_per_block
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self._tables: dict[int, list[int]] = {}

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.tokens_per_block

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.tokens_per_block)

    def can_reserve(self, tokens: int) -> bool:
        return self.blocks_for(tokens) <= len(self._free)

    def reserve(self, request_id: int, tokens: int) -> list[int]:
        """Give ``request_id`` blocks for ``tokens`` tokens (its block-table row)."""
        if request_id in self._tables:
            raise ValueError(f"request {request_id} already holds blocks")
        need = self.blocks_for(tokens)
        if need > len(self._free):
            raise MemoryError(f"need {need} blocks, {len(self._free)} free")
        table = [self._free.pop() for _ in range(need)]
        self._tables[request_id] = table
        return table

    def table(self, request_id: int) -> list[int]:
        return self._tables[request_id]

    def release(self, request_id: int) -> None:
        self._free.extend(reversed(self._tables.pop(request_id)))

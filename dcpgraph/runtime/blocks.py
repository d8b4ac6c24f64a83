"""Virtual-block manager, with optional prefix caching.

The scheduler deals in *virtual blocks* of ``block_size · dcp`` tokens. Virtual block ``b`` is
physical block ``b`` on every rank of a DCP group (each holding its own share of the block's
tokens), so one block table serves the whole group. Blocks are allocated on demand: a request's
table is created at admission (:meth:`BlockManager.allocate`, for the tokens of its first chunk)
and extended before each step that writes past it (:meth:`BlockManager.grow`, all or nothing); it
covers ``blocks_for(n)`` blocks where ``n`` is the most tokens the request has needed, and only
:meth:`BlockManager.release` (finish, abort or preemption) gives blocks back. When ``grow`` fails
the scheduler preempts (see :mod:`.scheduler`); a table never holds a block another request writes.

Prefix caching (``enable_prefix_caching``; vLLM's APC)
------------------------------------------------------
See docs/architecture.md, Runtime: blocks, prefix caching and preemption.

A *full* virtual block of a request is named by a chained hash: ``h_i = sha256(h_{i-1} ‖ tokens
of block i)`` (:func:`block_hashes`; hashlib over the int token ids, so every process of a
distributed run, each running the same deterministic engine, computes the same hashes). The chain
fixes the block's index too, hence the positions (RoPE) of its tokens. Once a request's
``computed`` passes a block's end, :meth:`BlockManager.register` enters the block in the
hash → block-id table. A new request's prompt is matched against that table
(:meth:`BlockManager.match_prefix`) and the request starts with its table beginning with the
matched (shared) block ids.

Why a hit is valid on every DCP rank at once: the hash covers the *whole* virtual block, i.e. the
tokens of every rank's share of it, and the block id is the same physical block on every rank of
the group (the table is shared), so when the table entry is reused each rank finds its own share of
exactly those tokens at the slots ``layout.slot_mapping`` would have written them to. Nothing
per-rank is looked up or decided: the hit is the group's.

Invariants:

- blocks are reference-counted; a shared block is only ever a *full* block of a prompt prefix, and
  a request never writes into a block that is hashed or shared (:meth:`check_writable`);
- a block whose count drops to 0 keeps its hash and stays reusable ("cached free") until its id is
  needed: allocation takes never-hashed free blocks first, then evicts cached free blocks least
  recently released first (a request's blocks are released tail first, so the deeper blocks of a
  chain go before its root);
- an allocation counts each block once: a request needs ``blocks_for(tokens) − hits`` new
  blocks plus the hits that are currently cached free (reviving them takes them off the free pool);
  hits held by running requests cost nothing;
- ``free_blocks`` counts both kinds of free block, so a drained engine has
  ``free_blocks == num_blocks`` with or without prefix caching;
- with prefix caching off nothing is hashed and allocation order is exactly that of a FIFO free
  queue: never-used blocks in id order first, then released blocks least recently released first
  (as vLLM's free-block queue), so with on-demand allocation a block is reused only once every
  block has been used;
- with ``scratch_block`` (a program whose cached ops address their caches by block table and
  position rather than by ``slot_mapping``: DeepSeek-V4's compressed layers), block 0 is never
  handed out. The padding rows of a static-shape decode or verification step (zero table entries,
  :mod:`.graph_mode`, :mod:`.verify_buckets`) then write into a block no request reads.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict, deque
from collections.abc import Sequence

_ROOT = b"dcpgraph-prefix-v1"


def block_hashes(tokens: Sequence[int], tokens_per_block: int, parent: bytes | None = None,
                 limit: int | None = None) -> list[bytes]:
    """Chained hashes of the full blocks of ``tokens`` (at most ``limit``), continuing from
    ``parent`` (the hash of the block before ``tokens[0]``; ``None`` for a sequence start)."""
    full = len(tokens) // tokens_per_block
    if limit is not None:
        full = min(full, limit)
    out = []
    h = _ROOT if parent is None else parent
    for b in range(full):
        digest = hashlib.sha256(h)
        chunk = tokens[b * tokens_per_block : (b + 1) * tokens_per_block]
        digest.update(b"".join(int(t).to_bytes(8, "little", signed=True) for t in chunk))
        h = digest.digest()
        out.append(h)
    return out


class BlockManager:
    def __init__(self, num_blocks: int, tokens_per_block: int, enable_prefix_caching: bool = False, *,
                 scratch_block: bool = False):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.tokens_per_block = tokens_per_block
        self.enable_prefix_caching = bool(enable_prefix_caching)
        # scratch_block: block 0 is never handed out; the caches hold num_blocks + 1 blocks
        first = 1 if scratch_block else 0
        self.cache_blocks = num_blocks + first
        # never-hashed free blocks, handed out from the right: never-used ones in id order first, then
        # released ones least recently released first (release appends on the left)
        self._free: deque[int] = deque(range(self.cache_blocks - 1, first - 1, -1))
        self._cached_free: OrderedDict[int, None] = OrderedDict()  # hashed, count 0; LRU first
        self._tables: dict[int, list[int]] = {}
        self._frozen: dict[int, tuple[int, ...]] = {}  # request -> its table as a tuple, until it changes
        self._ref = [0] * self.cache_blocks
        self._hash_of: dict[int, bytes] = {}  # block id -> hash (registered blocks only)
        self._by_hash: dict[bytes, int] = {}  # hash -> block id
        self._chain: dict[int, tuple[int, bytes | None]] = {}  # request -> (blocks hashed, last hash)
        self._shared: dict[int, int] = {}  # request -> leading blocks it got from the cache
        self._unregistered: set[int] = set()  # live requests a prefix-cache reset took out of registration
        self.stats = {"queries": 0, "query_tokens": 0, "hit_requests": 0, "hit_tokens": 0, "evictions": 0,
                      "preempted_queries": 0, "preempted_query_tokens": 0, "preempted_hit_tokens": 0}

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.tokens_per_block

    @property
    def free_blocks(self) -> int:
        """Blocks available to new allocations (never-hashed free + cached free)."""
        return len(self._free) + len(self._cached_free)

    @property
    def cached_blocks(self) -> int:
        """Blocks holding a registered hash (in use or cached free)."""
        return len(self._hash_of)

    def blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.tokens_per_block)

    # -- prefix cache ------------------------------------------------------------------------
    def match_prefix(self, prompt: Sequence[int]) -> list[int]:
        """Block ids of the longest chain of cached full blocks that prefixes ``prompt``.

        Never the whole prompt: at most ``(len(prompt) − 1) // tokens_per_block`` blocks, so at
        least the last prompt token is recomputed and the step has logits to sample from (a
        prompt that is an exact multiple of the virtual block recomputes its whole last block,
        which is then the request's own). The match is valid on every DCP rank at once (see
        the module docstring). Empty when prefix caching is off. Does not change any state.
        """
        if not self.enable_prefix_caching or not prompt:
            return []
        limit = (len(prompt) - 1) // self.tokens_per_block
        hits = []
        for h in block_hashes(prompt, self.tokens_per_block, limit=limit):
            block = self._by_hash.get(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def register(self, request_id: int, tokens: Sequence[int], computed: int) -> None:
        """Enter every block of ``request_id`` whose tokens are all computed (``computed`` has
        passed its end) in the hash table. ``tokens`` are the request's tokens (prompt + output);
        a block whose hash is already cached under another id stays unregistered (a duplicate)."""
        if not self.enable_prefix_caching or request_id in self._unregistered:
            return
        done, parent = self._chain.get(request_id, (0, None))
        full = computed // self.tokens_per_block
        if full <= done:
            return
        table = self._tables[request_id]
        start = done * self.tokens_per_block
        new = block_hashes(tokens[start : full * self.tokens_per_block], self.tokens_per_block, parent)
        for i, h in enumerate(new, start=done):
            block = table[i]
            if h not in self._by_hash and block not in self._hash_of:
                self._by_hash[h] = block
                self._hash_of[block] = h
        self._chain[request_id] = (full, new[-1])

    def registered_hash(self, request_id: int, blocks: int) -> bytes | None:
        """The chained hash of ``request_id``'s first ``blocks`` full blocks when :meth:`register`
        has hashed exactly that many (O(1): the chain's last link), else ``None``."""
        done, last = self._chain.get(request_id, (0, None))
        return last if done == blocks else None

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (vLLM's ``reset_prefix_cache``): no block is matched by
        :meth:`match_prefix` afterwards. Cached-free blocks return to the never-hashed free pool
        (least recently released first, as released blocks); blocks in use keep their contents and
        owners, and the live requests holding them register no more blocks (their chains were
        forgotten), so they are freed unhashed. Returns how many cached-free blocks were freed."""
        freed = list(self._cached_free)
        self._cached_free.clear()
        for block in freed:
            self._free.appendleft(block)
        self._hash_of.clear()
        self._by_hash.clear()
        self._unregistered.update(self._tables)
        self._chain.clear()
        return len(freed)

    def check_writable(self, request_id: int, start: int, end: int) -> None:
        """Assert that positions ``[start, end)`` of ``request_id`` land only in blocks the request
        owns alone and that are not registered (hashed blocks are full and immutable)."""
        if end <= start:
            return
        table = self._tables[request_id]
        assert start >= self._shared.get(request_id, 0) * self.tokens_per_block, (
            f"request {request_id} would write position {start} into a shared prefix block")
        for v in range((start // self.tokens_per_block), (end - 1) // self.tokens_per_block + 1):
            block = table[v]
            assert self._ref[block] == 1 and block not in self._hash_of, (
                f"request {request_id} would write into block {block} (refs {self._ref[block]}, "
                f"hashed {block in self._hash_of})")

    # -- allocation --------------------------------------------------------------------------
    def _needed(self, tokens: int, prefix: Sequence[int]) -> int:
        revive = sum(1 for b in prefix if self._ref[b] == 0)
        return self.blocks_for(tokens) - len(prefix) + revive

    def can_allocate(self, tokens: int, prefix: Sequence[int] = ()) -> bool:
        """Whether a table for ``tokens`` tokens fits now, the leading ``prefix`` blocks (from
        :meth:`match_prefix`) being shared: each block is counted once."""
        return self._needed(tokens, prefix) <= self.free_blocks

    def allocate(self, request_id: int, tokens: int, prefix: Sequence[int] = ()) -> list[int]:
        """Give ``request_id`` its block table, for ``tokens`` tokens, starting with the shared
        ``prefix`` blocks (from :meth:`match_prefix`, same step). Raises ``MemoryError`` if they do
        not fit (check :meth:`can_allocate` first)."""
        if request_id in self._tables:
            raise ValueError(f"request {request_id} already holds blocks")
        prefix = list(prefix)
        if len(prefix) > self.blocks_for(tokens) or any(b not in self._hash_of for b in prefix):
            raise ValueError(f"prefix {prefix} is not a cached prefix of {tokens} tokens")
        need = self._needed(tokens, prefix)
        if need > self.free_blocks:
            raise MemoryError(f"need {need} blocks, {self.free_blocks} free")
        for block in prefix:  # revive before allocating, so no hit is evicted for its own request
            if self._ref[block] == 0:
                del self._cached_free[block]
            self._ref[block] += 1
        table = prefix + [self._allocate() for _ in range(self.blocks_for(tokens) - len(prefix))]
        self._tables[request_id] = table
        self._frozen.pop(request_id, None)
        if self.enable_prefix_caching:
            self._shared[request_id] = len(prefix)
            self._chain[request_id] = (len(prefix), self._hash_of[prefix[-1]] if prefix else None)
        return table

    def room(self, request_id: int) -> int:
        """The most tokens ``request_id``'s table could cover now: its blocks plus every free one."""
        return (len(self._tables[request_id]) + self.free_blocks) * self.tokens_per_block

    def grow(self, request_id: int, tokens: int) -> bool:
        """Extend ``request_id``'s table to cover ``tokens`` tokens. All or nothing: returns
        ``False`` and allocates nothing if the free blocks do not suffice."""
        table = self._tables[request_id]
        need = self.blocks_for(tokens) - len(table)
        if need > self.free_blocks:
            return False
        if need > 0:
            table.extend(self._allocate() for _ in range(need))
            self._frozen.pop(request_id, None)
        return True

    def holds(self, request_id: int) -> bool:
        return request_id in self._tables

    @property
    def used_blocks(self) -> int:
        """Blocks referenced by at least one table."""
        return self.num_blocks - self.free_blocks

    def record_query(self, tokens: int, hit_blocks: int, preempted: bool = False) -> None:
        """Count one admission's lookup (vLLM's ``PrefixCacheStats``): ``tokens`` looked up (the
        request's tokens so far) and the ``hit_blocks`` found. A request re-admitted after a
        preemption is counted apart (``preempted_*``), so ``queries``/``query_tokens``/``hit_*``
        keep meaning "new requests' prompts" while recomputation's hits stay visible."""
        hit_tokens = hit_blocks * self.tokens_per_block
        if preempted:
            self.stats["preempted_queries"] += 1
            self.stats["preempted_query_tokens"] += tokens
            self.stats["preempted_hit_tokens"] += hit_tokens
            return
        self.stats["queries"] += 1
        self.stats["query_tokens"] += tokens
        self.stats["hit_requests"] += bool(hit_blocks)
        self.stats["hit_tokens"] += hit_tokens

    def _allocate(self) -> int:
        if self._free:
            block = self._free.pop()
        else:
            block, _ = self._cached_free.popitem(last=False)  # least recently released
            del self._by_hash[self._hash_of.pop(block)]
            self.stats["evictions"] += 1
        assert self._ref[block] == 0
        self._ref[block] = 1
        return block

    def table(self, request_id: int) -> list[int]:
        return self._tables[request_id]

    def frozen_table(self, request_id: int) -> tuple[int, ...]:
        """:meth:`table` as a tuple, made again only after the table changed (it changes at block
        boundaries: a decode step between two copies nothing of a long context's table)."""
        frozen = self._frozen.get(request_id)
        if frozen is None:
            frozen = self._frozen[request_id] = tuple(self._tables[request_id])
        return frozen

    def group_table(self, request_id: int) -> list[int] | None:
        """The sliding layers' own table (:mod:`.layer_groups`); ``None``: every layer uses
        :meth:`table`."""
        return None

    def frozen_group_table(self, request_id: int) -> tuple[int, ...] | None:
        """:meth:`group_table` as a tuple, made again only after it changed (as :meth:`frozen_table`)."""
        return None

    def trim(self, request_id: int, computed: int) -> None:
        """Drop blocks no future query reads (only :mod:`.layer_groups`' sliding group has any)."""

    def shared_blocks(self, request_id: int) -> int:
        """How many leading blocks of ``request_id`` came from the prefix cache."""
        return self._shared.get(request_id, 0)

    def refcount(self, block: int) -> int:
        return self._ref[block]

    def release(self, request_id: int) -> None:
        """Drop ``request_id``'s references; blocks no one uses become free (hashed ones stay
        cached until evicted). Released tail first."""
        self._chain.pop(request_id, None)
        self._unregistered.discard(request_id)
        self._shared.pop(request_id, None)
        self._frozen.pop(request_id, None)
        for block in reversed(self._tables.pop(request_id)):
            self._ref[block] -= 1
            assert self._ref[block] >= 0
            if self._ref[block]:
                continue
            if block in self._hash_of:
                self._cached_free[block] = None
            else:
                self._free.appendleft(block)

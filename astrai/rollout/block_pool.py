"""KV block bookkeeping for the paged engine: a reference-counted block pool and a prefix cache.

PagedAttention (Kwon et al. 2023): KV memory is a pool of fixed-size blocks; a sequence owns a list of block ids
(its block table). Blocks are reference counted so several sequences can share them (the G samples of one prompt,
and prompts with a common prefix); a shared block is copied before it is written (copy-on-write, done by the
engine). The prefix cache keeps full prompt blocks alive between requests, tagged with the `policy_version` that
computed them, and is cleared when the weights change (stale KV would silently bias the behaviour log-probs).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Sequence

__all__ = ["BlockPool", "OutOfBlocksError", "PrefixCache"]


class OutOfBlocksError(RuntimeError):
    """Raised when the pool has no free block left."""


class BlockPool:
    """Free list + reference counts over block ids `0 .. num_blocks - 1`.

    Raises:
        ValueError: for `num_blocks <= 0`.
    """

    def __init__(self, num_blocks: int):
        if num_blocks <= 0:
            raise ValueError(f"BlockPool: num_blocks must be > 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self.refcount = [0] * num_blocks
        self._free = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        """Blocks with reference count 0."""
        return len(self._free)

    def allocate(self) -> int:
        """A free block id with reference count 1. Raises `OutOfBlocksError` when none is free."""
        if not self._free:
            raise OutOfBlocksError(f"all {self.num_blocks} KV blocks are in use")
        block = self._free.popleft()
        self.refcount[block] = 1
        return block

    def incref(self, block: int) -> None:
        """Add a reference to an allocated block. Raises `ValueError` for a free block."""
        if self.refcount[block] <= 0:
            raise ValueError(f"incref of free block {block}")
        self.refcount[block] += 1

    def decref(self, block: int) -> None:
        """Drop a reference; the block returns to the free list at 0. Raises `ValueError` for a free block."""
        if self.refcount[block] <= 0:
            raise ValueError(f"decref of free block {block}")
        self.refcount[block] -= 1
        if self.refcount[block] == 0:
            self._free.append(block)

    def release_all(self, blocks: Sequence[int]) -> None:
        """`decref` each of `blocks`."""
        for block in blocks:
            self.decref(block)


class PrefixCache:
    """Full prompt blocks kept for reuse across requests, keyed by the token prefix they end.

    Entry key: the tuple of all prompt tokens up to and including block k (so block k is only reused after the
    very same prefix); value: (block id, policy_version). The cache holds one reference per entry; entries only
    the cache references are evicted least-recently-used first when the pool runs short.
    """

    def __init__(self, pool: BlockPool, block_size: int):
        self.pool, self.block_size = pool, block_size
        self._entries: OrderedDict[tuple[int, ...], tuple[int, int]] = OrderedDict()
        self.hits = 0  # blocks served from the cache since creation

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def num_reclaimable(self) -> int:
        """Blocks that only the cache references (what `evict` could free now)."""
        return sum(self.pool.refcount[block] == 1 for block, _ in self._entries.values())

    def lookup(self, tokens: Sequence[int], policy_version: int) -> list[int]:
        """Cached blocks covering the longest prefix of `tokens` made of full blocks, leaving at least one token
        to compute (its logits are needed). Each returned block gets a reference for the caller."""
        blocks = []
        for k in range((len(tokens) - 1) // self.block_size):
            key = tuple(tokens[:(k + 1) * self.block_size])
            entry = self._entries.get(key)
            if entry is None or entry[1] != policy_version:
                break
            self._entries.move_to_end(key)
            self.pool.incref(entry[0])
            blocks.append(entry[0])
        self.hits += len(blocks)
        return blocks

    def has_block(self, tokens: Sequence[int], policy_version: int) -> bool:
        """True when the full block ending `tokens` (len(tokens) a multiple of block_size) is cached for
        `policy_version`; takes no reference."""
        entry = self._entries.get(tuple(tokens))
        return entry is not None and entry[1] == policy_version

    def insert(self, tokens: Sequence[int], blocks: Sequence[int], policy_version: int) -> None:
        """Register the full blocks of a computed prompt `tokens` (block table `blocks`)."""
        for k in range(len(tokens) // self.block_size):
            key = tuple(tokens[:(k + 1) * self.block_size])
            if key in self._entries:
                continue
            self.pool.incref(blocks[k])
            self._entries[key] = (blocks[k], policy_version)

    def evict(self, wanted: int) -> int:
        """Drop up to `wanted` least-recently-used entries that nothing else references; returns the number freed."""
        freed = 0
        for key in list(self._entries):
            if freed >= wanted:
                break
            block = self._entries[key][0]
            if self.pool.refcount[block] == 1:
                del self._entries[key]
                self.pool.decref(block)
                freed += 1
        return freed

    def clear(self) -> None:
        """Drop every entry (on a policy_version change, sleep, or a workspace resize)."""
        for block, _ in self._entries.values():
            self.pool.decref(block)
        self._entries.clear()

"""The block pool: hands out block ids ``1 .. num_blocks``, counts who holds each; block 0 is null.

Forked sessions share their history's blocks: a block carries a reference count (one per block
table that lists it) and returns to the free list when its last reference is dropped.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from paged_video.paging._validate import require_int

NULL_BLOCK = 0


class PoolExhaustedError(ValueError):
    """More blocks were asked for than are free; nothing was allocated."""


@dataclass(frozen=True)
class PoolStats:
    """The managed blocks by how many block tables hold them, and what they cost.

    ``exclusive`` blocks are held by one table, ``shared`` ones by several (forked sessions'
    common history); ``references`` counts table entries naming a block, which is what the
    tables would hold without sharing. ``block_bytes`` is one block over every layer: its K and
    V slots and, for quantized pools, their scales.
    """

    blocks: int
    free: int
    exclusive: int
    shared: int
    references: int
    block_bytes: int

    @property
    def held(self) -> int:
        return self.exclusive + self.shared

    @property
    def held_bytes(self) -> int:
        """Bytes of the blocks some table holds, each counted once."""
        return self.held * self.block_bytes

    @property
    def shared_bytes(self) -> int:
        return self.shared * self.block_bytes

    @property
    def exclusive_bytes(self) -> int:
        return self.exclusive * self.block_bytes

    @property
    def unshared_bytes(self) -> int:
        """What the same tables would hold with a private copy of every block."""
        return self.references * self.block_bytes


def _no_storage(source: int, target: int) -> None:
    raise ValueError("this BlockPool has no storage to copy blocks in; a PagedKVCache gives it")


class BlockPool:
    """Reference-counted free-list allocator over the managed blocks ``1 .. num_blocks``.

    Block 0 is the null block: it is never handed out and stands for evicted table entries and
    padding. ``allocate`` hands out blocks with one reference each, ``share`` adds one (a forked
    table listing the block too), ``free`` drops one, and a block is free again once nobody
    holds it. Allocation is all or nothing, and dropping a reference that is not held raises,
    so a double free cannot corrupt the free list. ``copy_contents(source, target)`` copies one
    block's stored K/V into another (the cache's device copy, for copy-on-write).
    """

    def __init__(
        self, num_blocks: int, copy_contents: Callable[[int, int], None] = _no_storage
    ) -> None:
        self.num_blocks = require_int("num_blocks", num_blocks, minimum=1)
        self.copy_contents = copy_contents
        # A stack: the most recently freed block is handed out first (still warm in caches).
        self._free = list(range(num_blocks, NULL_BLOCK, -1))
        self._refs = [0] * (num_blocks + 1)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_held(self) -> int:
        return self.num_blocks - len(self._free)

    def is_held(self, block: int) -> bool:
        return self.refcount(block) > 0

    def refcount(self, block: int) -> int:
        """How many block tables hold ``block``: 0 for a free, null or unknown block."""
        return self._refs[block] if 0 < block <= self.num_blocks else 0

    def stats(self, block_bytes: int = 0) -> PoolStats:
        """Free, exclusive and shared blocks and the references to them (see ``PoolStats``)."""
        counts = self._refs[1:]
        shared = sum(count > 1 for count in counts)
        return PoolStats(
            blocks=self.num_blocks,
            free=len(self._free),
            exclusive=self.num_held - shared,
            shared=shared,
            references=sum(counts),
            block_bytes=block_bytes,
        )

    def allocate(self, count: int) -> list[int]:
        """``count`` distinct blocks, one reference each; ``PoolExhaustedError`` (changing
        nothing) if too few are free."""
        require_int("count", count, minimum=0)
        if count > len(self._free):
            raise PoolExhaustedError(
                f"block pool exhausted: count={count} blocks requested, {len(self._free)} of "
                f"num_blocks={self.num_blocks} free; size the cache for more sessions"
            )
        if count == 0:
            return []
        blocks = self._free[-count:]
        del self._free[-count:]
        for block in blocks:
            self._refs[block] = 1
        return blocks

    def share(self, blocks: Iterable[int]) -> None:
        """One more reference to each of the held ``blocks``; ``ValueError`` (changing nothing)
        for one that is not held."""
        blocks = list(blocks)
        for block in blocks:
            if not self.is_held(block):
                raise ValueError(f"blocks: block {block} is not held (null, unknown or free)")
        for block in blocks:
            self._refs[block] += 1

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one reference to each of ``blocks``; a block nobody holds any more is free.

        ``ValueError`` (changing nothing) when a block is named more often than it is held.
        """
        wanted = Counter(blocks)
        for block, count in wanted.items():
            if count > self.refcount(block):
                raise ValueError(
                    f"blocks: block {block} is not held (null, unknown or freed twice): "
                    f"{count} references dropped, {self.refcount(block)} held"
                )
        for block, count in wanted.items():
            self._refs[block] -= count
            if not self._refs[block]:
                self._free.append(block)

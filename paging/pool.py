"""The block pool: hands out block ids ``1 .. num_blocks``; block 0 is the null block."""

from __future__ import annotations

from collections.abc import Iterable

from paged_video.paging._validate import require_int

NULL_BLOCK = 0


class PoolExhaustedError(ValueError):
    """More blocks were asked for than are free; nothing was allocated."""


class BlockPool:
    """Free-list allocator over the managed blocks ``1 .. num_blocks`` of a cache.

    Block 0 is the null block: it is never handed out and stands for evicted table entries and
    padding. Allocation is all or nothing, and freeing a block that is not held raises, so a
    double free cannot corrupt the free list.
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = require_int("num_blocks", num_blocks, minimum=1)
        # A stack: the most recently freed block is handed out first (still warm in caches).
        self._free = list(range(num_blocks, NULL_BLOCK, -1))
        self._held = bytearray(num_blocks + 1)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_held(self) -> int:
        return self.num_blocks - len(self._free)

    def is_held(self, block: int) -> bool:
        return 0 < block <= self.num_blocks and bool(self._held[block])

    def allocate(self, count: int) -> list[int]:
        """``count`` distinct blocks; ``PoolExhaustedError`` (changing nothing) if too few."""
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
            self._held[block] = 1
        return blocks

    def free(self, blocks: Iterable[int]) -> None:
        """Return held ``blocks``; ``ValueError`` (changing nothing) for one that is not held."""
        blocks = list(blocks)
        seen: set[int] = set()
        for block in blocks:
            if block in seen or not self.is_held(block):
                raise ValueError(
                    f"blocks: block {block} is not held (null, unknown or freed twice)"
                )
            seen.add(block)
        for block in blocks:
            self._held[block] = 0
        self._free.extend(blocks)

"""Sessions and their sequences: block tables and committed state, one sequence per branch.

A ``Sequence`` owns its block table and counters and changes them only through its own methods
(a committing forward's blocks, commit with eviction and compaction, dropping a pending forward,
release); the block pool and the sequence's scratch blocks are handed to it by the cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from paged_video.paging import window
from paged_video.paging.config import PagingConfig
from paged_video.paging.pool import NULL_BLOCK, BlockPool


@dataclass(eq=False)
class Sequence:
    """One KV branch of a session.

    ``block_table[i]`` holds storage positions ``[i*B, (i+1)*B)`` (``NULL_BLOCK`` once
    evicted); its blocks come from ``pool``, and ``scratch`` are the sequence's own scratch
    blocks outside the pool. ``committed`` counts storage tokens, ``compacted`` the tokens
    compaction removed from the table, ``absolute = committed + compacted`` the model positions
    committed, and ``evicted`` the dead storage tokens after the sink, ``[S, S + evicted)``.
    ``generation`` counts commits: a plan prepared at another generation is stale.
    ``pending`` is the prepared committing forward (its plan, compared by identity only) that
    has not committed yet; while it is set the table also lists that forward's new blocks.
    """

    config: PagingConfig
    pool: BlockPool
    scratch: range
    block_table: list[int] = field(default_factory=list)
    committed: int = 0
    compacted: int = 0
    evicted: int = 0
    generation: int = 0
    pending: object | None = None

    @property
    def absolute(self) -> int:
        return self.committed + self.compacted

    @property
    def completed_chunks(self) -> int:
        return self.absolute // self.config.chunk_size

    @property
    def history_entries(self) -> int:
        """Table entries that hold committed tokens: ``ceil(committed / B)``."""
        return -(-self.committed // self.config.block_size)

    def begin(self, owner: object, num_tokens: int) -> None:
        """Allocate the blocks a committing forward of ``num_tokens`` writes after the history
        and make ``owner`` (its plan) the pending forward; nothing changes if the pool is short.
        """
        entries = -(-(self.committed + num_tokens) // self.config.block_size)
        self.block_table.extend(self.pool.allocate(entries - self.history_entries))
        self.pending = owner

    def commit(self, num_tokens: int) -> None:
        """Complete the pending forward's ``num_tokens``, then evict, then compact."""
        config = self.config
        already_null = window.dead_entries(config, self.evicted)
        self.committed += num_tokens
        self.generation += 1
        self.pending = None
        self.evicted = window.evicted_tokens(config, self.committed)
        newly_dead = range(already_null.stop, window.dead_entries(config, self.evicted).stop)
        if newly_dead:
            self.pool.free(self.block_table[newly_dead.start : newly_dead.stop])
            self.block_table[newly_dead.start : newly_dead.stop] = [NULL_BLOCK] * len(newly_dead)
        if config.compaction:
            self._compact()

    def _compact(self) -> None:
        removed = window.compactable_tokens(self.config, self.evicted)
        if removed:
            first = window.sink_blocks(self.config)
            del self.block_table[first : first + removed // self.config.block_size]
            self.committed -= removed
            self.evicted -= removed
            self.compacted += removed

    def drop_pending(self) -> None:
        """Return the pending forward's new blocks and forget it; the history is untouched."""
        keep = self.history_entries
        self.pool.free(self.block_table[keep:])
        del self.block_table[keep:]
        self.pending = None

    def release(self) -> None:
        """Return every block this sequence holds (history and pending ones)."""
        self.pool.free(block for block in self.block_table if block != NULL_BLOCK)
        self.block_table.clear()
        self.pending = None


@dataclass(eq=False)
class Session:
    """One generation stream: a sequence per KV branch, and its scratch lane in the cache."""

    id: int
    lane: int
    sequences: dict[str, Sequence]
    closed: bool = False

    def sequence(self, branch: str) -> Sequence:
        """The sequence of ``branch``; ``ValueError`` naming the branches for an unknown one."""
        if branch not in self.sequences:
            raise ValueError(f"branch must be one of {sorted(self.sequences)}, got {branch!r}")
        return self.sequences[branch]

    def close(self) -> None:
        """Return every block of every branch; the session cannot be used again."""
        for sequence in self.sequences.values():
            sequence.release()
        self.closed = True

"""Sessions and their sequences: block tables and committed state, one sequence per branch.

A ``Sequence`` owns its block table and counters and changes them only through its own methods
(a committing forward's blocks, commit with eviction and compaction, dropping a pending forward,
release, fork, copy-on-write of its tail block); the block pool and the sequence's scratch
blocks are handed to it by the cache.

Forks share blocks: a forked sequence's table lists its parent's blocks, each holding one more
reference in the pool. Only the partly written tail block is ever written again (a forward
continues the history in its free slots); a forward whose tail block another table also holds
first gives the sequence a copy of it (``own_tail``), so no write lands in a shared block.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from paged_video.paging import window
from paged_video.paging.config import PagingConfig
from paged_video.paging.pool import NULL_BLOCK, BlockPool


class TailWrite(NamedTuple):
    """The partly written tail block a forward writes into: table ``entry``, the ``block`` it
    writes (the sequence's alone), and ``replaced``, the shared block it was copied from
    (None when the sequence already held it alone)."""

    entry: int
    block: int
    replaced: int | None


@dataclass(eq=False)
class Sequence:
    """One KV branch of a session.

    ``block_table[i]`` holds storage positions ``[i*B, (i+1)*B)`` (``NULL_BLOCK`` once
    evicted); its blocks come from ``pool``, where each holds one reference per table that
    lists it (forks share blocks), and ``scratch`` are the sequence's own scratch blocks
    outside the pool. ``committed`` counts storage tokens, ``compacted`` the tokens
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

    def _tail(self) -> tuple[int, int] | None:
        """``(entry, block)`` of the partly written tail block; None on a block edge."""
        b = self.config.block_size
        if self.committed % b == 0:
            return None
        entry = self.committed // b
        return entry, self.block_table[entry]

    def _write_tail(self, entry: int, block: int, spare: list[int]) -> TailWrite:
        """The tail write at ``entry``: ``block`` itself when this sequence holds it alone, else
        ``spare[0]`` (allocated by the caller) in its place, ``block``'s reference dropped."""
        if not spare:
            return TailWrite(entry, block, None)
        self.block_table[entry] = spare[0]
        self.pool.free([block])
        return TailWrite(entry, spare[0], block)

    def own_tail(self) -> TailWrite | None:
        """Before a forward writes after the history: the tail block it continues, replaced by
        a fresh block when another table holds it too (copy-on-write); None on a block edge.

        The caller copies the contents, ``pool.copy_contents(write.replaced, write.block)``,
        before anything reads or writes the new block; the replaced one stays intact meanwhile
        (its other holders keep it). ``PoolExhaustedError`` (changing nothing) when a new block
        is needed and none is free.
        """
        tail = self._tail()
        if tail is None:
            return None
        shared = self.pool.refcount(tail[1]) > 1
        return self._write_tail(*tail, self.pool.allocate(int(shared)))

    def restore_tail(self, write: TailWrite) -> None:
        """Undo ``own_tail``'s replacement right after it (a refused forward): the shared block
        back, the new one freed. The shared block is still held by its other tables."""
        if write.replaced is None:
            return
        if self.block_table[write.entry] != write.block or not self.pool.is_held(write.replaced):
            raise ValueError("restore_tail: the tail changed since it was copied")
        self.pool.share([write.replaced])
        self.block_table[write.entry] = write.replaced
        self.pool.free([write.block])

    def begin(self, owner: object, num_tokens: int) -> TailWrite | None:
        """Allocate the blocks a committing forward of ``num_tokens`` writes after the history
        (and the tail block's replacement when that is shared, as ``own_tail``), and make
        ``owner`` (its plan) the pending forward; nothing changes if the pool is short. Returns
        the tail write, as ``own_tail`` does.
        """
        entries = -(-(self.committed + num_tokens) // self.config.block_size)
        tail = self._tail()
        copy = int(tail is not None and self.pool.refcount(tail[1]) > 1)
        # One allocation for the new blocks and the copy: all or nothing.
        blocks = self.pool.allocate(entries - self.history_entries + copy)
        write = None if tail is None else self._write_tail(*tail, blocks[len(blocks) - copy :])
        self.block_table.extend(blocks[: len(blocks) - copy])
        self.pending = owner
        return write

    def holds_alone(self, entry: int, block: int) -> bool:
        """Whether table ``entry`` is still ``block`` and no other table holds it."""
        return (
            entry < len(self.block_table)
            and self.block_table[entry] == block
            and self.pool.refcount(block) == 1
        )

    def fork(self, scratch: range) -> Sequence:
        """A sequence with this one's committed history, its blocks shared (one more reference
        each, nothing copied), using the scratch blocks ``scratch``. The caller checks that no
        forward is pending."""
        table = list(self.block_table)
        self.pool.share(block for block in table if block != NULL_BLOCK)
        return Sequence(
            self.config,
            self.pool,
            scratch,
            table,
            committed=self.committed,
            compacted=self.compacted,
            evicted=self.evicted,
        )

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
        """Drop this sequence's reference to every block it holds (history and pending ones);
        a block nobody else holds is free again."""
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
        """Drop every branch's blocks (shared ones stay with their other holders); the
        session cannot be used again."""
        for sequence in self.sequences.values():
            sequence.release()
        self.closed = True

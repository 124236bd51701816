"""The window oracle: which model positions a forward must read, and which token each slot holds.

Written from docs/paging.md in *model* positions and whole chunks, independently of the paging
code's storage positions, block tables and compaction, so checking a plan against it is a real
cross-check. Pure Python; imports nothing of this project.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class WindowGeometry:
    """``C`` tokens per chunk, ``B`` per block; the sink and recent window in chunks."""

    chunk_size: int
    block_size: int
    sink_chunks: int
    window_chunks: int
    reset_at_boundary: bool = False

    @property
    def sink_tokens(self) -> int:
        return self.sink_chunks * self.chunk_size


def resident_chunks(geometry: WindowGeometry, completed_chunks: int) -> list[int]:
    """Chunks still stored once ``completed_chunks`` chunks are committed.

    The sink chunks always; sliding also keeps the last ``window_chunks`` chunks, reset at
    boundary keeps nothing after the sink.
    """
    sink = min(geometry.sink_chunks, completed_chunks)
    recent = 0 if geometry.reset_at_boundary else geometry.window_chunks
    first_recent = max(sink, completed_chunks - recent)
    return [*range(sink), *range(first_recent, completed_chunks)]


def resident_positions(geometry: WindowGeometry, committed_tokens: int) -> list[int]:
    """Model positions still stored once ``committed_tokens`` (whole chunks) are committed."""
    c = geometry.chunk_size
    chunks = resident_chunks(geometry, committed_tokens // c)
    return [p for k in chunks for p in range(k * c, (k + 1) * c)]


def kept_chunks(geometry: WindowGeometry, history_chunks: int, forward_chunks: int) -> list[int]:
    """Chunks a forward of ``forward_chunks`` after ``history_chunks`` attends to.

    The forward's own chunks, and the stored chunks among the sink and the last
    ``window_chunks`` chunks ending with the forward's.
    """
    end = history_chunks + forward_chunks
    resident = resident_chunks(geometry, history_chunks)
    first_recent = end - geometry.window_chunks
    kept = [k for k in resident if k < geometry.sink_chunks or k >= first_recent]
    return kept + list(range(history_chunks, end))


def kept_positions(geometry: WindowGeometry, history: int, num_tokens: int) -> list[int]:
    """Model positions (ascending) a forward of ``num_tokens`` after ``history`` must read."""
    c = geometry.chunk_size
    chunks = kept_chunks(geometry, history // c, num_tokens // c)
    return [p for k in chunks for p in range(k * c, (k + 1) * c)]


def block_read_positions(geometry: WindowGeometry, history: int, num_tokens: int) -> list[int]:
    """Model positions (ascending) that whole-block reads of the kept positions cover.

    Every block holding a kept position is read whole, except that nothing at or past the
    forward's end exists yet. Compaction removes whole blocks, so model blocks line up with
    storage blocks and this is what a correct plan reads, boundary tokens included.
    """
    b = geometry.block_size
    end = history + num_tokens
    blocks = sorted({p // b for p in kept_positions(geometry, history, num_tokens)})
    return [p for k in blocks for p in range(k * b, min((k + 1) * b, end))]


def slots_read(block_table_row: Iterable[int], seq_len_k: int, block_size: int) -> list[int]:
    """The slot of each key ``0 .. seq_len_k - 1`` of one block-table row, in key order."""
    row = list(block_table_row)
    return [row[j // block_size] * block_size + j % block_size for j in range(seq_len_k)]


class SlotLedger:
    """Slot -> the token written there last. Tokens are any hashable labels."""

    def __init__(self) -> None:
        self._tokens: dict[int, Hashable] = {}

    def write(self, slots: Iterable[int], tokens: Iterable[Hashable]) -> None:
        """Record ``tokens[t]`` at ``slots[t]``; a negative slot is padding and is skipped."""
        slots, tokens = list(slots), list(tokens)
        if len(slots) != len(tokens):
            raise ValueError(f"slots ({len(slots)}) and tokens ({len(tokens)}) differ in length")
        for slot, token in zip(slots, tokens, strict=True):
            if slot >= 0:
                self._tokens[int(slot)] = token

    def read(self, slots: Iterable[int]) -> list[Hashable | None]:
        """The token at each slot, ``None`` for a slot never written."""
        return [self._tokens.get(int(slot)) for slot in slots]

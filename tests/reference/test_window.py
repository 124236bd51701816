"""The window oracle on numbers worked by hand."""

from __future__ import annotations

import pytest

from paged_video.reference.window import (
    SlotLedger,
    WindowGeometry,
    block_read_positions,
    kept_positions,
    resident_chunks,
    resident_positions,
    slots_read,
)

# C = 6, B = 4, sink 1 chunk (S = 6), window 2 chunks (W = 12).
RAGGED = WindowGeometry(chunk_size=6, block_size=4, sink_chunks=1, window_chunks=2)
RESET = WindowGeometry(
    chunk_size=6, block_size=4, sink_chunks=1, window_chunks=2, reset_at_boundary=True
)


@pytest.mark.parametrize(
    ("geometry", "completed", "expected"),
    [
        (RAGGED, 0, []),
        (RAGGED, 1, [0]),
        (RAGGED, 3, [0, 1, 2]),
        (RAGGED, 5, [0, 3, 4]),  # sink + the last 2 chunks
        (RESET, 1, [0]),
        (RESET, 5, [0]),  # nothing after the sink
    ],
)
def test_resident_chunks(geometry: WindowGeometry, completed: int, expected: list[int]) -> None:
    assert resident_chunks(geometry, completed) == expected


def test_resident_positions_are_whole_chunks() -> None:
    assert resident_positions(RAGGED, 30) == [*range(6), *range(18, 30)]


def test_kept_positions() -> None:
    # History 24, one chunk: end 30, recent [18, 30) = history chunk 3 + the forward's chunk 4.
    assert kept_positions(RAGGED, 24, 6) == [*range(6), *range(18, 30)]
    # Two chunks: the window is the forward itself.
    assert kept_positions(RAGGED, 24, 12) == [*range(6), *range(24, 36)]
    # Reset: the sink and the forward, whatever the window.
    assert kept_positions(RESET, 24, 6) == [*range(6), *range(24, 30)]
    assert kept_positions(RAGGED, 0, 6) == list(range(6))


def test_block_read_positions_add_the_boundary_tokens() -> None:
    # Sink block 1 holds 4..7: excess 6, 7. The recent range starts at 18, in block 4 (16..19):
    # head 16, 17. The last block (28..31) is read only up to the end, 30.
    assert block_read_positions(RAGGED, 24, 6) == [*range(8), *range(16, 30)]
    # Reset with history 18: sink block (0..7) and blocks 4.. from position 16 up to 24.
    assert block_read_positions(RESET, 18, 6) == [*range(8), *range(16, 24)]
    # Sink and recent range share a block: one contiguous read.
    assert block_read_positions(RAGGED, 6, 6) == list(range(12))


def test_slots_read() -> None:
    assert slots_read([5, 2, 0], 6, 4) == [20, 21, 22, 23, 8, 9]
    assert slots_read([3], 0, 4) == []


def test_ledger_keeps_the_last_write_and_skips_padding() -> None:
    ledger = SlotLedger()
    ledger.write([4, 5, -1], ["a", "b", "pad"])
    ledger.write([5], ["c"])
    assert ledger.read([4, 5, 6, -1]) == ["a", "c", None, None]
    with pytest.raises(ValueError, match="differ"):
        ledger.write([1, 2], ["x"])

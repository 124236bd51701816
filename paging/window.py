"""Chunk-window arithmetic in storage positions: eviction, freed blocks, compaction, widths.

Pure functions of the configuration and a few counts, so every rule of docs/paging.md is one
formula here and the stateful code (``session.py``, ``plan.py``) only applies them. Storage
position = model position for the sink, model position - compacted after it.

The formulas take any object with the window's geometry (``Geometry``: a ``PagingConfig``),
so this module imports no other paging module and the configuration can check itself with it.
"""

from __future__ import annotations

import math
from typing import Protocol


class Geometry(Protocol):
    """What the formulas read of a configuration (``PagingConfig`` has all of it)."""

    @property
    def block_size(self) -> int: ...
    @property
    def chunk_size(self) -> int: ...
    @property
    def reset_at_boundary(self) -> bool: ...
    @property
    def max_action_tokens(self) -> int: ...
    @property
    def sink_tokens(self) -> int: ...
    @property
    def window_tokens(self) -> int: ...
    @property
    def max_forward_tokens(self) -> int: ...


def sink_blocks(config: Geometry) -> int:
    """Table entries that hold a sink token: ``ceil(S / B)``; they are never evicted."""
    return -(-config.sink_tokens // config.block_size)


def evicted_tokens(config: Geometry, committed: int) -> int:
    """Dead storage tokens after the sink once ``committed`` tokens are stored.

    Sliding keeps the last ``W`` tokens and drops whole chunks only; reset at boundary drops
    every whole chunk after the sink. Storage positions ``[S, S + result)`` are dead.
    """
    c, s = config.chunk_size, config.sink_tokens
    if config.reset_at_boundary:
        return max(0, committed // c * c - s)
    return max(0, committed - config.window_tokens - s) // c * c


def dead_entries(config: Geometry, evicted: int) -> range:
    """Table entries wholly inside the dead range ``[S, S + evicted)``: null once evicted.

    ``ceil(S/B) .. floor((S + evicted)/B) - 1``: never a block that still holds a sink token or
    a live one.
    """
    first = sink_blocks(config)
    return range(first, max(first, (config.sink_tokens + evicted) // config.block_size))


def compaction_unit(config: Geometry) -> int:
    """``lcm(C, B)``: removing this many tokens removes whole chunks *and* whole blocks."""
    return math.lcm(config.chunk_size, config.block_size)


def compactable_tokens(config: Geometry, evicted: int) -> int:
    """Tokens of null entries (from ``ceil(S/B)``) that compaction removes: whole units only."""
    null_tokens = len(dead_entries(config, evicted)) * config.block_size
    unit = compaction_unit(config)
    return null_tokens // unit * unit


def recent_start(config: Geometry, end: int, evicted: int) -> int:
    """First storage position of the recent range of a forward ending at ``end``.

    The window keeps ``[end - W, end)``, less whatever eviction has already dropped; clipped to
    ``end`` (an empty recent range) while the sink still covers the whole forward.
    """
    return min(end, max(end - config.window_tokens, config.sink_tokens + evicted))


def max_video_blocks(config: Geometry) -> int:
    """Visible video blocks at most: the sink's plus the recent range's.

    The recent range starts a whole number of chunks in, so at most ``B - gcd(C, B)`` slots
    past a block edge: ``ceil(S/B) + ceil((W + B - gcd(C, B)) / B)``.
    """
    b = config.block_size
    slack = b - math.gcd(config.chunk_size, b)
    return sink_blocks(config) + -(-(config.window_tokens + slack) // b)


def action_blocks(config: Geometry) -> int:
    """Table columns reserved for action tokens: ``max(1, ceil(actions / B))``."""
    return max(1, -(-config.max_action_tokens // config.block_size))


def table_width(config: Geometry) -> int:
    """The fixed block-table width; it depends on the configuration only."""
    return max_video_blocks(config) + action_blocks(config)


def blocks_per_sequence(config: Geometry) -> int:
    """Pool blocks one sequence can hold at once: at its peak, while a committing forward is
    pending before eviction, the sink plus ``W`` history tokens plus the largest forward.
    """
    b = config.block_size
    slack = b - math.gcd(config.chunk_size, b)
    recent = config.window_tokens + config.max_forward_tokens + slack
    return sink_blocks(config) + -(-recent // b)


def scratch_blocks_per_sequence(config: Geometry) -> int:
    """Scratch blocks one sequence needs: the largest forward's video plus its actions."""
    b = config.block_size
    return -(-config.max_forward_tokens // b) + -(-config.max_action_tokens // b)

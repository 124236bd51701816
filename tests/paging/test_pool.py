"""The block pool: null block 0, free count, all-or-nothing allocation, no double free."""

from __future__ import annotations

import pytest

from paged_video.paging import NULL_BLOCK, BlockPool, PoolExhaustedError


def test_hands_out_every_block_but_the_null_block() -> None:
    pool = BlockPool(5)
    blocks = pool.allocate(5)
    assert sorted(blocks) == [1, 2, 3, 4, 5] and NULL_BLOCK not in blocks
    assert (pool.num_free, pool.num_held) == (0, 5)
    assert [pool.is_held(block) for block in range(7)] == [False, *[True] * 5, False]
    pool.free(blocks)
    assert pool.num_free == 5 and not any(pool.is_held(block) for block in range(7))


def test_free_count_and_reuse() -> None:
    pool = BlockPool(4)
    first = pool.allocate(3)
    assert pool.num_free == 1
    pool.free(first[:2])
    assert (pool.num_free, pool.num_held) == (3, 1)
    again = pool.allocate(3)
    assert len(set(again)) == 3 and first[2] not in again


def test_exhaustion_is_clear_and_changes_nothing() -> None:
    pool = BlockPool(4)
    held = pool.allocate(3)
    with pytest.raises(PoolExhaustedError, match=r"count=2 .*1 of num_blocks=4 free"):
        pool.allocate(2)
    assert pool.num_free == 1 and all(pool.is_held(b) for b in held)
    assert pool.allocate(1) != []


@pytest.mark.parametrize("case", ["null", "unknown", "twice"])
def test_freeing_what_is_not_held_raises_and_changes_nothing(case: str) -> None:
    pool = BlockPool(4)
    held = pool.allocate(2)
    bad = {"null": [NULL_BLOCK], "unknown": [9], "twice": [held[0], held[0]]}[case]
    with pytest.raises(ValueError, match="blocks"):
        pool.free([held[1], *bad])
    assert pool.num_free == 2 and all(pool.is_held(b) for b in held)


def test_double_free_across_calls_raises() -> None:
    pool = BlockPool(2)
    [block] = pool.allocate(1)
    pool.free([block])
    with pytest.raises(ValueError, match="not held"):
        pool.free([block])
    assert pool.num_free == 2


def test_a_shared_block_is_free_once_its_last_reference_is_dropped() -> None:
    pool = BlockPool(3)
    [block, other] = pool.allocate(2)
    pool.share([block, block])  # two more tables list it
    assert pool.refcount(block) == 3 and pool.num_held == 2
    stats = pool.stats(block_bytes=10)
    assert (stats.exclusive, stats.shared, stats.references, stats.free) == (1, 1, 4, 1)
    assert (stats.held_bytes, stats.unshared_bytes) == (20, 40)
    pool.free([block, other])
    assert (pool.refcount(block), pool.num_free) == (2, 2)
    pool.free([block, block])
    assert not pool.is_held(block) and pool.num_free == 3


@pytest.mark.parametrize("case", ["more-than-held", "share-free"])
def test_references_not_held_raise_and_change_nothing(case: str) -> None:
    pool = BlockPool(3)
    [block, free_block] = pool.allocate(2)
    pool.free([free_block])
    pool.share([block])
    with pytest.raises(ValueError, match="blocks"):
        if case == "more-than-held":
            pool.free([block, block, block])
        else:
            pool.share([block, free_block])
    assert (pool.refcount(block), pool.refcount(free_block), pool.num_free) == (2, 0, 2)


def test_a_bare_pool_has_no_storage_to_copy() -> None:
    with pytest.raises(ValueError, match="no storage"):
        BlockPool(2).copy_contents(1, 2)

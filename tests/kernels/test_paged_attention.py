"""kernels.paged_attention against the float64 oracle on awkward shapes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from paged_video import kernels, reference
from paged_video.kernels.paged_attention import MAX_PIECES, block_pieces, kv_path
from tests.helpers import DEVICE, ON_GPU, nan_like
from tests.kernels.paged_case import (
    PagedCase,
    assert_lse_close,
    make_paged_case,
    tolerance_anchor,
)

# fp32 runs with ieee dot precision, so it must match float64 closely. fp16/bf16 are anchored
# on PyTorch's own error at that precision (kernel error <= 2x torch's, plus a small floor).
FP32_ATOL = 2e-5
# LSE: relative to its largest magnitude. Scores are float32 sums of exact products in every
# dtype (16-bit MMAs accumulate in float32), so low precision gets only a small margin.
LSE_RTOL = {torch.float32: 2e-6, torch.float16: 1e-5, torch.bfloat16: 1e-5}
LOW_PRECISION_DTYPES = [
    pytest.param(torch.float16, id="fp16"),
    pytest.param(
        torch.bfloat16,
        id="bf16",
        marks=pytest.mark.skipif(not ON_GPU, reason="the interpreter computes bf16 wrongly"),
    ),
]


def run_and_compare(case: PagedCase, *, causal: bool = False, **kwargs) -> None:
    """Output and LSE (``return_lse=True``) against the oracle's."""
    out = nan_like(case.q)
    got, lse = kernels.paged_attention(
        *case.args(),
        max_seqlen_q=case.max_seqlen_q,
        causal=causal,
        out=out,
        return_lse=True,
        **kwargs,
    )
    assert got is out
    oracle_kwargs = {k: v for k, v in kwargs.items() if k in ("key_limits", "key_gap")}
    want, want_lse = reference.paged_attention(
        *case.args(),
        max_seqlen_q=case.max_seqlen_q,
        causal=causal,
        out=torch.empty(case.q.shape, dtype=torch.float64, device=case.q.device),
        return_lse=True,
        **oracle_kwargs,
    )
    assert_lse_close(lse, want_lse, LSE_RTOL[case.q.dtype])
    assert not torch.isnan(got).any(), "kernel left NaN: an unwritten output or a poisoned read"
    if got.numel() == 0:
        return
    error = (got.double() - want).abs().max().item()
    if case.q.dtype == torch.float32:
        assert error <= FP32_ATOL, f"max error {error:.3e}"
    else:
        anchor = tolerance_anchor(case, want, causal=causal)
        assert error <= 2 * anchor + 1e-3, f"max error {error:.3e}, torch's own {anchor:.3e}"


BLOCK_SIZES = [1, 7, 16, 24, 64, 1560]


@pytest.mark.parametrize("block_size", BLOCK_SIZES, ids=lambda b: f"B{b}")
def test_varlen_batch_any_block_size(block_size: int) -> None:
    # One sequence with a single key, one longer than four blocks, one with no queries.
    long = max(4 * block_size + 3, 40) if block_size < 1560 else 2 * block_size + 5
    case = make_paged_case(
        q_lens=[3, 40, 0, 17],
        k_lens=[1, long, 9, 2 * block_size + 1],
        block_size=block_size,
        device=DEVICE,
    )
    run_and_compare(case)


@pytest.mark.parametrize("table_order", ["sequential", "permuted", "repeated"])
@pytest.mark.parametrize("block_size", [7, 16], ids=lambda b: f"B{b}")
def test_table_orders(table_order: str, block_size: int) -> None:
    case = make_paged_case(
        q_lens=[9, 21],
        k_lens=[50, 33],
        block_size=block_size,
        table_order=table_order,
        device=DEVICE,
    )
    run_and_compare(case)


# (block_size, block_n) for every key path: the tile divides the block, tiles of block pieces
# (whole tiles and the remainders gathered; two power-of-two pieces of a small block), a tile
# spans two blocks, blocks smaller than the tile (dividing it or not). Small tiles give many
# tiles, so the unmasked loop, the masked head and tail and the prefetch past the last tile all
# run.
PATHS = [
    pytest.param(16, 16, id="contiguous-B16-N16"),
    pytest.param(64, 32, id="contiguous-B64-N32"),
    pytest.param(256, 64, id="contiguous-B256-N64"),
    pytest.param(1560, 64, id="block_tiles-B1560-N64"),
    pytest.param(40, 16, id="block_tiles-B40-N16"),
    pytest.param(17, 16, id="block_tiles-B17-N16"),
    pytest.param(24, 16, id="block_tiles-B24-N16"),
    pytest.param(100, 64, id="block_tiles-B100-N64"),
    pytest.param(31, 16, id="block_tiles-B31-N16"),
    pytest.param(94, 64, id="block_tiles-B94-N64"),
    pytest.param(511, 256, id="two_blocks-B511-N256"),
    pytest.param(16, 64, id="rows-B16-N64"),
    pytest.param(24, 64, id="block_tiles-B24-N64"),
    pytest.param(12, 16, id="block_tiles-B12-N16"),
    pytest.param(7, 16, id="block_tiles-B7-N16"),
    pytest.param(31, 32, id="block_tiles-B31-N32"),
    pytest.param(1, 16, id="rows-B1-N16"),
    pytest.param(511, 512, id="rows-B511-N512"),
]


@pytest.mark.parametrize("block_size, block_n", PATHS)
def test_key_paths(block_size: int, block_n: int) -> None:
    tiles = kernels.choose_tiles(
        block_size=block_size, head_dim=64, max_seqlen_q=32, dtype=torch.float32, block_n=block_n
    )
    assert tiles["KV_PATH"] == kv_path(block_size, block_n)
    case = make_paged_case(
        q_lens=[32, 5],
        k_lens=[3 * block_size + 11 if block_size < 1560 else block_size + 200, block_size + 1],
        block_size=block_size,
        device=DEVICE,
    )
    run_and_compare(case, block_m=16, block_n=block_n)


def test_kv_path_classes() -> None:
    assert kv_path(1560, 64) == kv_path(520, 64) == kv_path(520, 128) == "block_tiles"
    # Remainders of more than a quarter of the block: cut into their powers of two, or, past
    # MAX_PIECES pieces (only at tiles of 256 keys or more), tiles straddle blocks instead.
    assert kv_path(100, 64) == kv_path(24, 16) == kv_path(200, 128) == "block_tiles"
    assert kv_path(94, 64) == kv_path(31, 16) == kv_path(190, 128) == "block_tiles"
    assert kv_path(255, 128) == kv_path(127, 64) == "block_tiles"
    assert kv_path(511, 256) == "two_blocks"
    assert kv_path(64, 64) == kv_path(256, 64) == "contiguous"
    assert kv_path(24, 64) == kv_path(12, 16) == kv_path(3, 16) == "block_tiles"
    assert kv_path(7, 16) == kv_path(15, 16) == kv_path(11, 128) == "block_tiles"
    assert kv_path(31, 32) == kv_path(63, 128) == kv_path(127, 128) == "block_tiles"
    assert kv_path(16, 64) == kv_path(1, 16) == kv_path(511, 512) == "rows"


def test_every_block_is_cut_into_pieces_at_tiles_up_to_128_keys() -> None:
    # The straddling paths are left to tiles of 256 keys or more (MAX_PIECES).
    for block_n in (16, 32, 64, 128):
        for block_size in range(1, 4 * block_n):
            path = kv_path(block_size, block_n)
            assert path != "two_blocks", (block_size, block_n)
            assert path != "rows" or block_n % block_size == 0, (block_size, block_n)


def test_block_pieces() -> None:
    # After the whole tiles when the rest is at most a quarter of the block, the rest masked only.
    assert block_pieces(1560, 64) == ((0, 1536, False), (1536, 24, True))
    assert block_pieces(520, 128) == ((0, 512, False), (512, 8, True))
    # Larger rests: the whole tiles, then the rest's powers of two, up to MAX_PIECES pieces.
    assert block_pieces(100, 64) == ((0, 64, False), (64, 32, False), (96, 4, False))
    assert block_pieces(94, 64) == (
        (0, 64, False), (64, 16, False), (80, 8, False), (88, 4, False), (92, 2, False)
    )  # fmt: skip
    assert block_pieces(255, 128) == tuple(
        (255 - 2 * size + 1, size, False) for size in (128, 64, 32, 16, 8, 4, 2, 1)
    )
    assert block_pieces(511, 256) == ((0, 511, False),)  # 9 pieces: tiles straddle
    # Smaller blocks: their powers of two, high to low, up to MAX_PIECES of them, or none.
    assert block_pieces(24, 64) == ((0, 16, False), (16, 8, False))
    assert block_pieces(7, 16) == ((0, 4, False), (4, 2, False), (6, 1, False))
    assert block_pieces(13, 128) == ((0, 8, False), (8, 4, False), (12, 1, False))
    assert block_pieces(15, 16) == ((0, 8, False), (8, 4, False), (12, 2, False), (14, 1, False))
    assert MAX_PIECES == 8 and block_pieces(511, 512) == ((0, 511, False),)
    assert block_pieces(16, 64) == ((0, 16, False),) and block_pieces(256, 64) == ((0, 256, False),)


@pytest.mark.parametrize("block_size", [3, 7, 11, 15, 21, 24, 31, 100, 127, 255, 520, 1560])
@pytest.mark.parametrize("block_n", [16, 64, 128])
def test_block_pieces_cover_each_block_once(block_size: int, block_n: int) -> None:
    # Pieces tile the block in order, and each piece's keys fill tiles without straddling it:
    # a piece divides the tile, or the tile divides it, or it runs masked only.
    pieces = block_pieces(block_size, block_n)
    assert len(pieces) <= MAX_PIECES
    assert [offset for offset, _, _ in pieces] == [
        sum(size for _, size, _ in pieces[:i]) for i in range(len(pieces))
    ]
    assert sum(size for _, size, _ in pieces) == block_size
    if len(pieces) > 1:
        for _, size, masked_only in pieces:
            assert masked_only or block_n % size == 0 or size % block_n == 0


@given(
    shape=st.sampled_from(
        [(17, 16), (20, 16), (40, 16), (52, 16), (100, 32), (24, 16), (28, 16), (24, 32), (12, 16)]
        # Three to six pieces (7 = 4 + 2 + 1, 15 = 8 + 4 + 2 + 1, 31 = 16 + 8 + 4 + 2 + 1)
        + [(7, 16), (15, 32), (31, 16), (47, 32), (63, 64)]
        # 128-key tiles, whose masked tiles are 64 keys (two head tiles, two tail tiles)
        + [(24, 128), (160, 128), (200, 128), (16, 128), (11, 128)]
        # Past MAX_PIECES pieces (511 = 256 + 255): tiles of 256 keys straddle two blocks
        + [(511, 256)]
    ),
    q_lens=st.lists(st.integers(0, 24), min_size=1, max_size=3),
    extra_k=st.lists(st.integers(0, 150), min_size=3, max_size=3),
    causal=st.booleans(),
    limits=st.booleans(),
    gaps=st.lists(st.tuples(st.integers(0, 180), st.integers(0, 60)), max_size=2),
    seed=st.integers(0, 2**16),
)
def test_property_tiles_near_block_edges(shape, q_lens, extra_k, causal, limits, gaps, seed):
    # block_tiles (remainders of 1..8 keys gathered into tiles of their own; blocks of 24 and 12
    # cut 16 + 8 and 8 + 4, of 7, 11 and 28 in three pieces, 15 in four, 31, 47 and 63 in five
    # or six) and two_blocks (511 at 256 keys): runs that start and end anywhere in a block's
    # pieces, under every mask, with small tiles so that many blocks and tiles are crossed (and
    # 128-key ones, masked 64 keys at a time: keys and gaps stretched 4x, so that unmasked tiles
    # sit between a run's masked head and tail).
    block_size, block_n = shape
    stretch = max(1, block_n // 32)
    k_lens = [q + extra * stretch for q, extra in zip(q_lens, extra_k, strict=False)]
    case = make_paged_case(
        q_lens=q_lens, k_lens=k_lens, block_size=block_size, head_dim=16, seed=seed, device=DEVICE
    )
    gen = torch.Generator().manual_seed(seed)
    kwargs = {"causal": causal, "block_m": 16, "block_n": block_n}
    if limits:
        kwargs["key_limits"] = torch.cat(
            [
                torch.randint(0, k + 1, (q,), generator=gen, dtype=torch.int32)
                for q, k in zip(q_lens, k_lens, strict=False)
            ]
        ).to(DEVICE)
    if gaps:
        rows = [[[lo * stretch, (lo + width) * stretch] for lo, width in gaps] for _ in k_lens]
        kwargs["key_gap"] = torch.tensor(rows, dtype=torch.int32, device=DEVICE)
    run_and_compare(case, **kwargs)


@pytest.mark.parametrize(
    "block_size, block_n, table_order",
    [(*p.values, "permuted") for p in PATHS] + [(24, 16, "repeated"), (7, 16, "repeated")],
    ids=str,
)
def test_key_paths_causal_limits_and_gaps(block_size: int, block_n: int, table_order: str) -> None:
    # Queries are the last keys of a chunk that starts mid-block; causal, per-row limits and a
    # gap in one call, so masked tiles sit before, between and after unmasked ones.
    k_len = min(5 * block_n + 9, 2 * block_size + 37) if block_size > 64 else 5 * block_n + 9
    case = make_paged_case(
        q_lens=[21, 3],
        k_lens=[k_len, 2 * block_n + 5],
        block_size=block_size,
        table_order=table_order,
        device=DEVICE,
    )
    gen = torch.Generator().manual_seed(block_size + block_n)
    key_limits = torch.randint(k_len // 2, k_len + 1, (24,), generator=gen, dtype=torch.int32)
    key_gap = torch.tensor(
        [[[block_n + 3, 2 * block_n + 1]], [[1, 2]]], dtype=torch.int32, device=DEVICE
    )
    run_and_compare(
        case,
        causal=True,
        key_limits=key_limits.to(DEVICE),
        key_gap=key_gap,
        block_m=16,
        block_n=block_n,
    )


@pytest.mark.parametrize(
    "block_size, path",
    [
        pytest.param(256, "contiguous", id="contiguous-B256"),
        pytest.param(1560, "block_tiles", id="block_tiles-B1560"),
        pytest.param(24, "block_tiles", id="block_tiles-B24"),
        pytest.param(200, "block_tiles", id="block_tiles-B200"),
        pytest.param(190, "block_tiles", id="block_tiles-B190"),
        pytest.param(16, "rows", id="rows-B16"),
        pytest.param(64, "rows", id="rows-B64"),
    ],
)
def test_masked_tiles_of_a_128_key_launch_are_64_keys(block_size: int, path: str) -> None:
    # The masked loop takes half the tile (kernels/_attention_jit.py, _attend_piece): a run that
    # starts 10 keys into a 128-key tile has two masked head tiles, and one that ends 100 keys
    # into one, two masked tail tiles; the gap's slots hold NaN, so a head tile read from the
    # wrong place shows. Row limits and causal rows add masked tiles between unmasked ones.
    assert kv_path(block_size, 128) == path
    k_len = 5 * 128 + 100
    case = make_paged_case(
        q_lens=[13, 4], k_lens=[k_len, 2 * 128 + 70], block_size=block_size,
        table_order="permuted", device=DEVICE,
    )  # fmt: skip
    key_gap = torch.tensor([[[0, 10]], [[140, 150]]], dtype=torch.int32, device=DEVICE)
    poisoned = PagedCase(**vars(case))
    poisoned.k_cache, poisoned.v_cache = case.k_cache.clone(), case.v_cache.clone()
    _poison_gaps(poisoned, key_gap)
    key_limits = torch.tensor(
        [k_len - 7 * i for i in range(13)] + [200, 255, 256, 326], dtype=torch.int32
    )
    for kwargs in ({}, {"causal": True, "key_limits": key_limits.to(DEVICE)}):
        want = reference.paged_attention(
            *case.args(), max_seqlen_q=case.max_seqlen_q, key_gap=key_gap, **kwargs
        )
        got = kernels.paged_attention(
            *poisoned.args(), max_seqlen_q=case.max_seqlen_q, key_gap=key_gap, block_m=16,
            block_n=128, out=nan_like(case.q), **kwargs,
        )  # fmt: skip
        torch.testing.assert_close(got, want.to(got.dtype), atol=FP32_ATOL, rtol=0)


@pytest.mark.parametrize(
    "num_heads, num_kv_heads", [pytest.param(8, 2, id="gqa8-2"), pytest.param(5, 1, id="gqa5-1")]
)
@pytest.mark.parametrize("head_dim", [64, 80, 128, 96], ids=lambda d: f"D{d}")
def test_gqa_and_head_dims(num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    case = make_paged_case(
        q_lens=[7, 12],
        k_lens=[30, 19],
        block_size=7,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        device=DEVICE,
    )
    run_and_compare(case)


@pytest.mark.parametrize("group", [1, 2, 5, 8], ids=lambda g: f"G{g}")
@pytest.mark.parametrize("block_size", [7, 24, 64], ids=lambda b: f"B{b}")
def test_gqa_packed_rows(group: int, block_size: int) -> None:
    # Rows of a tile are (query, head) pairs: with 16-row tiles and 5 heads per KV head a tile
    # starts mid-query, and causal limits differ inside one tile.
    case = make_paged_case(
        q_lens=[13, 6],
        k_lens=[90, 41],
        block_size=block_size,
        num_heads=2 * group,
        num_kv_heads=2,
        device=DEVICE,
    )
    run_and_compare(case, block_m=16, block_n=16)
    run_and_compare(case, causal=True, block_m=16, block_n=32)


@pytest.mark.parametrize("head_dim", [80, 96, 256], ids=lambda d: f"D{d}")
@pytest.mark.parametrize("block_size", [24, 64], ids=lambda b: f"B{b}")
def test_head_dims_not_a_tile_with_small_tiles(head_dim: int, block_size: int) -> None:
    # The unmasked loop loads whole key rows; a head_dim below the power-of-two tile masks the
    # dimensions there too.
    case = make_paged_case(
        q_lens=[18], k_lens=[150], block_size=block_size, head_dim=head_dim, device=DEVICE
    )
    run_and_compare(case, block_m=16, block_n=16)


def _poison_gaps(case: PagedCase, key_gap: torch.Tensor) -> None:
    """NaN into every cache slot a gap hides (the table must not share blocks between rows)."""
    block_size = case.k_cache.shape[1]
    for row, gaps in enumerate(key_gap.reshape(key_gap.shape[0], -1, 2).tolist()):
        k_len = int(case.seq_lens_k[row])
        for lo, hi in gaps:
            positions = torch.arange(max(lo, 0), min(hi, k_len))
            blocks = case.block_table[row, positions // block_size].long()
            case.k_cache[blocks, positions % block_size] = float("nan")
            case.v_cache[blocks, positions % block_size] = float("nan")


@pytest.mark.parametrize("block_size, block_n", [(24, 16), (7, 32), (1560, 64)], ids=str)
def test_gaps_whole_tiles_mid_tile_overlapping_unsorted(block_size: int, block_n: int) -> None:
    # Row 0: a gap covering tiles 2..4 whole, one starting mid-tile, two overlapping ones, out of
    # order. Row 1: a gap at key 0 and one running past its last key. Gap slots hold NaN.
    n = block_n
    k0 = 12 * n + 5
    case = make_paged_case(
        q_lens=[19, 7], k_lens=[k0, 4 * n + 3], block_size=block_size, device=DEVICE
    )
    key_gap = torch.tensor(
        [
            [[2 * n, 5 * n], [7 * n + 5, 8 * n + 9], [10 * n, 10 * n + 7], [10 * n + 3, 11 * n]],
            [[0, 3], [3 * n + 1, 9 * n], [0, 0], [2, 2]],
        ],
        dtype=torch.int32,
        device=DEVICE,
    )
    key_limits = torch.tensor([k0 - i for i in range(19)] + [9 * n] * 7, dtype=torch.int32)
    for kwargs in ({}, {"causal": True, "key_limits": key_limits.to(DEVICE)}):
        want = reference.paged_attention(
            *case.args(), max_seqlen_q=case.max_seqlen_q, key_gap=key_gap, **kwargs
        )
        poisoned = PagedCase(**vars(case))
        poisoned.k_cache, poisoned.v_cache = case.k_cache.clone(), case.v_cache.clone()
        _poison_gaps(poisoned, key_gap)
        got = kernels.paged_attention(
            *poisoned.args(),
            max_seqlen_q=case.max_seqlen_q,
            key_gap=key_gap,
            block_m=16,
            block_n=block_n,
            out=nan_like(case.q),
            **kwargs,
        )
        torch.testing.assert_close(got, want.to(got.dtype), atol=FP32_ATOL, rtol=0)


def test_rows_that_see_no_key_and_a_limit_of_zero() -> None:
    # One valid row with limit 0 makes no tile whole for the program: all tiles run masked.
    case = make_paged_case(q_lens=[20], k_lens=[100], block_size=24, device=DEVICE)
    key_limits = torch.tensor([0] + list(range(80, 99)), dtype=torch.int32, device=DEVICE)
    run_and_compare(case, key_limits=key_limits, block_m=16, block_n=16)


@pytest.mark.parametrize("scale", [-0.2, 0.0, 1.7])
def test_softmax_scale_any_sign(scale: float) -> None:
    # A negative scale runs as -q with -scale: the LSE is still of scale * q.k.
    case = make_paged_case(q_lens=[9], k_lens=[70], block_size=24, device=DEVICE)
    got, lse = kernels.paged_attention(
        *case.args(),
        max_seqlen_q=9,
        softmax_scale=scale,
        block_m=16,
        block_n=16,
        return_lse=True,
    )
    want, want_lse = reference.paged_attention(
        *case.args(), max_seqlen_q=9, softmax_scale=scale, return_lse=True
    )
    torch.testing.assert_close(got, want.to(got.dtype), atol=FP32_ATOL, rtol=0)
    assert_lse_close(lse, want_lse, LSE_RTOL[torch.float32])


def test_lse_off_is_the_plain_call() -> None:
    # return_lse only adds the LSE: the output is bit for bit the plain call's, which returns
    # the output tensor alone.
    case = make_paged_case(q_lens=[9, 4], k_lens=[40, 17], block_size=7, device=DEVICE)
    plain = kernels.paged_attention(*case.args(), max_seqlen_q=9, causal=True)
    assert isinstance(plain, torch.Tensor)
    out, lse = kernels.paged_attention(*case.args(), max_seqlen_q=9, causal=True, return_lse=True)
    assert torch.equal(out, plain)
    assert lse.shape == (13, 4) and lse.is_contiguous()


def test_lse_of_rows_that_see_no_key(monkeypatch) -> None:
    # Rows with nothing visible, each a different way: a key limit of 0 (row 0), causal rows
    # above the diagonal when q is longer than k (sequence 1's first rows), a gap over all keys
    # (sequence 2), no keys at all (sequence 3). Their LSE is -inf and their output zeros. The
    # LSE buffer is allocated NaN-filled here, so a row the kernel skips cannot pass.
    empty = torch.empty

    def nan_empty(*args, **kwargs):
        return empty(*args, **kwargs).fill_(float("nan"))

    case = make_paged_case(
        q_lens=[6, 9, 3, 2], k_lens=[30, 5, 20, 0], block_size=7, num_heads=6, device=DEVICE
    )
    key_limits = torch.tensor([0] + [30] * 19, dtype=torch.int32, device=DEVICE)
    key_gap = torch.tensor([[0, 0], [0, 0], [0, 20], [0, 0]], dtype=torch.int32, device=DEVICE)
    monkeypatch.setattr(torch, "empty", nan_empty)
    out, lse = kernels.paged_attention(
        *case.args(),
        max_seqlen_q=9,
        causal=True,
        key_limits=key_limits,
        key_gap=key_gap,
        out=nan_like(case.q),
        block_m=16,
        block_n=16,
        return_lse=True,
    )
    monkeypatch.undo()
    blind = torch.zeros(20, dtype=torch.bool)
    blind[[0, 6, 7, 8, 9, 15, 16, 17, 18, 19]] = True
    assert torch.isneginf(lse[blind]).all() and torch.isfinite(lse[~blind]).all()
    assert torch.equal(out[blind], torch.zeros_like(out[blind]))
    run_and_compare(case, causal=True, key_limits=key_limits, key_gap=key_gap)


def test_head_dim_256() -> None:
    case = make_paged_case(
        q_lens=[5],
        k_lens=[20],
        block_size=16,
        num_heads=2,
        num_kv_heads=1,
        head_dim=256,
        device=DEVICE,
    )
    run_and_compare(case)


@pytest.mark.parametrize("dtype", LOW_PRECISION_DTYPES)
@pytest.mark.parametrize("block_size", [7, 16], ids=lambda b: f"B{b}")
def test_low_precision(dtype: torch.dtype, block_size: int) -> None:
    case = make_paged_case(
        q_lens=[11, 30],
        k_lens=[45, 70],
        block_size=block_size,
        head_dim=80,
        dtype=dtype,
        device=DEVICE,
    )
    run_and_compare(case)


@pytest.mark.parametrize("block_size", [1, 7, 16], ids=lambda b: f"B{b}")
def test_causal_bottom_right(block_size: int) -> None:
    # q shorter than, equal to and longer than k: bottom-right alignment in each.
    case = make_paged_case(
        q_lens=[5, 20, 30], k_lens=[20, 20, 12], block_size=block_size, device=DEVICE
    )
    run_and_compare(case, causal=True)


def test_key_limits_and_gap() -> None:
    case = make_paged_case(q_lens=[6, 10], k_lens=[40, 25], block_size=7, device=DEVICE)
    key_limits = torch.tensor(
        [0, 1, 5, 40, 17, 3] + [25, 24, 1, 2, 9, 13, 0, 25, 7, 11], dtype=torch.int32, device=DEVICE
    )
    key_gap = torch.tensor([[3, 30], [0, 0]], dtype=torch.int32, device=DEVICE)
    run_and_compare(case, key_limits=key_limits, key_gap=key_gap)
    run_and_compare(case, causal=True, key_limits=key_limits)


@pytest.mark.parametrize("block_n", [16, 64], ids=lambda n: f"N{n}")
def test_several_key_gaps_per_row(block_n: int) -> None:
    # Three gaps per row (one empty, two touching): e.g. an exact window's boundary tokens plus
    # the unwritten hole between a mid-block video end and the action blocks.
    case = make_paged_case(q_lens=[5, 9], k_lens=[90, 70], block_size=16, device=DEVICE)
    key_gap = torch.tensor(
        [[[10, 37], [50, 64], [64, 66]], [[0, 0], [0, 16], [69, 70]]],
        dtype=torch.int32,
        device=DEVICE,
    )
    run_and_compare(case, key_gap=key_gap, block_m=16, block_n=block_n)


def test_hidden_keys_are_never_loaded() -> None:
    # Keys in a gap may be unwritten slots: NaN written into the gap [16, 48) afterwards must
    # not reach the output (a masked score alone would not do: 0 * NaN in P @ V is NaN).
    case = make_paged_case(q_lens=[8], k_lens=[64], block_size=16, device=DEVICE)
    key_gap = torch.tensor([[16, 48]], dtype=torch.int32, device=DEVICE)
    want = reference.paged_attention(*case.args(), max_seqlen_q=8, key_gap=key_gap)
    hidden = case.block_table[0, 1:3].long()
    case.k_cache[hidden] = float("nan")
    case.v_cache[hidden] = float("nan")
    got = kernels.paged_attention(
        *case.args(), max_seqlen_q=8, key_gap=key_gap, block_m=16, block_n=16, out=nan_like(case.q)
    )
    torch.testing.assert_close(got, want, atol=FP32_ATOL, rtol=0)


def test_zero_length_keys_give_zeros() -> None:
    case = make_paged_case(q_lens=[4, 3], k_lens=[0, 5], block_size=4, device=DEVICE)
    out = kernels.paged_attention(*case.args(), max_seqlen_q=4, out=nan_like(case.q))
    assert torch.equal(out[:4], torch.zeros_like(out[:4]))
    run_and_compare(case)


def test_softmax_scale() -> None:
    case = make_paged_case(q_lens=[9], k_lens=[20], block_size=7, device=DEVICE)
    got = kernels.paged_attention(*case.args(), max_seqlen_q=9, softmax_scale=0.3)
    want = reference.paged_attention(*case.args(), max_seqlen_q=9, softmax_scale=0.3)
    torch.testing.assert_close(got, want, atol=FP32_ATOL, rtol=0)


def test_strided_inputs() -> None:
    # q and the caches as non-contiguous views: strides must be honoured, not assumed.
    case = make_paged_case(q_lens=[9], k_lens=[30], block_size=7, device=DEVICE)
    wide_q = torch.randn(9, 4, 2 * 64, device=DEVICE)[:, :, ::2]
    wide_q.copy_(case.q)
    case.q = wide_q
    case.k_cache = torch.cat([case.k_cache, case.k_cache], dim=2)[:, :, ::2]
    case.v_cache = torch.cat([case.v_cache, case.v_cache], dim=2)[:, :, ::2]
    assert not case.q.is_contiguous() and not case.k_cache.is_contiguous()
    run_and_compare(case)


@pytest.mark.parametrize(
    "launch", [{}, {"block_n": 16, "variant": "tma"}], ids=["default", "tma-contiguous"]
)
def test_offsets_past_int32(launch: dict) -> None:
    # The used blocks sit past 2**31 elements into the cache: offsets computed in int32 wrap
    # (the TMA variant's descriptor rows are block * block_size + slot, its addresses 64-bit).
    block_size, heads, dim = 16, 1, 64
    per_block = block_size * heads * dim
    num_blocks = 2**31 // per_block + 8
    # torch.empty does not touch memory; only the blocks written below become resident.
    k_cache = torch.empty(num_blocks, block_size, heads, dim, dtype=torch.float16, device=DEVICE)
    v_cache = torch.empty_like(k_cache)
    far = [num_blocks - 3, num_blocks - 1, 2]
    assert far[0] * per_block > 2**31
    table = torch.tensor([far + [0]], dtype=torch.int32, device=DEVICE)
    gen = torch.Generator().manual_seed(1)
    for block in far:
        k_cache[block] = torch.randn(block_size, heads, dim, generator=gen).half()
        v_cache[block] = torch.randn(block_size, heads, dim, generator=gen).half()
    q = torch.randn(10, 2, dim, generator=gen).half().to(DEVICE)
    cu = torch.tensor([0, 10], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([40], dtype=torch.int32, device=DEVICE)
    got = kernels.paged_attention(q, k_cache, v_cache, table, cu, lens, max_seqlen_q=10, **launch)
    want = reference.paged_attention(q, k_cache, v_cache, table, cu, lens, max_seqlen_q=10)
    assert (got.double() - want.double()).abs().max().item() < 2e-3


@given(
    block_size=st.sampled_from([1, 3, 7, 16, 24, 33, 64]),
    q_lens=st.lists(st.integers(0, 40), min_size=1, max_size=3),
    extra_k=st.lists(st.integers(0, 90), min_size=3, max_size=3),
    heads=st.sampled_from([(4, 4), (4, 2), (6, 3), (5, 1)]),
    head_dim=st.sampled_from([16, 64, 80]),
    table_order=st.sampled_from(["sequential", "permuted", "repeated"]),
    causal=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_property_matches_oracle(
    block_size, q_lens, extra_k, heads, head_dim, table_order, causal, seed
) -> None:
    k_lens = [q + extra for q, extra in zip(q_lens, extra_k, strict=False)]
    case = make_paged_case(
        q_lens=q_lens,
        k_lens=k_lens,
        block_size=block_size,
        num_heads=heads[0],
        num_kv_heads=heads[1],
        head_dim=head_dim,
        table_order=table_order,
        seed=seed,
        device=DEVICE,
    )
    run_and_compare(case, causal=causal)

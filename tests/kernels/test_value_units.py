"""Quantized attention's probability units (``kernels/value_units.py``) against a plain gather.

A unit is the largest V scale of a sequence's keys outside its gaps, / the scale's largest value
in the unit (2**15 / 448 for the float16 operands), per
KV head, at least float32's smallest normal. The slots it must not read (gap slots, slots past the
sequence's length, blocks the table does not point at) hold NaN or a huge scale, so reading one
shows. The attention tests (``test_paged_attention_quantized``, ``test_quantized_modes``) hold
the kernel that uses them to the float64 emulation with the same unit.
"""

from __future__ import annotations

import pytest
import torch

from paged_video import kernels
from paged_video.kernels import pool_layout, value_units
from tests.helpers import DEVICE, record_launches
from tests.kernels.paged_case import make_paged_case
from tests.kernels.test_paged_attention_quantized import quantized_args

SMALLEST_NORMAL = torch.finfo(torch.float32).tiny


def _shown_keys(k_len: int, gaps: list[tuple[int, int]]) -> torch.Tensor:
    """The keys below ``k_len`` outside every ``[lo, hi)`` of ``gaps``."""
    keys = torch.arange(k_len)
    shown = torch.ones(k_len, dtype=torch.bool)
    for lo, hi in gaps:
        shown &= (keys < lo) | (keys >= hi)
    return keys[shown]


def _units(
    v_scale: torch.Tensor, table: torch.Tensor, lens: list[int], gaps: list, largest: float
) -> torch.Tensor:
    """The units by a gather over each sequence's keys, float32 as the kernel computes them."""
    block_size = v_scale.shape[1]
    units = torch.empty(len(lens), v_scale.shape[2])
    for i, k_len in enumerate(lens):
        keys = _shown_keys(k_len, gaps[i])
        scales = v_scale.cpu()[table[i, keys // block_size].long(), keys % block_size]
        biggest = scales.amax(dim=0) if len(keys) else torch.zeros(v_scale.shape[2])
        units[i] = (biggest / largest).clamp_min(SMALLEST_NORMAL)
    return units


def _poisoned_pool(
    num_blocks: int, block_size: int, kv_heads: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scales to write, and the poison every slot left unwritten holds instead."""
    gen = torch.Generator().manual_seed(seed)
    scales = torch.rand(num_blocks, block_size, kv_heads, generator=gen) * 10.0
    # Half the slots (whatever a test leaves unread) hold NaN, the others a huge scale.
    poison = torch.where(torch.rand(scales.shape, generator=gen) < 0.5, float("nan"), 1e30)
    return scales, poison


@pytest.mark.parametrize(
    "block_size, lens",
    [
        # Past one chunk of keys (4096), a sequence ending mid-block, one with no keys.
        pytest.param(7, [4500, 40, 0], id="B7-chunks"),
        pytest.param(1560, [3 * 1560 - 5, 1561, 1], id="B1560"),
        pytest.param(1, [33, 2, 17], id="B1"),
    ],
)
@pytest.mark.parametrize("keys_major", [False, True], ids=["slot-major", "keys-major"])
def test_units_are_the_largest_scale_outside_the_gaps(
    nan_filled_empty, block_size: int, lens: list[int], keys_major: bool
) -> None:
    largest = value_units.FLOAT16_LARGEST
    kv_heads = 3
    blocks_per_seq = [-(-k_len // block_size) for k_len in lens]
    num_blocks = sum(blocks_per_seq) + 2  # two blocks no table points at
    scales, poison = _poisoned_pool(num_blocks, block_size, kv_heads, seed=block_size)
    # A permuted table, one row per sequence, padded with a poisoned block.
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(1)).int()
    width = max(blocks_per_seq) + 1
    table = torch.full((len(lens), width), int(order[-1]), dtype=torch.int32)
    start = 0
    for i, count in enumerate(blocks_per_seq):
        table[i, :count] = order[start : start + count]
        start += count
    # Gaps: overlapping, out of order, empty; their slots are poisoned.
    gaps = [
        [(lens[0] // 3, lens[0] // 2), (5, 9), (lens[0] // 4, lens[0] // 3 + 2)],
        [(lens[1] - 1, lens[1]), (0, 0), (3, 3)],
        [(0, 0), (0, 0), (0, 0)],
    ]
    written = torch.zeros(scales.shape[:2], dtype=torch.bool)
    for i, k_len in enumerate(lens):
        keys = _shown_keys(k_len, gaps[i])
        written[table[i, keys // block_size].long(), keys % block_size] = True
    pool = torch.where(written[..., None], scales, poison)
    if keys_major:
        pool = pool_layout.keys_major(pool.to(DEVICE))
    key_gap = torch.tensor(gaps, dtype=torch.int32)
    units = value_units.probability_units(
        pool.to(DEVICE), table.to(DEVICE), torch.tensor(lens, dtype=torch.int32, device=DEVICE),
        key_gap.to(DEVICE), largest=largest,
    )  # fmt: skip
    want = _units(pool, table, lens, gaps, largest)
    torch.testing.assert_close(units.cpu(), want, atol=0, rtol=0)
    assert units[2 if lens[2] == 0 else 0].min() > 0  # no key: the smallest normal, not 0


def test_no_gaps_and_zero_rows() -> None:
    # Without gaps every key below the length counts; a sequence of zero scales gets float32's
    # smallest normal (a finite unit, so no division by 0).
    pool = torch.zeros(4, 16, 2)
    pool[1, 3, 1] = 448.0 * 3.0
    pool[2] = float("nan")  # past both lengths
    table = torch.tensor([[1, 0], [3, 2]], dtype=torch.int32)
    lens = torch.tensor([20, 16], dtype=torch.int32)
    units = value_units.probability_units(
        pool.to(DEVICE), table.to(DEVICE), lens.to(DEVICE), None, largest=448.0
    ).cpu()
    assert units.tolist() == [[SMALLEST_NORMAL, 3.0], [SMALLEST_NORMAL, SMALLEST_NORMAL]]


@pytest.mark.parametrize(
    "dtype, modes, largest",
    [
        pytest.param(torch.int8, {}, 2.0**15 / 448, id="int8"),
    ],
)
def test_each_mode_takes_the_unit_of_its_probabilities(
    monkeypatch, dtype: torch.dtype, modes: dict, largest: float
) -> None:
    # The 16-bit P V scales float16 operands (no code times its scale over 2**15).
    launches = record_launches(monkeypatch, value_units, "_probability_unit_kernel")
    case = make_paged_case(q_lens=[3], k_lens=[20], block_size=8, device=DEVICE)
    args, scales = quantized_args(case, dtype)
    kernels.paged_attention(*args, **scales, **modes)
    assert [launch["LARGEST"] for launch in launches] == [largest]
    launches.clear()
    kernels.paged_attention(*case.args(), max_seqlen_q=case.max_seqlen_q)
    assert launches == []  # 16-bit pools: no unit

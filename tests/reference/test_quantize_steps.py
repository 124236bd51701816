"""``reference.quantize.nearest_code_error``'s code step, against the e4m3 grid itself.

Every GPU check of a quantized write divides by this step: if it halved at the codes that are
powers of two (as ``floor(log2(code))`` does where a device's float64 log2 of 2**k falls just
below k), every nearest code there would read as up to two half-steps off.
"""

from __future__ import annotations

import torch

from paged_video.reference.quantize import nearest_code_error
from tests.helpers import DEVICE

E4M3 = torch.float8_e4m3fn


def with_unit_scale(column: torch.Tensor) -> torch.Tensor:
    """Rows ``(value, 448)``: each row's amax scale is exactly 1, so values are their codes."""
    return torch.stack([column, torch.full_like(column, 448.0)], dim=-1)


def e4m3_grid() -> torch.Tensor:
    """The finite non-negative e4m3 values, ascending, in float64."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(E4M3).to(torch.float64)
    return torch.unique(codes[codes.isfinite() & (codes >= 0)])


def test_the_step_is_the_gap_above_each_code_on_the_device() -> None:
    grid = e4m3_grid()
    gaps = grid[1:] - grid[:-1]
    codes = grid[:-1].to(DEVICE)
    # x a quarter gap above each code: the code is nearest, half a half-step away.
    x = with_unit_scale(codes + gaps.to(DEVICE) / 4)
    scale = torch.ones(codes.shape, dtype=torch.float32, device=DEVICE)
    error = nearest_code_error(with_unit_scale(codes).to(E4M3), scale, x, E4M3)[:, 0]
    torch.testing.assert_close(error.cpu(), torch.full_like(error.cpu(), 0.5), rtol=0, atol=0)


def test_a_code_one_step_away_is_two_half_steps_off() -> None:
    grid = e4m3_grid()
    # Just above each power of two: the nearest code is that power; the next code up is a
    # whole step away.
    powers = grid[(grid >= 2.0**-6) & (torch.log2(grid) == torch.log2(grid).round())][:-1]
    above = torch.searchsorted(grid, powers) + 1
    x = with_unit_scale(powers.to(DEVICE))
    scale = torch.ones(len(powers), dtype=torch.float32, device=DEVICE)
    codes = with_unit_scale(grid[above].to(DEVICE)).to(E4M3)
    error = nearest_code_error(codes, scale, x, E4M3)[:, 0]
    torch.testing.assert_close(error.cpu(), 2 * torch.ones_like(error.cpu()), rtol=0, atol=0)

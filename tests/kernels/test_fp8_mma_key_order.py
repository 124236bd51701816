"""The key order of k8v8's unmasked loops (``kernels/_attention_jit.py``): K's rows and the
scales are read in ``_fp8_mma_key_order`` so that the probabilities feed the 8-bit ``P V`` MMA
as they lie in registers, over V's tile in position order.

On sm_90 the scores' accumulator gives thread ``q`` of a quad columns ``2q, 2q + 1, 2q + 8,
2q + 9`` of every 16, and the 8-bit MMA's A operand takes from it keys ``4q .. 4q + 3`` of every
16. These tests hold the three helpers to that and to each other, exactly (a relabelling
computes nothing); the end-to-end checks are the k8v8 tests of ``test_k8v8_attention.py``,
and that the relabelling costs no instruction is the
compile report's (``tests/bench/test_compile_report.py``).
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from paged_video.kernels._attention_jit import (
    _fp8_mma_key_order,
    _fp8_operand,
    _in_fp8_mma_key_order,
)
from tests.helpers import DEVICE

ROWS = 16


@triton.jit
def _orders_kernel(
    x_ptr, p_ptr, order_ptr, by_column_ptr, operand_ptr, ROWS: tl.constexpr, N: tl.constexpr
):
    offs = tl.arange(0, N)
    rows = tl.arange(0, ROWS)
    tl.store(order_ptr + offs, _fp8_mma_key_order(offs))
    tl.store(by_column_ptr + offs, _in_fp8_mma_key_order(tl.load(x_ptr + offs), N))
    tile = rows[:, None] * N + offs[None, :]
    tl.store(operand_ptr + tile, _fp8_operand(tl.load(p_ptr + tile), N))


def _orders(n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    x = torch.randn(n, device=DEVICE)
    p = torch.randn(ROWS, n, device=DEVICE)
    order = torch.full((n,), -1, dtype=torch.int32, device=DEVICE)
    by_column = torch.full_like(x, float("nan"))
    operand = torch.full_like(p, float("nan"))
    _orders_kernel[(1,)](x, p, order, by_column, operand, ROWS=ROWS, N=n)
    return x, p, order.long().cpu(), by_column.cpu(), operand.cpu()


def _quad_layout_order(n: int) -> torch.Tensor:
    """Column -> position from the two layouts: thread q's accumulator columns of each run of
    16 take, in order, the keys of its A operand."""
    order = torch.empty(n, dtype=torch.long)
    for run in range(0, n, 16):
        for q in range(4):
            columns = [2 * q, 2 * q + 1, 2 * q + 8, 2 * q + 9]
            keys = [4 * q + i for i in range(4)]
            for column, key in zip(columns, keys, strict=True):
                order[run + column] = run + key
    return order


@pytest.mark.parametrize("n", [32, 64, 128])
def test_key_order_gives_each_thread_its_operand_keys(n: int) -> None:
    _, _, order, _, _ = _orders(n)
    assert torch.equal(order, _quad_layout_order(n))


@pytest.mark.parametrize("n", [32, 128])
def test_vectors_by_column_and_the_operand_follow_the_key_order(n: int) -> None:
    x, p, order, by_column, operand = _orders(n)
    # A vector by position (scales, block ids) read by score column.
    assert torch.equal(by_column, x.cpu()[order])
    # Score column c lands in the operand's column of its key: P's product with V's rows in
    # position order is the product of the scores' columns with their keys' rows.
    assert torch.equal(operand[:, order], p.cpu())
    v = torch.randn(n, 8, dtype=torch.float64)
    torch.testing.assert_close(operand.double() @ v, p.cpu().double() @ v[order])

"""The int8 query rows (``kernels/query_codes.py``) against the float64 quantizing oracle.

Each (token, head) row of q, times its KV head's K channel factors, becomes int8 codes and a
float32 scale exactly as ``reference.quantize`` makes them; the attention kernel loads them, so
its k8v8, k8v16 and INT8-MMA tests hold the rest.
"""

from __future__ import annotations

import pytest
import torch

from paged_video.kernels import query_codes
from paged_video.reference.quantize import nearest_code_error, quantize
from tests.helpers import DEVICE


def _rows(tokens: int, heads: int, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows of every magnitude, a zero row and a row of one nonzero value, as a strided view
    (every other channel of a wider tensor) so no contiguity is assumed."""
    gen = torch.Generator().manual_seed(tokens * heads + head_dim)
    wide = torch.randn(tokens, heads, 2 * head_dim, generator=gen)
    wide *= torch.exp2(torch.randint(-20, 12, (tokens, heads, 1), generator=gen).float())
    wide[1, 0] = 0.0
    wide[2, -1] = 0.0
    wide[2, -1, 2 * (head_dim - 1)] = -3.0
    return wide.to(dtype).to(DEVICE)[..., ::2]


@pytest.mark.parametrize(
    "tokens, heads, kv_heads, head_dim, dtype",
    [
        # 70 * 8 rows: the last program holds a partial block of rows.
        pytest.param(70, 8, 2, 128, torch.bfloat16, id="gqa4-d128-bf16"),
        pytest.param(9, 3, 3, 80, torch.float16, id="mha-d80-fp16"),
        pytest.param(5, 4, 1, 64, torch.float32, id="mqa-d64-fp32"),
    ],
)
@pytest.mark.parametrize("equalized", [False, True], ids=["plain", "equalized"])
def test_codes_and_scales_are_the_oracles(
    nan_filled_empty,
    tokens: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    equalized: bool,
) -> None:
    q = _rows(tokens, heads, head_dim, dtype)
    group = heads // kv_heads
    factor = None
    if equalized:
        # Powers of two, as channel_factors chooses them: folding them in is exact.
        gen = torch.Generator().manual_seed(head_dim)
        factor = torch.exp2(torch.randint(0, 9, (kv_heads, head_dim), generator=gen).float())
        factor = factor.to(DEVICE)
    codes, scales = query_codes.int8_query_rows(q, factor, group)
    assert (codes.dtype, codes.shape, codes.is_contiguous()) == (torch.int8, q.shape, True)
    assert (scales.dtype, scales.shape) == (torch.float32, q.shape[:2])
    rows = q.double().cpu()
    if factor is not None:
        rows = rows * factor.double().cpu().repeat_interleave(group, dim=0)
    _, want_scales = quantize(rows, torch.int8)
    torch.testing.assert_close(scales.cpu(), want_scales, atol=0, rtol=0)
    # Codes round the float32 quotient, which may land on a tie the float64 one misses: each
    # must be a nearest code (within half a step of the exact quotient).
    error = nearest_code_error(codes.cpu(), scales.cpu(), rows, torch.int8)
    assert float(error.max()) <= 1 + 1e-3
    # The zero row: scale 0 and codes 0, never NaN; the one-value row: that value at -127.
    assert scales[1, 0] == 0 and not codes[1, 0].float().any()
    assert codes[2, -1, -1].float() == -127.0 and codes[2, -1, :-1].float().abs().sum() == 0


def test_factors_are_those_of_each_heads_kv_head() -> None:
    # Two KV heads of two query heads each; K's factors differ per KV head: a query head must
    # take its own KV head's (head // group), not another's.
    q = torch.ones(3, 4, 16, device=DEVICE)
    factor = torch.tensor([[1.0] * 15 + [4.0], [1.0] * 15 + [16.0]], device=DEVICE)
    codes, scales = query_codes.int8_query_rows(q, factor, 2)
    want = torch.tensor([4.0, 4.0, 16.0, 16.0]) / 127  # float32, as stored
    assert torch.equal(scales[0].cpu(), want), scales[0]
    assert codes[0, :, -1].float().tolist() == [127.0] * 4
    assert codes[0, :2, 0].float().tolist() == [32.0] * 2  # 1 / (4 / 127), rounded
    assert codes[0, 2:, 0].float().tolist() == [8.0] * 2  # 1 / (16 / 127), rounded

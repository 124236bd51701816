"""The k8v16 format: int8 K codes per slot (``Q K^T`` as an int8 MMA on int8 query rows) beside
V stored as it is (``P V`` a 16-bit MMA), written by ``write_slots`` and attended by
``paged_attention``. Its only roundings are K's and the query rows', so the kernel is held to
the float64 oracle over the int8-rounded query rows and the dequantized keys at float32
accuracy; pools poisoned outside what is written, outputs poisoned before the launch."""

from __future__ import annotations

import importlib

import pytest
import torch

from paged_video import kernels, reference
from paged_video.kernels import pool_layout
from paged_video.reference.quantize import dequantize, quantize
from tests.helpers import DEVICE, nan_like, record_launches
from tests.kernels.paged_case import assert_lse_close, make_paged_case
from tests.kernels.test_k8v8_attention import masked_case, p_v_behind_case

FP32_ATOL = 2e-5
LSE_RTOL = 2e-6
launcher = importlib.import_module("paged_video.kernels.paged_attention")


def k8v16_pools(case):
    k_cache = case.k_cache.cpu()
    written = ~torch.isnan(k_cache[..., 0])
    k_codes, k_scale = quantize(k_cache.nan_to_num(0.0), torch.int8)
    k_codes[~written] = -128
    k_scale[~written] = float("nan")
    return k_codes.to(DEVICE), case.v_cache, k_scale.to(DEVICE)


@pytest.mark.parametrize(
    "block_size, block_n",
    [
        pytest.param(1, 16, id="rows-B1-N16"),
        pytest.param(7, 16, id="block_tiles-B7-N16"),
        pytest.param(24, 32, id="block_tiles-B24-N32"),
        pytest.param(64, 64, id="contiguous-B64-N64"),
    ],
)
def test_k8v16_against_the_oracle_over_rounded_queries(block_size: int, block_n: int) -> None:
    case, kwargs = masked_case(block_size, block_n, "repeated" if block_size == 7 else "permuted")
    check(case, k8v16_pools(case), block_m=16, block_n=block_n, **kwargs)


@pytest.mark.parametrize(
    "block_size, head_dim, variant",
    [
        pytest.param(256, 64, "tma", id="tma-B256"),
        pytest.param(64, 80, None, id="pointer-B64-hd80"),
        pytest.param(128, 80, None, id="pointer-B128-hd80"),
        pytest.param(16, 128, None, id="rows-B16"),
        pytest.param(24, 80, None, id="pieces-B24-hd80"),
        pytest.param(7, 128, None, id="pieces-B7"),
    ],
)
def test_k8v16_p_v_under_the_next_softmax(
    monkeypatch: pytest.MonkeyPatch, block_size: int, head_dim: int, variant
) -> None:
    # 64-key tiles, inside a block or gathered from blocks (rows) or block pieces: each tile's
    # P V MMA issued an iteration after its softmax, into acc in place (_attend_pv_behind).
    # Runs of 6, 1, 2 and 0 unmasked tiles over permuted blocks, each behind a masked tail, so
    # a missing first or last P V, a doubled softmax step or V a tile off shows.
    case = p_v_behind_case(block_size, head_dim)
    k_codes, v_cache, k_scale = k8v16_pools(case)
    if variant == "tma":
        k_scale = pool_layout.keys_major(k_scale)
    launches = record_launches(monkeypatch, launcher, "_paged_attention_kernel")
    launch = {} if variant is None else dict(variant=variant)
    check(case, (k_codes, v_cache, k_scale), block_n=64, **launch)
    assert [(flags["BLOCK_N"], flags["TMA"]) for flags in launches] == [(64, variant == "tma")]


def check(case, pools: tuple, **kwargs) -> None:
    """The kernel's output within float32 accuracy of the float64 oracle over the int8-rounded
    query rows and the dequantized keys, its LSE of those rows (``kwargs``: launcher
    keywords)."""
    k_codes, v_cache, k_scale = pools
    args = (case.q, k_codes, v_cache, case.block_table, case.cu_seqlens_q, case.seq_lens_k)
    got, lse = kernels.paged_attention(
        *args, max_seqlen_q=case.max_seqlen_q, k_scale=k_scale, out=nan_like(case.q),
        return_lse=True, **kwargs,
    )  # fmt: skip
    assert not torch.isnan(got).any()
    q_rows = dequantize(*quantize(case.q.cpu().double(), torch.int8))
    k = dequantize(k_codes.cpu(), k_scale.cpu().contiguous())
    k[k_codes.cpu() == -128] = float("nan")
    masks = {
        n: v.cpu() if isinstance(v, torch.Tensor) else v
        for n, v in kwargs.items()
        if n in ("causal", "key_limits", "key_gap")
    }
    oracle_args = (q_rows, k, case.v_cache.cpu().double(), case.block_table.cpu(),
                   case.cu_seqlens_q.cpu(), case.seq_lens_k.cpu())  # fmt: skip
    want, want_lse = reference.paged_attention(
        *oracle_args, max_seqlen_q=case.max_seqlen_q, return_lse=True,
        out=torch.empty(q_rows.shape, dtype=torch.float64), **masks,
    )  # fmt: skip
    error = (got.double().cpu() - want).abs().max().item()
    assert error <= FP32_ATOL * max(1.0, want.abs().max().item()), error
    assert_lse_close(lse.cpu(), want_lse, LSE_RTOL)


def test_k8v16_write_keeps_v_and_codes_k() -> None:
    blocks, block_size, heads, dim = 4, 7, 2, 80
    k_pool = torch.full((blocks, block_size, heads, dim), -128, dtype=torch.int8, device=DEVICE)
    v_pool = torch.full((blocks, block_size, heads, dim), float("nan"), device=DEVICE)
    k_scale = torch.full((blocks, block_size, heads), float("nan"), device=DEVICE)
    gen = torch.Generator().manual_seed(2)
    key, value = (torch.randn(12, heads, dim, generator=gen) * 4 for _ in range(2))
    slots = torch.tensor([5, 6, 7, -1, 8, 9, 10, 11, 12, 13, 14, 20], dtype=torch.int32)
    kernels.write_slots(
        key.to(DEVICE), value.to(DEVICE), k_pool, v_pool, slots.to(DEVICE), k_scale=k_scale
    )
    keep = slots >= 0
    block, offset = slots[keep] // block_size, slots[keep] % block_size
    codes, scale = quantize(key[keep].double(), torch.int8)
    assert torch.equal(k_pool.cpu()[block, offset], codes)
    assert torch.equal(k_scale.cpu()[block, offset], scale.float())
    assert torch.equal(v_pool.cpu()[block, offset], value[keep])
    unwritten = torch.ones(blocks * block_size, dtype=torch.bool)
    unwritten[slots[keep].long()] = False
    assert v_pool.cpu().flatten(0, 1)[unwritten].isnan().all()
    assert (k_pool.cpu().flatten(0, 1)[unwritten] == -128).all()


def test_k8v16_refuses_v_scales_and_mma_flags() -> None:
    case = make_paged_case(q_lens=[3], k_lens=[20], block_size=8, device=DEVICE)
    k_codes, v_cache, k_scale = k8v16_pools(case)
    args = (case.q, k_codes, v_cache, case.block_table, case.cu_seqlens_q, case.seq_lens_k)
    with pytest.raises(ValueError, match="no v_scale"):
        kernels.paged_attention(*args, max_seqlen_q=3, k_scale=k_scale, v_scale=k_scale)
    with pytest.raises(ValueError, match=r'int8_mma was deleted.*"k8v16"'):
        kernels.paged_attention(*args, max_seqlen_q=3, k_scale=k_scale, int8_mma=True)
    with pytest.raises(TypeError, match="must have q's dtype"):
        kernels.paged_attention(
            case.q, k_codes, v_cache.double(), *args[3:], max_seqlen_q=3, k_scale=k_scale
        )

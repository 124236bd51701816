"""paged_attention over k8v8 pools (int8 K per slot, e4m3 V per block and channel) against a
float64 emulation of the format's arithmetic and the dequantizing float64 oracle.

The kernel rounds each query row to int8 (``Q K^T`` then exact int32 sums) and the probabilities (a
row's largest 448) to e4m3, per key tile after a running row max, where the emulation rounds them
after the final one: element by element its rounding errors differ, not in size. So the kernel is
held to the oracle within twice the emulation's error, and its LSE, of the scores it computed and
the rounded probabilities it summed (each within 2**-4 of its value), to within that rounding.
Pools are NaN-poisoned outside what the tables point at, outputs NaN-poisoned before the
launch.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import sys

import pytest
import torch
from torch import Tensor

from paged_video import kernels, reference
from paged_video.kernels import pool_layout
from paged_video.kernels.paged_attention import choose_tiles
from paged_video.reference.quantize import dequantize, quantize
from tests.helpers import DEVICE, ON_GPU, nan_like, record_launches
from tests.kernels.paged_case import PagedCase, assert_lse_close, make_paged_case
from tests.kernels.test_strided_index import column, column_major

launcher = importlib.import_module("paged_video.kernels.paged_attention")
E4M3_NAN = 0x7F
MARGIN = 2.0
FP32_ATOL = 2e-5
LSE_RTOL = 2e-6
# The LSE sums probabilities rounded to e4m3 (3 mantissa bits: each within 2**-4 of its value,
# the sum too), so it lies within log(1 + 2**-4) of the exact one's.
E4M3_LSE_ATOL = math.log1p(2**-4)


def k8v8_pools(
    case: PagedCase, *, per_block: bool, keys_major: bool = True, seed: int = 0
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(k_codes, v_codes, k_scale, v_channel_scale)`` of the case's pools: K's int8 codes per
    row, V's e4m3 codes of channel scales (frozen: the written values' amax per (head,
    channel) times a random factor in [1, 4]; per block: each block's own, so blocks differ by
    up to 2**6); unwritten slots poisoned."""
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache = case.k_cache.cpu(), case.v_cache.cpu()
    written = ~torch.isnan(k_cache[..., 0])
    k_codes, k_scale = quantize(k_cache.nan_to_num(0.0), torch.int8)
    k_codes[~written] = -128
    k_scale[~written] = float("nan")
    blocks, _, heads, dim = v_cache.shape
    values = v_cache.nan_to_num(0.0).abs()
    if per_block:
        amax = values.amax(dim=1).clamp_min(1e-3)
        amax = amax * torch.exp2(torch.randint(-3, 4, (blocks, 1, 1), generator=gen).float())
        scales = amax * torch.empty(amax.shape).uniform_(1, 4, generator=gen) / 448
    else:
        amax = values.flatten(0, 1).amax(dim=0).clamp_min(1e-3)
        shared = amax * torch.empty(amax.shape).uniform_(1, 4, generator=gen) / 448
        scales = shared[None].expand(blocks, heads, dim)
    ratio = v_cache.nan_to_num(0.0) / scales[:, None]
    v_codes = ratio.clamp(-448, 448).to(torch.float8_e4m3fn)
    v_codes.view(torch.uint8)[~written] = E4M3_NAN
    v_codes = v_codes.to(DEVICE)
    if keys_major:
        # On the device: a padded keys-major copy moved there loses its padding (Tensor.to
        # packs a tensor that is not dense), and its rows their 16-byte alignment.
        v_codes = pool_layout.keys_major(v_codes)
    if not per_block:
        scales = scales[:1].to(DEVICE).expand(blocks, heads, dim)
    return k_codes.to(DEVICE), v_codes, k_scale.to(DEVICE), scales.to(DEVICE)


@pytest.mark.parametrize("block_size", [24, 520])
def test_the_pools_are_keys_major_and_aligned_on_the_device(monkeypatch, block_size: int):
    # On a GPU the pools are made there: V made keys-major on the CPU and moved lost its
    # padding and alignment at blocks of 24 or 520 keys, so no k8v8 launch-table row (TMA over
    # keys-major V) took the call. The meta device stands in for the GPU.
    case = make_paged_case(q_lens=[3], k_lens=[40], block_size=block_size, device="cpu")
    monkeypatch.setattr(sys.modules[__name__], "DEVICE", torch.device("meta"))
    v_codes = k8v8_pools(case, per_block=False)[1]
    assert v_codes.device.type == "meta" and pool_layout.keys_aligned(v_codes)


def dequantized(pools: tuple[Tensor, ...]) -> tuple[Tensor, Tensor]:
    """The float64 K and V the codes stand for (NaN where unwritten)."""
    k_codes, v_codes, k_scale, scales = (t.cpu() for t in pools)
    k = k_codes.double() * k_scale.double()[..., None]
    k[k_codes == -128] = float("nan")
    v = v_codes.double() * scales.double()[:, None]
    return k, v


def oracle(case: PagedCase, pools: tuple, q: Tensor | None = None, **kwargs):
    k, v = dequantized(pools)
    q = (case.q if q is None else q).cpu().double()
    args = (q, k, v, case.block_table.cpu(), case.cu_seqlens_q.cpu(), case.seq_lens_k.cpu())
    masks = {
        name: value.cpu() if isinstance(value, Tensor) else value for name, value in kwargs.items()
    }
    out = torch.empty(q.shape, dtype=torch.float64)
    return reference.paged_attention(*args, max_seqlen_q=case.max_seqlen_q, out=out, **masks)


def emulate(case: PagedCase, pools: tuple, **kwargs) -> Tensor:
    """Float64 k8v8 arithmetic: int8 query rows (``reference.quantize``'s rounding, the
    kernel's), exact int32 ``Q K^T``, probabilities ``exp(s - max) * 448`` rounded to e4m3
    (after the final row max), row sums of the rounded ones (the kernel's, by MMA), ``P V`` over
    V's codes times their channel scales (a block's, or the frozen one)."""
    q = dequantize(*quantize(case.q.cpu().double(), torch.int8))
    k, v = dequantized(pools)
    scale = 1.0 / math.sqrt(case.q.shape[2])
    mask_kwargs = {
        name: value.cpu() if isinstance(value, Tensor) else value for name, value in kwargs.items()
    }
    group = case.q.shape[1] // k.shape[2]
    out = torch.zeros(case.q.shape, dtype=torch.float64)
    starts = case.cu_seqlens_q.tolist()
    block_size = k.shape[1]
    for row, k_len in enumerate(case.seq_lens_k.tolist()):
        lo, hi = starts[row], starts[row + 1]
        if hi == lo or k_len == 0:
            continue
        blocks = case.block_table.cpu()[row, : math.ceil(k_len / block_size)].long()
        keys = k[blocks].flatten(0, 1)[:k_len].repeat_interleave(group, dim=1)
        values = v[blocks].flatten(0, 1)[:k_len].repeat_interleave(group, dim=1)
        gap, limits = mask_kwargs.get("key_gap"), mask_kwargs.get("key_limits")
        mask = reference.attention_mask(
            hi - lo,
            k_len,
            causal=mask_kwargs.get("causal", False),
            key_limits=None if limits is None else limits[lo:hi],
            key_gap=None if gap is None else [tuple(g) for g in gap[row].reshape(-1, 2).tolist()],
        )
        scores = torch.einsum("qhd,khd->hqk", q[lo:hi], keys.nan_to_num(0.0)) * scale
        scores = scores.masked_fill(~mask[None], float("-inf"))
        row_max = scores.amax(dim=-1, keepdim=True)
        row_max = torch.where(row_max == float("-inf"), 0.0, row_max)
        probs = torch.exp(scores - row_max) * 448
        codes = probs.float().to(torch.float8_e4m3fn).double()
        sums = codes.sum(dim=-1, keepdim=True)
        rows = torch.einsum("hqk,khd->qhd", codes, values.nan_to_num(0.0))
        out[lo:hi] = rows / torch.where(sums == 0, 1.0, sums).permute(1, 0, 2)
    return out


def check(
    case: PagedCase, pools: tuple, *, block_n: int | None, launch: dict | None = None, **kwargs
) -> None:
    """The kernel's output within ``MARGIN`` times the emulation's error of float64 attention,
    its LSE of the int8-rounded query rows (``launch``: more launcher keywords)."""
    k_codes, v_codes, k_scale, scales = pools
    args = (case.q, k_codes, v_codes, case.block_table, case.cu_seqlens_q, case.seq_lens_k)
    got, lse = kernels.paged_attention(
        *args,
        max_seqlen_q=case.max_seqlen_q,
        k_scale=k_scale,
        v_channel_scale=scales,
        out=nan_like(case.q),
        block_m=16,
        block_n=block_n,
        return_lse=True,
        **(launch or {}),
        **kwargs,
    )
    assert not torch.isnan(got).any(), "kernel left NaN: an unwritten output or a poisoned read"
    want = oracle(case, pools, **kwargs)
    emulated = emulate(case, pools, **kwargs)
    size = max(1.0, want.abs().max().item())
    emulation_error = (emulated - want).abs().max().item()
    assert emulation_error > 10 * FP32_ATOL * size  # the roundings really happened
    error = (got.double().cpu() - want).abs().max().item()
    assert error <= MARGIN * emulation_error, f"{error:.3e} > {MARGIN} x {emulation_error:.3e}"
    # The LSE is of the scores the kernel used, those of the int8-rounded query rows, and of the
    # rounded probabilities it summed.
    q_rows = dequantize(*quantize(case.q.cpu(), torch.int8))
    want_lse = oracle(case, pools, q=q_rows, return_lse=True, **kwargs)[1]
    assert_lse_close(lse.cpu(), want_lse, E4M3_LSE_ATOL / max(1.0, want_lse.abs().max().item()))


def masked_case(
    block_size: int, block_n: int, table_order: str = "permuted", seed: int = 0, head_dim: int = 80
):
    """GQA 2, head_dim 80, a chunk starting mid-block (causal), per-row limits and a gap, a row
    with no queries: unmasked and masked tiles both run."""
    k_len = block_size + 2 * block_n + 9 if block_size > 64 else 4 * block_n + 9
    case = make_paged_case(
        q_lens=[7, 0, 3],
        k_lens=[k_len, 5, 2 * block_n + 5],
        block_size=block_size,
        num_heads=4,
        num_kv_heads=2,
        head_dim=head_dim,
        table_order=table_order,
        device=DEVICE,
        seed=seed,
    )
    key_limits = torch.arange(10, dtype=torch.int32) % 5 + k_len - 4
    key_gap = torch.tensor([[(block_n + 3, 2 * block_n + 1)], [(0, 0)], [(1, 2)]])
    kwargs = dict(
        causal=True, key_limits=key_limits.to(DEVICE), key_gap=key_gap.to(DEVICE, torch.int32)
    )
    return case, kwargs


@pytest.mark.parametrize(
    "block_size, block_n, table_order",
    [
        pytest.param(1, 32, "permuted", id="rows-B1-N32"),
        pytest.param(7, 32, "repeated", id="block_tiles-B7-N32-repeated"),
        pytest.param(24, 32, "permuted", id="block_tiles-B24-N32"),
        pytest.param(1560, 64, "permuted", id="block_tiles-B1560-N64"),
        pytest.param(1560, 128, "permuted", id="block_tiles-B1560-N128"),
    ],
)
def test_k8v8_frozen_scales(block_size: int, block_n: int, table_order: str) -> None:
    case, kwargs = masked_case(block_size, block_n, table_order)
    check(case, k8v8_pools(case, per_block=False), block_n=block_n, **kwargs)


@pytest.mark.parametrize(
    "block_size, block_n",
    [
        pytest.param(32, 32, id="B32-N32"),
        pytest.param(64, 64, id="B64-N64"),
        pytest.param(256, 128, id="B256-N128"),
    ],
)
def test_k8v8_per_block_scales(block_size: int, block_n: int) -> None:
    case, kwargs = masked_case(block_size, block_n, "repeated" if block_size == 64 else "permuted")
    check(case, k8v8_pools(case, per_block=True), block_n=block_n, **kwargs)


@pytest.mark.parametrize("per_block", [False, True], ids=["frozen", "per-block"])
def test_k8v8_descriptor_loop(monkeypatch: pytest.MonkeyPatch, per_block: bool) -> None:
    # K's scales keys-major: the TMA loop (descriptor loads of K's rows in the MMA's key order,
    # V's keys-major tile, K's scales), runs of 8 and 2 unmasked tiles (K's a tile ahead of V's)
    # behind masked tails; head_dim a power of two, as a descriptor's.
    case = make_paged_case(
        q_lens=[7, 3], k_lens=[1100, 300], block_size=256, num_heads=4, num_kv_heads=2,
        head_dim=64, device=DEVICE,
    )  # fmt: skip
    kwargs: dict = {}
    k_codes, v_codes, k_scale, scales = k8v8_pools(case, per_block=per_block)
    pools = (k_codes, v_codes, pool_layout.keys_major(k_scale), scales)
    launches = record_launches(monkeypatch, launcher, "_paged_attention_kernel")
    check(case, pools, block_n=128, launch=dict(variant="tma"), **kwargs)
    assert [flags["TMA"] for flags in launches] == [True]


def p_v_behind_case(block_size: int, head_dim: int) -> PagedCase:
    """The P-V-behind tests' case (k8v8's and k8v16's): runs of 6, 1, 2 and 0 whole 64-key
    tiles, each behind a masked tail, GQA 2, the block table as a strided view (the loop
    reads its ids through the table's strides)."""
    case = make_paged_case(
        q_lens=[7, 3, 4, 2], k_lens=[6 * 64 + 3, 64 + 9, 128, 20], block_size=block_size,
        num_heads=4, num_kv_heads=2, head_dim=head_dim, device=DEVICE,
    )  # fmt: skip
    return dataclasses.replace(case, block_table=column(case.block_table, 0))


@pytest.mark.parametrize(
    "block_size, head_dim, variant, keys_major",
    [
        pytest.param(256, 64, "tma", True, id="tma-B256"),
        pytest.param(64, 80, None, True, id="pointer-B64-hd80"),
        pytest.param(128, 80, None, False, id="slot-major-v-B128"),
        pytest.param(16, 128, None, True, id="rows-B16"),
        pytest.param(32, 80, None, True, id="rows-B32-hd80"),
        pytest.param(24, 128, None, True, id="pieces-B24"),
        pytest.param(48, 80, None, True, id="pieces-B48-hd80"),
    ],
)
def test_k8v8_p_v_under_the_next_softmax(
    monkeypatch: pytest.MonkeyPatch, block_size: int, head_dim: int, variant, keys_major: bool
) -> None:
    # 64-key tiles, inside a block or gathered from blocks (rows) or block pieces (48 = 32 +
    # 16, 24 = 16 + 8; block 7's pieces of 4, 2, 1 keep the plain loop): each tile's P V MMA
    # issued an iteration after its softmax and added into acc the iteration after that
    # (_attend_pv_behind), V's rows from the ids of the tile before (a tile of several blocks
    # reads V of the blocks K read). Runs of 6, 1, 2 and 0 unmasked tiles over permuted
    # blocks, each behind a masked tail, so a missing first or last P V, a doubled softmax
    # step or V a tile off shows.
    case = p_v_behind_case(block_size, head_dim)
    k_codes, v_codes, k_scale, scales = k8v8_pools(case, per_block=False, keys_major=keys_major)
    if keys_major:
        k_scale = pool_layout.keys_major(k_scale)
    launches = record_launches(monkeypatch, launcher, "_paged_attention_kernel")
    launch = {} if variant is None else dict(variant=variant)
    check(case, (k_codes, v_codes, k_scale, scales), block_n=64, launch=launch)
    assert [(flags["BLOCK_N"], flags["TMA"]) for flags in launches] == [(64, variant == "tma")]


def test_k8v8_tiles_across_block_pieces() -> None:
    # Block 24 at 128-key tiles: pieces of 16 and 8 slots, each piece's unmasked tiles
    # gathered from 8 or 16 blocks (_attend_tiles' unmasked loop, not the scores ahead).
    case = make_paged_case(
        q_lens=[5, 3], k_lens=[900, 300], block_size=24, num_heads=4, num_kv_heads=2,
        head_dim=80, device=DEVICE,
    )  # fmt: skip
    check(case, k8v8_pools(case, per_block=False), block_n=128)


def test_k8v8_slot_major_v_and_default_tiles() -> None:
    # V slot-major (transposed in the loop), the interpreter's default tiles, no masks.
    case = make_paged_case(
        q_lens=[5, 9], k_lens=[70, 131], block_size=24, num_heads=2, num_kv_heads=1,
        head_dim=80, device=DEVICE,
    )  # fmt: skip
    check(case, k8v8_pools(case, per_block=False, keys_major=False), block_n=None)


def test_per_block_scales_need_tiles_inside_a_block() -> None:
    case = make_paged_case(q_lens=[3], k_lens=[40], block_size=24, device=DEVICE)
    k_codes, v_codes, k_scale, scales = k8v8_pools(case, per_block=True)
    args = (case.q, k_codes, v_codes, case.block_table, case.cu_seqlens_q, case.seq_lens_k)
    with pytest.raises(ValueError, match="frozen v_channel_scale"):
        kernels.paged_attention(
            *args, max_seqlen_q=3, k_scale=k_scale, v_channel_scale=scales.contiguous()
        )
    tiles = choose_tiles(
        block_size=96, head_dim=64, max_seqlen_q=3, dtype=torch.float32, k8v8=True,
        v_block_scales=True,
    )  # fmt: skip
    assert tiles["BLOCK_N"] == 32 and tiles["KV_PATH"] == "contiguous"


@pytest.mark.parametrize(
    "change, error, match",
    [
        ("v_scale", ValueError, "replaces v_scale"),
        ("int8_v", TypeError, "float8_e4m3fn v_cache"),
        ("no_k_scale", ValueError, "needs k_scale"),
        ("shape", ValueError, "v_channel_scale must have shape"),
    ],
)
def test_k8v8_attention_refuses_what_the_write_refuses(change: str, error: type, match: str):
    # The pools' checks are the write's (value_channels.check_format), named as attention's.
    case = make_paged_case(q_lens=[3], k_lens=[40], block_size=24, device=DEVICE)
    k_codes, v_codes, k_scale, scales = k8v8_pools(case, per_block=False)
    kwargs = dict(k_scale=k_scale, v_channel_scale=scales)
    if change == "v_scale":
        kwargs["v_scale"] = k_scale.clone()
    elif change == "int8_v":
        v_codes = torch.zeros(v_codes.shape, dtype=torch.int8, device=DEVICE)
    elif change == "no_k_scale":
        del kwargs["k_scale"]
    elif change == "shape":
        kwargs["v_channel_scale"] = scales[..., :16]
    args = (case.q, k_codes, v_codes, case.block_table, case.cu_seqlens_q, case.seq_lens_k)
    with pytest.raises(error, match=match):
        kernels.paged_attention(*args, max_seqlen_q=3, **kwargs)


def test_tiny_v_scales_on_the_keys_that_matter() -> None:
    # Issue 46 item 3: 1024 keys, the first 64 with V x 1e-6 and K aligned with q, so the
    # softmax's mass sits on them. Per-block V scales give those keys their own scale: every
    # row right (the deleted FP8-MMA's probability unit zeroed 13 of 16 rows).
    heads, dim, keys, block = 1, 64, 1024, 64
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(16, heads, dim, generator=gen)
    k = torch.randn(keys, heads, dim, generator=gen) * 0.1
    k[:64] = q[:1].expand(64, heads, dim) * 0.5 + k[:64] * 0.1
    v = torch.randn(keys, heads, dim, generator=gen)
    v[:64] *= 1e-6
    k_pool = torch.empty(keys // block, block, heads, dim).copy_(k.reshape(-1, block, heads, dim))
    v_pool = v.reshape(-1, block, heads, dim)
    case = PagedCase(
        q=q.to(DEVICE),
        k_cache=k_pool.to(DEVICE),
        v_cache=v_pool.to(DEVICE),
        block_table=torch.arange(keys // block, dtype=torch.int32)[None].to(DEVICE),
        cu_seqlens_q=torch.tensor([0, 16], dtype=torch.int32, device=DEVICE),
        seq_lens_k=torch.tensor([keys], dtype=torch.int32, device=DEVICE),
        max_seqlen_q=16,
    )
    pools = k8v8_pools(case, per_block=True)
    k_codes, v_codes, k_scale, scales = pools
    args = (case.q, k_codes, v_codes, case.block_table, case.cu_seqlens_q, case.seq_lens_k)
    got = kernels.paged_attention(
        *args, max_seqlen_q=16, k_scale=k_scale, v_channel_scale=scales, block_n=64
    )
    want = oracle(case, pools)
    assert (got.abs().amax(dim=-1) > 0).all(), "rows zeroed"
    rel = ((got.double().cpu() - want).abs().sum() / want.abs().sum()).item()
    assert rel < 0.05, f"rel L1 {rel:.3f}"


@pytest.mark.parametrize("make_view", [column_major, lambda t: column(t, 0)], ids=["cm", "step"])
@pytest.mark.parametrize("block_size", [7, 24], ids=lambda b: f"B{b}")
def test_k8v8_reads_a_strided_block_table(block_size: int, make_view) -> None:
    # Pieces under 16 keys (7 = 4 + 2 + 1, 24's 8): the unmasked loops take each tile's block
    # ids in the 8-bit MMA's key order, read through the table's own strides.
    case, kwargs = masked_case(block_size, 32)
    k_codes, v_codes, k_scale, scales = k8v8_pools(case, per_block=False)
    args = (case.q, k_codes, v_codes, case.block_table, case.cu_seqlens_q, case.seq_lens_k)
    strided = (*args[:3], make_view(args[3]), *args[4:])
    launch = dict(
        max_seqlen_q=case.max_seqlen_q, k_scale=k_scale, v_channel_scale=scales, block_m=16,
        block_n=32, **kwargs,
    )  # fmt: skip
    want = kernels.paged_attention(*args, out=nan_like(case.q), **launch)
    got = kernels.paged_attention(*strided, out=nan_like(case.q), **launch)
    assert not torch.isnan(got).any()
    assert torch.equal(got, want)


def test_k8v8_descriptor_loop_tiles_starting_mid_run() -> None:
    # Block 40 at 32-key tiles: 32 keys by descriptor + 8 masked; at odd block ids a tile
    # starts mid-way through a run of 16 pool rows, which K's descriptor (rows in the 8-bit
    # MMA's key order) must start from.
    case = make_paged_case(
        q_lens=[5, 3], k_lens=[300, 130], block_size=40, num_heads=4, num_kv_heads=2,
        head_dim=64, device=DEVICE,
    )  # fmt: skip
    k_codes, v_codes, k_scale, scales = k8v8_pools(case, per_block=False)
    pools = (k_codes, v_codes, pool_layout.keys_major(k_scale), scales)
    check(case, pools, block_n=32, launch=dict(variant="tma"))


def test_k8v8_k_equalizer_is_q_times_the_factors() -> None:
    # K's channel factors fold into the query rows before they are rounded to int8
    # (query_codes), once: the same launch as over q times the factors, bit for bit.
    case, kwargs = masked_case(24, 32)
    k_codes, v_codes, k_scale, scales = k8v8_pools(case, per_block=False)
    gen = torch.Generator().manual_seed(5)
    factor = torch.exp2(torch.randint(0, 4, (2, case.q.shape[2]), generator=gen).float())
    factor = factor.to(DEVICE)
    launch = dict(
        max_seqlen_q=case.max_seqlen_q, k_scale=k_scale, v_channel_scale=scales, block_m=16,
        block_n=32, **kwargs,
    )  # fmt: skip
    tail = (case.block_table, case.cu_seqlens_q, case.seq_lens_k)
    got = kernels.paged_attention(case.q, k_codes, v_codes, *tail, k_equalizer=factor, **launch)
    q_times = case.q * factor.repeat_interleave(2, dim=0)  # exact: powers of two
    want = kernels.paged_attention(q_times, k_codes, v_codes, *tail, **launch)
    assert not torch.isnan(got).any()
    assert torch.equal(got, want)


@pytest.mark.parametrize("flag", [True, 1], ids=["true", "int"])
def test_fp8_mma_was_deleted_for_k8v8(flag: object) -> None:
    # Issue 45: FP8-MMA is gone (k8v8 is more accurate on every data kind and issues fewer
    # instructions); the old spelling names the new one and writes nothing.
    case = make_paged_case(q_lens=[4], k_lens=[40], block_size=8, device=DEVICE)
    k_codes, v_codes, k_scale, scales = k8v8_pools(case, per_block=False)
    args = (case.q, k_codes, v_codes, case.block_table, case.cu_seqlens_q, case.seq_lens_k)
    out = torch.full_like(case.q, 7.0)
    with pytest.raises(ValueError, match=r'fp8_mma was deleted.*kv_format="k8v8"'):
        kernels.paged_attention(
            *args, max_seqlen_q=4, k_scale=k_scale, v_channel_scale=scales, out=out,
            fp8_mma=flag,
        )  # fmt: skip
    assert torch.equal(out, torch.full_like(out, 7.0))


def midpoint_distance(x: Tensor) -> Tensor:
    """How far positive float64 ``x`` lies from the nearest e4m3 rounding midpoint, relative to
    ``x`` (spacing 2**(e - 3) in binade e, 2**-9 below the normal range)."""
    binade = torch.floor(torch.log2(x)).clamp_min(-6)
    spacing = torch.exp2(binade - 3)
    steps = x / spacing
    return (steps - torch.floor(steps) - 0.5).abs() * spacing / x


# The keys made 6x longer: the first 16, which the first tile attended holds at every launch
# (block 24's pieces of 16 and 8 run as two loops, a piece of 16 first).
FIRST_KEYS = 16


@pytest.mark.parametrize(
    "block, block_n, keys, per_block",
    [
        pytest.param(64, 64, 256, False, id="p-v-behind-frozen"),
        pytest.param(64, 64, 256, True, id="p-v-behind-per-block"),
        pytest.param(256, 128, 512, False, id="scores-ahead-frozen"),
        pytest.param(256, 128, 512 + 37, True, id="scores-ahead-per-block-masked-tail"),
        pytest.param(24, 128, 24 * 11, False, id="pieces-plain-loop"),
        pytest.param(24, 64, 24 * 11, False, id="pieces-p-v-behind"),
    ],
)
def test_k8v8_against_the_reference_emulation(
    block: int, block_n: int, keys: int, per_block: bool
) -> None:
    # reference.eight_bit_attention (written apart from the kernel) over the codes the
    # pools hold, in sequence order through a permuted table: int8 query rows per row, exact
    # int32 scores, P at 448 in e4m3, the rounded P summed as P V is (the kernel's MMA over a
    # column of ones), a flush every key tile (V's scales per block, the fast format, or
    # frozen), an exact accumulator (the interpreter's float32; a GPU's FP8 MMA truncates,
    # allowed for below). The first keys are 6x longer (FIRST_KEYS), so every row's maximum
    # lies in the first tile the kernel attends and its
    # running max is the final one: the emulation then rounds the same probabilities, and the
    # two agree to float32 accuracy (every 448 p lies 2e-6 or more, relative, from an e4m3
    # rounding midpoint, checked: the GPU's exp2.approx and float32 scores move it ~1e-6), where
    # an emulation with the unrounded normalizer misses by 0.4-0.8% of the output's size. So do
    # the LSEs, of the rounded probabilities' sums. Each k8v8 loop: P V under the next softmax
    # (inside a block, and gathered from block pieces), the scores a tile ahead (and a masked
    # tail), and the plain loop of tiles gathered from block pieces (block 24).
    from paged_video.reference import eight_bit_attention as eight_bit

    heads, kv_heads, dim = 4, 2, 80
    case = make_paged_case(
        q_lens=[9], k_lens=[keys], block_size=block, num_heads=heads, num_kv_heads=kv_heads,
        head_dim=dim, device=DEVICE, seed=5,
    )  # fmt: skip
    first = case.block_table[0, 0].item()
    case.k_cache[first, :FIRST_KEYS] *= 6
    pools = k8v8_pools(case, per_block=per_block)
    k_codes, v_codes, k_scale, scales = pools
    args = (case.q, k_codes, v_codes, case.block_table, case.cu_seqlens_q, case.seq_lens_k)
    got, lse = kernels.paged_attention(
        *args, max_seqlen_q=9, k_scale=k_scale, v_channel_scale=scales, block_n=block_n,
        out=nan_like(case.q), return_lse=True,
    )  # fmt: skip
    fmt = dataclasses.replace(
        eight_bit.FAST_FORMAT, v_scales="block" if per_block else "frozen",
        v_keys_per_scale=block if per_block else 64, tile_keys=block_n, acc_bits=None,
    )  # fmt: skip
    blocks = case.block_table[0, : -(-keys // block)].long().cpu()
    in_order = lambda pool: pool.cpu()[blocks].flatten(0, 1)[:keys]
    queries = eight_bit.quantize_queries(case.q.cpu(), fmt)
    key_codes = eight_bit.Codes(in_order(k_codes), in_order(k_scale))
    value_scale = scales.cpu()[blocks] if per_block else scales.cpu()[0]
    values = eight_bit.Codes(in_order(v_codes), value_scale)
    want = eight_bit.attend_codes(queries, key_codes, values, fmt)
    # Every row's maximum is in the first tile (the premise of the float32 agreement).
    q_rows = queries.codes.double() * queries.scale.double()[..., None]
    k_rows = key_codes.codes.double() * key_codes.scale.double()[..., None]
    scores = torch.einsum("qhd,khd->hqk", q_rows, k_rows.repeat_interleave(2, dim=1))
    assert (scores.argmax(dim=-1) < FIRST_KEYS).all()
    size = want.abs().max().item()
    limit = 1e-5 * size
    if ON_GPU:
        # Hopper's FP8 MMA keeps ~13 mantissa bits within a 64-key tile (P V): the emulation's
        # 13-bit model moves this output by 1.5e-4 (frozen) and 1.1e-4 (per block) of its
        # size, 10-15x the float32 bound; the hardware's truncation order is not the model's,
        # so the kernel is held within twice the model's shift of the exact accumulator.
        acc13 = dataclasses.replace(fmt, acc_bits=eight_bit.FP8_MMA_ACC_BITS)
        truncated = eight_bit.attend_codes(queries, key_codes, values, acc13)
        limit += MARGIN * (truncated - want).abs().max().item()
    error = (got.double().cpu() - want).abs().max().item()
    assert error <= limit, f"{error:.3e} > {limit:.3e}"
    # The LSE of the rounded probabilities: exp(s - max) * 448 rounded to e4m3 through float32.
    scores = scores / math.sqrt(dim)
    row_max = scores.amax(dim=-1, keepdim=True)
    weights = torch.exp(scores - row_max) * 448
    assert midpoint_distance(weights).min() > 2e-6  # the premise of the agreement above
    rounded = weights.float().to(torch.float8_e4m3fn).double()
    want_lse = (row_max + torch.log(rounded.sum(dim=-1, keepdim=True) / 448)).squeeze(-1).T
    lse_limit = 2e-6 * max(1.0, want_lse.abs().max().item())
    if ON_GPU:
        # The MMA sums a tile's rounded probabilities in ~13 bits, truncated at each k-step of
        # 32 keys (each within 2**-13 of the running sum).
        steps = block_n // eight_bit.MMA_K
        lse_limit += math.log1p(steps * 2**-eight_bit.FP8_MMA_ACC_BITS)
    lse_error = (lse.double().cpu() - want_lse).abs().max().item()
    assert lse_error <= lse_limit, f"LSE {lse_error:.3e} > {lse_limit:.3e}"

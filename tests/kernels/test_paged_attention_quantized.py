"""kernels.paged_attention on quantized caches (int8 codes, a float32 scale per slot and KV
head) against the float64 oracle that dequantizes the same codes.

The oracle reads the codes the kernel reads, so the quantization error is not in the tolerance:
the dequantizing mode is held to the float32 tolerance of the unquantized tests. Every slot the
block tables do not point at holds the never-written int8 code -128, and a
NaN scale, so a kernel that reads one slot too many, or one scale too many, fails.
"""

from __future__ import annotations

import importlib

import pytest
import torch
import triton
import triton.language as tl
from torch import Tensor

from paged_video import kernels, reference
from paged_video.kernels import _runtime, pool_layout
from paged_video.kernels._quantize_jit import to_e4m3
from paged_video.kernels.paged_attention import kv_path
from paged_video.reference.quantize import quantize
from tests.helpers import DEVICE, ON_GPU, nan_like, record_launches
from tests.kernels.paged_case import PagedCase, assert_lse_close, make_paged_case
from tests.kernels.test_strided_index import column

launcher = importlib.import_module("paged_video.kernels.paged_attention")

# The pools with a scale per slot (the e4m3 one was deleted, issue 45: test_rejects' e4m3-pool).
FORMATS = [pytest.param(torch.int8, id="int8")]
# The unquantized tests' float32 tolerance (ieee dots), relative to the output's magnitude: the
# scales below spread the dequantized values over two decades.
FP32_ATOL = 2e-5
# The LSE's tolerance relative to its magnitude (the scores are of the same dequantized keys).
LSE_RTOL = 2e-6


def quantize_case(
    case: PagedCase, dtype: torch.dtype, seed: int = 0, spread: float = 3.0
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(k_codes, v_codes, k_scale, v_scale)`` of the case's pools; unwritten slots poisoned.

    Scales are multiplied by random factors in [2**-spread, 2**spread] after quantizing (the
    oracle reads the same codes and scales), so the K and V scale columns differ from key to key.
    """
    gen = torch.Generator().manual_seed(seed)
    out = []
    for cache in (case.k_cache, case.v_cache):
        cache = cache.cpu()
        written = ~torch.isnan(cache[..., 0])
        codes, scale = quantize(cache.nan_to_num(0.0), dtype)
        scale = scale * torch.exp2(
            torch.empty(scale.shape).uniform_(-spread, spread, generator=gen)
        )
        codes.view(torch.int8)[~written] = -128  # int8's never-written code
        scale[~written] = float("nan")
        out.append((codes.to(case.q.device), scale.to(case.q.device)))
    (k_codes, k_scale), (v_codes, v_scale) = out
    return k_codes, v_codes, k_scale, v_scale


def quantized_args(
    case: PagedCase, dtype: torch.dtype, seed: int = 0, spread: float = 3.0
) -> tuple[tuple, dict]:
    k_codes, v_codes, k_scale, v_scale = quantize_case(case, dtype, seed, spread)
    args = (case.q, k_codes, v_codes, case.block_table, case.cu_seqlens_q, case.seq_lens_k)
    return args, {"k_scale": k_scale, "v_scale": v_scale, "max_seqlen_q": case.max_seqlen_q}


def oracle(args: tuple, scales: dict, *, return_lse: bool = False, **kwargs) -> Tensor:
    q = args[0]
    out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    kwargs = {k: v for k, v in kwargs.items() if k in ("causal", "key_limits", "key_gap")}
    return reference.paged_attention(*args, **scales, out=out, return_lse=return_lse, **kwargs)


def run_and_compare(case: PagedCase, dtype: torch.dtype, **kwargs) -> None:
    """Output and LSE against the oracle's."""
    args, scales = quantized_args(case, dtype)
    out = nan_like(case.q)
    got, lse = kernels.paged_attention(*args, **scales, out=out, return_lse=True, **kwargs)
    assert got is out
    want, want_lse = oracle(args, scales, return_lse=True, **kwargs)
    assert_lse_close(lse, want_lse, LSE_RTOL)
    assert not torch.isnan(got).any(), "kernel left NaN: an unwritten output or a poisoned read"
    error = (got.double() - want).abs().max().item()
    limit = FP32_ATOL * max(1.0, want.abs().max().item())
    assert error <= limit, f"max error {error:.3e} > {limit:.3e}"


@pytest.mark.parametrize("dtype", FORMATS)
@pytest.mark.parametrize("block_size", [1, 7, 24, 1560], ids=lambda b: f"B{b}")
def test_any_block_size(dtype: torch.dtype, block_size: int) -> None:
    # A single key, a chunk over several blocks, a row with no queries, head_dim 80, GQA 2.
    long = 2 * block_size + 5 if block_size == 1560 else 4 * block_size + 30
    case = make_paged_case(
        q_lens=[3, 20, 0, 9],
        k_lens=[1, long, 9, block_size + 3],
        block_size=block_size,
        head_dim=80,
        device=DEVICE,
    )
    run_and_compare(case, dtype)


@pytest.mark.parametrize("dtype", FORMATS)
@pytest.mark.parametrize("group", [1, 2, 5])
@pytest.mark.parametrize("head_dim", [80, 128])
def test_gqa_and_head_dims(dtype: torch.dtype, group: int, head_dim: int) -> None:
    case = make_paged_case(
        q_lens=[7, 12],
        k_lens=[40, 61],
        block_size=16,
        num_heads=2 * group,
        num_kv_heads=2,
        head_dim=head_dim,
        device=DEVICE,
    )
    run_and_compare(case, dtype)


@pytest.mark.parametrize("dtype", FORMATS)
@pytest.mark.parametrize("table_order", ["permuted", "repeated"])
def test_table_orders(dtype: torch.dtype, table_order: str) -> None:
    case = make_paged_case(
        q_lens=[9, 21], k_lens=[50, 33], block_size=7, table_order=table_order, device=DEVICE
    )
    run_and_compare(case, dtype)


@pytest.mark.parametrize("block_n", [16, 64], ids=lambda n: f"N{n}")
def test_strided_scale_pools(block_n: int) -> None:
    # Scale pools stored head-major, K's and V's with different strides: the kernel must use
    # each scale pool's own strides (block 31 in five pieces at either tile).
    case = make_paged_case(q_lens=[9, 4], k_lens=[70, 17], block_size=31, device=DEVICE)
    args, scales = quantized_args(case, torch.int8)
    k_scale = scales["k_scale"].transpose(1, 2).contiguous().transpose(1, 2)
    v_scale = scales["v_scale"].permute(2, 0, 1).contiguous().permute(1, 2, 0)
    assert k_scale.stride() != v_scale.stride() != scales["v_scale"].stride()
    strided = {**scales, "k_scale": k_scale, "v_scale": v_scale}
    got = kernels.paged_attention(
        *args, **strided, out=nan_like(case.q), block_m=16, block_n=block_n
    )
    want = oracle(args, scales)
    assert (got.double() - want).abs().max() <= FP32_ATOL * max(1.0, want.abs().max().item())


@pytest.mark.parametrize("dtype", FORMATS)
def test_fp16_queries(dtype: torch.dtype) -> None:
    # Output in q's dtype; on a GPU the codes convert to fp16 for fp16 MMAs.
    case = make_paged_case(q_lens=[9, 4], k_lens=[50, 17], block_size=24, device=DEVICE)
    args, scales = quantized_args(case, dtype)
    q = case.q.half()
    got = kernels.paged_attention(q, *args[1:], **scales, out=nan_like(q))
    want = oracle((q, *args[1:]), scales)
    assert got.dtype == torch.float16
    error = (got.double() - want).abs().max().item()
    assert error <= 1e-3 * max(1.0, want.abs().max().item()), error


@pytest.mark.parametrize("dtype", FORMATS)
def test_bf16_queries_score_through_float16_rows(dtype: torch.dtype) -> None:
    # int8 K under a bf16 q: each query row is scaled into float16 by a power of two (its
    # largest magnitude into [2**13, 2**14)) and the factor leaves the softmax scale. Rows from
    # 2**-120 to 2**60 and a zero row: without the factor they overflow float16 or vanish in it.
    case = make_paged_case(
        q_lens=[6, 4], k_lens=[50, 17], block_size=24, head_dim=80, device=DEVICE
    )
    args, scales = quantized_args(case, dtype)
    magnitudes = torch.exp2(torch.tensor([-120.0, -60.0, -20.0, 0.0, 20.0, 60.0, 0.0]))
    magnitudes[-1] = 0.0
    q = case.q.clone()
    q[: len(magnitudes)] *= magnitudes.to(q.device)[:, None, None]
    q = q.bfloat16()
    # The index tensors as strided views, junk between their values.
    table, cu_seqlens_q, seq_lens_k = args[3:]
    views = (column(table, 0), column(cu_seqlens_q, 4), column(seq_lens_k, 1))
    got, lse = kernels.paged_attention(
        q, *args[1:3], *views, **scales, out=nan_like(q), return_lse=True
    )
    want, want_lse = oracle((q, *args[1:]), scales, return_lse=True)
    # The scores are float32 sums of exact products, as with a float32 q.
    assert_lse_close(lse, want_lse, LSE_RTOL)
    # The output is rounded to bf16 (which the interpreter rounds less well: 1.5 ulp seen).
    rows = want.abs().amax(dim=-1, keepdim=True).clamp(min=1.0)
    error = ((got.double() - want).abs() / rows).max().item()
    assert error <= 1e-2, error


# (block_size, block_n, format) of each key path with small tiles: many tiles, so the unmasked
# loop, the masked head and tail and the prefetch past the last tile all run.
PATHS = [
    pytest.param(16, 16, torch.int8, id="contiguous-B16-N16-int8"),
    pytest.param(24, 16, torch.int8, id="block_tiles-B24-N16-int8"),
    pytest.param(31, 16, torch.int8, id="block_tiles-B31-N16-int8"),
    pytest.param(511, 256, torch.int8, id="two_blocks-B511-N256-int8"),
    pytest.param(1560, 64, torch.int8, id="block_tiles-B1560-N64-int8"),
    pytest.param(16, 64, torch.int8, id="rows-B16-N64-int8"),
    pytest.param(7, 16, torch.int8, id="block_tiles-B7-N16-int8"),
    pytest.param(31, 32, torch.int8, id="block_tiles-B31-N32-int8"),
    pytest.param(511, 512, torch.int8, id="rows-B511-N512-int8"),
    pytest.param(1, 16, torch.int8, id="rows-B1-N16-int8"),
]


@pytest.mark.parametrize("block_size, block_n, dtype", PATHS)
def test_key_paths_causal_limits_and_gaps(
    dtype: torch.dtype, block_size: int, block_n: int
) -> None:
    # The queries are the last keys of a chunk that starts mid-block (causal); per-row limits
    # and two gaps put masked tiles between unmasked ones.
    # Block 1560 with 64-key tiles: tile 1536 spans blocks 0 and 1.
    k_len = block_size + 2 * block_n + 9 if block_size > 64 else 6 * block_n + 9
    case = make_paged_case(
        q_lens=[21, 3],
        k_lens=[k_len, 2 * block_n + 5],
        block_size=block_size,
        num_heads=4,
        num_kv_heads=2,
        device=DEVICE,
    )
    gen = torch.Generator().manual_seed(block_size + block_n)
    key_limits = torch.randint(k_len // 2, k_len + 1, (24,), generator=gen, dtype=torch.int32)
    # The first gap covers whole tiles (at block 1560 all but the last few, which are skipped),
    # the second starts and ends inside one tile.
    wide = (block_n + 3, max(3 * block_n + 1, k_len - 4 * block_n))
    narrow = (k_len - 2 * block_n + 2, k_len - 2 * block_n + 9)
    key_gap = torch.tensor([[wide, narrow], [(1, 2), (0, 0)]], dtype=torch.int32)
    tiles = kernels.choose_tiles(
        block_size=block_size, head_dim=64, max_seqlen_q=21, dtype=torch.float32, block_n=block_n
    )
    assert tiles["KV_PATH"] == kv_path(block_size, block_n)
    run_and_compare(
        case,
        dtype,
        causal=True,
        key_limits=key_limits.to(DEVICE),
        key_gap=key_gap.to(DEVICE),
        block_m=16,
        block_n=block_n,
    )


@pytest.fixture
def no_interpreter(monkeypatch):
    monkeypatch.setattr(_runtime, "interpreter_active", lambda: False)
    assert _runtime.use_torch_path(torch.zeros(1))


@pytest.mark.parametrize("dtype", FORMATS)
def test_torch_path(no_interpreter, dtype: torch.dtype) -> None:
    case = make_paged_case(
        q_lens=[5, 0, 12], k_lens=[30, 4, 12], block_size=7, num_heads=6, head_dim=80
    )
    key_limits = torch.arange(17, dtype=torch.int32) % 9 + 3
    key_gap = torch.tensor([[2, 11], [0, 0], [1, 3]], dtype=torch.int32)
    run_and_compare(case, dtype, causal=True, key_limits=key_limits, key_gap=key_gap)


def test_unquantized_pools_still_need_q_dtype() -> None:
    case = make_paged_case(q_lens=[4], k_lens=[9], block_size=8)
    with pytest.raises(TypeError, match="k_cache"):
        kernels.paged_attention(
            case.q, case.k_cache.half(), case.v_cache.half(), *case.args()[3:], max_seqlen_q=4
        )


def _bad_calls():
    def swap(name, value):
        return lambda a, s: ({**a, name: value(a, s)}, s)

    def scale(name, value):
        return lambda a, s: (a, {**s, name: value(a, s)})

    return [
        pytest.param(scale("k_scale", lambda a, s: None), ValueError, "k_scale", id="no-k-scale"),
        pytest.param(scale("v_scale", lambda a, s: None), ValueError, "v_scale", id="no-v-scale"),
        pytest.param(
            scale("k_scale", lambda a, s: s["k_scale"].double()),
            TypeError,
            "k_scale",
            id="k-scale-dtype",
        ),
        pytest.param(
            scale("v_scale", lambda a, s: s["v_scale"][:, :-1]),
            ValueError,
            "v_scale",
            id="v-scale-shape",
        ),
        pytest.param(
            scale("k_scale", lambda a, s: s["k_scale"].numpy()),
            TypeError,
            "k_scale",
            id="k-scale-not-tensor",
        ),
        pytest.param(
            swap("v_cache", lambda a, s: a["v_cache"].view(torch.uint8)),
            TypeError,
            "v_cache",
            id="mixed-formats",
        ),
        pytest.param(  # the deleted e4m3 pool (issue 45)
            lambda a, s: (
                {
                    **a,
                    "k_cache": a["k_cache"].view(torch.float8_e4m3fn),
                    "v_cache": a["v_cache"].view(torch.float8_e4m3fn),
                },
                s,
            ),
            ValueError,
            'k_cache=torch.float8_e4m3fn .*deleted.*"k8v16".*"k8v8"',
            id="e4m3-pool",
        ),
        pytest.param(
            swap("q", lambda a, s: a["q"].to(torch.float8_e4m3fn)), TypeError, "q", id="q-fp8"
        ),
        pytest.param(
            lambda a, s: (
                {**a, "k_cache": a["k_cache"].float(), "v_cache": a["v_cache"].float()},
                s,
            ),
            ValueError,
            "k_scale is only for quantized",
            id="scales-for-float-pools",
        ),
    ]


@pytest.mark.parametrize("change, error, word", _bad_calls())
def test_rejects(change, error, word) -> None:
    case = make_paged_case(q_lens=[4, 6], k_lens=[9, 20], block_size=8)
    names = ("q", "k_cache", "v_cache", "block_table", "cu_seqlens_q", "seq_lens_k")
    args, scales = quantized_args(case, torch.int8)
    args, scales = change(dict(zip(names, args, strict=True)), scales)
    sentinel = torch.full_like(case.q, 7.0)
    with pytest.raises(error, match=word):
        positional = [args.pop(name) for name in names]
        kernels.paged_attention(*positional, **args, **scales, out=sentinel)
    assert torch.equal(sentinel, torch.full_like(sentinel, 7.0)), "a rejected call wrote out"


def masked_case(block_size: int, block_n: int, head_dim: int = 80) -> tuple[PagedCase, dict]:
    """Two sequences (GQA, head_dim 80 unless told) over several key tiles (a large block and
    two tiles past it), the queries at the keys' end, with causal, per-row limits and a wide
    gap: whole tiles before, between and after masked ones. Returns the case and the masks'
    keywords."""
    k_len = block_size + 2 * block_n + 9 if block_size > 64 else 6 * block_n + 9
    case = make_paged_case(
        q_lens=[12, 3],
        k_lens=[k_len, 2 * block_n + 5],
        block_size=block_size,
        num_heads=4,
        num_kv_heads=2,
        head_dim=head_dim,
        device=DEVICE,
    )
    key_limits = torch.arange(15, dtype=torch.int32) % 7 + k_len - 6
    wide = (block_n + 3, max(3 * block_n + 1, k_len - 4 * block_n))
    key_gap = torch.tensor([[wide], [(1, 2)]], dtype=torch.int32)
    return case, dict(causal=True, key_limits=key_limits.to(DEVICE), key_gap=key_gap.to(DEVICE))


@triton.jit
def _round_kernel(x_ptr, out_ptr, N: tl.constexpr, INTERPRETED: tl.constexpr):
    offs = tl.arange(0, N)
    codes = to_e4m3(tl.load(x_ptr + offs), INTERPRETED)
    tl.store(out_ptr + offs, codes.to(tl.float32))


def test_e4m3_rounding_is_nearest_even() -> None:
    # Carries into the next binade (31.2 -> 32), ties (17 -> 16, 19 -> 20), subnormals
    # (steps of 2**-9), saturation, zero and signs; plus random values over the whole range.
    special = [31.2, 17.0, 19.0, 2.0**-9 * 2.5, 2.0**-9 * 3.5, 2.0**-7 * 0.3, 448.0, 460.0]
    special += [1e6, 0.0, -31.2, -1e6, 240.0 + 7.99, 2.0**-6 * 1.0625]
    gen = torch.Generator().manual_seed(0)
    spread = torch.randn(256 - len(special), generator=gen) * torch.exp2(
        torch.randint(-12, 9, (256 - len(special),), generator=gen).float()
    )
    x = torch.cat([torch.tensor(special), spread]).to(DEVICE)
    out = torch.empty_like(x)
    _round_kernel[(1,)](x, out, N=256, INTERPRETED=_runtime.interpreter_active())
    want = x.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float()
    assert torch.equal(out, want), (x[out != want], out[out != want], want[out != want])


@pytest.mark.parametrize("dtype", FORMATS)
def test_offsets_past_int32(dtype: torch.dtype) -> None:
    # The used blocks sit past 2**31 codes into the pools: the launcher must fall back to 64-bit
    # row offsets for codes and scales alike (int32 offsets would wrap).
    block_size, heads, dim = 16, 1, 64
    per_block = block_size * heads * dim
    num_blocks = 2**31 // per_block + 8
    far = [num_blocks - 3, num_blocks - 1, 2]
    assert far[0] * per_block > 2**31
    # torch.empty does not touch memory; only the blocks written below become resident.
    codes = [torch.empty(num_blocks, block_size, heads, dim, dtype=dtype) for _ in "kv"]
    scales = [torch.empty(num_blocks, block_size, heads) for _ in "kv"]
    gen = torch.Generator().manual_seed(3)
    for block in far:
        for pool, scale in zip(codes, scales, strict=True):
            block_codes, block_scale = quantize(
                torch.randn(block_size, heads, dim, generator=gen), dtype
            )
            pool[block], scale[block] = block_codes, block_scale
    k_codes, v_codes, k_scale, v_scale = (t.to(DEVICE) for t in (*codes, *scales))
    q = torch.randn(10, 2, dim, generator=gen).to(DEVICE)
    table = torch.tensor([far + [0]], dtype=torch.int32, device=DEVICE)
    cu = torch.tensor([0, 10], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([40], dtype=torch.int32, device=DEVICE)
    args = (q, k_codes, v_codes, table, cu, lens)
    quantized = {"k_scale": k_scale, "v_scale": v_scale, "max_seqlen_q": 10}
    got = kernels.paged_attention(*args, **quantized)
    want = oracle(args, quantized)
    assert (got.double() - want).abs().max().item() < FP32_ATOL * want.abs().max().item() + 1e-6


# ---------------------------------------------------------------- keys-major V pools


def poisoned_keys_major(pool: Tensor) -> Tensor:
    """``kernels.keys_major(pool)``'s layout (codes or scales), its padding poisoned like an
    unwritten slot (int8 -128, NaN scale): a kernel that reads past a block's
    keys into the padding fails."""
    blocks, block_size, *rest = pool.shape
    row = pool_layout.padded_keys(block_size)
    storage = torch.empty(blocks, *rest, row, dtype=pool.dtype, device=pool.device)
    if pool.dtype == torch.float32:
        storage.fill_(float("nan"))
    else:
        storage.view(torch.int8).fill_(-128)
    view = storage[..., :block_size].permute(0, len(rest) + 1, *range(1, len(rest) + 1))
    view.copy_(pool)
    assert view.stride() == kernels.keys_major(pool).stride()
    return view


KV_MODES = [pytest.param(torch.int8, {}, id="int8")]


@pytest.mark.parametrize("dtype, mode", KV_MODES)
@pytest.mark.parametrize(
    "block_size, block_n",
    [
        pytest.param(32, 32, id="contiguous-B32-N32"),
        pytest.param(16, 64, id="rows-B16-N64"),  # runs of 16 keys per block
        pytest.param(24, 64, id="block_tiles-B24-N64"),  # pieces of 16 and 8 keys
        pytest.param(7, 32, id="block_tiles-B7-N32"),
        pytest.param(31, 32, id="rows-B31-N32"),  # runs too short for the 16-byte copies
        pytest.param(1, 32, id="rows-B1-N32"),  # one key per block: not keys-major
        pytest.param(520, 64, id="block_tiles-B520-N64"),
    ],
)
def test_keys_major_v_pool_attends_as_the_slot_major_one(
    dtype: torch.dtype, mode: dict, block_size: int, block_n: int
) -> None:
    # Same codes and scales, V and the scales stored keys-major (padded, padding poisoned): the
    # same output, through the masked tiles (limits, gaps, causal) and the unmasked ones.
    case, kwargs = masked_case(block_size, block_n)
    args, scales = quantized_args(case, dtype, spread=0.5)
    keys_major_args = (*args[:2], poisoned_keys_major(args[2]), *args[3:])
    keys_major_scales = {name: poisoned_keys_major(scales[name]) for name in ("k_scale", "v_scale")}
    launch = dict(**kwargs, **mode, block_m=16, block_n=block_n, return_lse=True)
    want, want_lse = kernels.paged_attention(*args, out=nan_like(case.q), **scales, **launch)
    got, lse = kernels.paged_attention(
        *keys_major_args, out=nan_like(case.q), **{**scales, **keys_major_scales}, **launch
    )
    assert not torch.isnan(got).any(), "a hidden key, or the padding, was read"
    if ON_GPU:  # the MMAs read V from another shared-memory layout: float32 apart
        torch.testing.assert_close(got, want, atol=FP32_ATOL * want.abs().max().item(), rtol=0)
        torch.testing.assert_close(lse, want_lse, atol=0, rtol=LSE_RTOL)
    else:  # the interpreter does the same arithmetic on the same values
        assert torch.equal(got, want) and torch.equal(lse, want_lse)
    # And the slot-major output is the oracle's (the dequantizing modes to float32 accuracy).
    if not mode:
        error = (want.double() - oracle(args, scales, **kwargs)).abs().max().item()
        assert error <= FP32_ATOL * max(1.0, want.abs().max().item())


def _layout(pool: Tensor, layout: str) -> Tensor:
    if layout == "padded":
        return kernels.keys_major(pool)
    if layout == "unpadded":  # rows of 24 keys: only 8-element aligned
        order = (0, *range(2, pool.dim()), 1)
        back = (0, pool.dim() - 1, *range(1, pool.dim() - 1))
        return pool.permute(*order).contiguous().permute(*back)
    return pool


@pytest.mark.parametrize(
    "layout, scales_layout, mode, flags",
    [
        pytest.param("padded", "padded", {}, (False, True), id="dequantizing-padded"),
        # Unaligned rows: the general loop, still right.
        pytest.param("unpadded", "unpadded", {}, (False, False), id="unpadded"),
        pytest.param("slots", "padded", {}, (False, True), id="scales-only"),
        # One scale pool keys-major is not enough: one flag tells Triton of both.
        pytest.param("slots", "k-only", {}, (False, False), id="k-scales-only"),
    ],
)
def test_keys_major_pools_are_read_as_stored_only_when_aligned(
    monkeypatch, layout: str, scales_layout: str, mode: dict, flags: tuple
) -> None:
    launches = record_launches(monkeypatch, launcher, "_paged_attention_kernel")
    case = make_paged_case(q_lens=[5], k_lens=[70], block_size=24, head_dim=64, device=DEVICE)
    args, scales = quantized_args(case, torch.int8, spread=0.5)
    v = _layout(args[2], layout)
    laid_out = {
        **scales,
        "k_scale": _layout(scales["k_scale"], scales_layout.replace("k-only", "padded")),
    }
    laid_out["v_scale"] = _layout(scales["v_scale"], scales_layout.replace("k-only", "slots"))
    assert pool_layout.is_keys_major(v) == (layout != "slots")
    got = kernels.paged_attention(*args[:2], v, *args[3:], **laid_out, **mode, block_n=32)
    seen = [(launch["V_KEYS_MAJOR"], launch["SCALES_KEYS_MAJOR"]) for launch in launches]
    assert seen == [flags]
    want = kernels.paged_attention(*args, **scales, **mode, block_n=32)
    torch.testing.assert_close(got, want, atol=FP32_ATOL * want.abs().max().item(), rtol=0)


@pytest.mark.parametrize("dtype, mode", KV_MODES)
@pytest.mark.parametrize("block_size", [16, 24], ids=lambda b: f"B{b}")
def test_wide_scale_loads_give_the_plain_loads_output(
    monkeypatch, dtype: torch.dtype, mode: dict, block_size: int
) -> None:
    # The launch option a GPU run times against the default: the same columns, read another way.
    case = make_paged_case(
        q_lens=[9, 4], k_lens=[5 * 32 + 7, 70], block_size=block_size, head_dim=80, device=DEVICE
    )
    args, scales = quantized_args(case, dtype, spread=0.5)
    launch = dict(**scales, **mode, block_m=16, block_n=32, out=nan_like(case.q))
    plain = kernels.paged_attention(*args, **launch).clone()
    real_choose = launcher.choose_tiles
    monkeypatch.setattr(
        launcher, "choose_tiles", lambda **kw: {**real_choose(**kw), "WIDE_SCALES": True}
    )
    flags = record_launches(monkeypatch, launcher, "_paged_attention_kernel")
    wide = kernels.paged_attention(*args, **launch)
    assert [f["WIDE_SCALES"] for f in flags] == [True]
    assert not torch.isnan(wide).any()
    if ON_GPU:
        torch.testing.assert_close(wide, plain, atol=FP32_ATOL * plain.abs().max().item(), rtol=0)
    else:
        assert torch.equal(wide, plain)


# ---------------------------------------------------------------- the TMA loop


@pytest.mark.parametrize("dtype, mode", KV_MODES)
@pytest.mark.parametrize(
    "block_size, block_n, descriptors",
    [
        pytest.param(128, 32, True, id="contiguous-B128-N32"),  # four tiles a block
        pytest.param(80, 32, True, id="block_tiles-B80-N32"),  # 64 keys by descriptor + 16
        # 32 by descriptor + 8: at odd block ids a tile starts mid-way through 16 pool rows.
        pytest.param(40, 32, True, id="block_tiles-B40-N32"),
        pytest.param(160, 128, True, id="block_tiles-B160-N128"),  # the probe's 128-key tiles
        pytest.param(24, 32, False, id="block_tiles-B24-N32"),  # no tile inside a block
    ],
)
def test_tma_loop_over_keys_major_pools_gives_the_pointer_loops_output(
    monkeypatch, dtype: torch.dtype, mode: dict, block_size: int, block_n: int, descriptors: bool
) -> None:
    # Codes and scales by descriptor (the unmasked whole tiles; masked ones by pointer), the
    # scale pools keys-major, every padding poisoned: the pointer loop's output, through
    # causal, limits and a gap.
    case, kwargs = masked_case(block_size, block_n, head_dim=64)
    args, scales = quantized_args(case, dtype, spread=0.5)
    scales = {**scales, **{n: poisoned_keys_major(scales[n]) for n in ("k_scale", "v_scale")}}
    launch = dict(**kwargs, **mode, **scales, block_m=16, block_n=block_n, return_lse=True)
    want, want_lse = kernels.paged_attention(
        *args, out=nan_like(case.q), variant="cp_async", **launch
    )
    launches = record_launches(monkeypatch, launcher, "_paged_attention_kernel")
    got, lse = kernels.paged_attention(*args, out=nan_like(case.q), variant="tma", **launch)
    assert [flags["TMA"] for flags in launches] == [descriptors]
    assert not torch.isnan(got).any(), "a hidden key, or the padding, was read"
    # The TMA loop takes the masked tiles first (and other shared-memory layouts, on a GPU):
    # the same scores, summed in another order.
    torch.testing.assert_close(lse, want_lse, atol=0, rtol=LSE_RTOL)
    torch.testing.assert_close(got, want, atol=FP32_ATOL * want.abs().max().item(), rtol=0)


@pytest.mark.parametrize(
    "v_layout, scales_layout, mode, block_size",
    [
        pytest.param("slots", "slots", {}, 32, id="slot-major-scales"),
        pytest.param("slots", "k-only", {}, 32, id="one-scale-pool-keys-major"),
        # Rows of 40 keys unpadded: 8-element aligned (block_tiles, 32 keys by descriptor).
        pytest.param("slots", "unpadded", {}, 40, id="unaligned-scales"),
    ],
)
def test_tma_refuses_quantized_pools_its_descriptors_cannot_read(
    v_layout: str, scales_layout: str, mode: dict, block_size: int
) -> None:
    # A slot-major scale pool holds a head's scales 4 bytes apart, too narrow for a descriptor's
    # rows. Refused by name, nothing written.
    dtype = torch.int8
    case = make_paged_case(
        q_lens=[5], k_lens=[70], block_size=block_size, head_dim=64, device=DEVICE
    )
    args, scales = quantized_args(case, dtype, spread=0.5)
    laid_out = {
        **scales,
        "k_scale": _layout(scales["k_scale"], scales_layout.replace("k-only", "padded")),
        "v_scale": _layout(scales["v_scale"], scales_layout.replace("k-only", "slots")),
    }
    v = _layout(args[2], v_layout)
    out = nan_like(case.q)
    with pytest.raises(ValueError, match=r"variant 'tma' needs caches.*kernels\.keys_major"):
        kernels.paged_attention(
            *args[:2], v, *args[3:], **laid_out, **mode, out=out, block_n=32, variant="tma"
        )
    assert torch.isnan(out).all()
    # The warp-specialized kernel takes no quantized pool at all.
    with pytest.raises(ValueError, match="variant 'ws' loads unquantized"):
        kernels.paged_attention(*args, **scales, **mode, block_n=32, variant="ws")


@pytest.mark.parametrize("dtype, mode", KV_MODES)
def test_torch_path_reads_keys_major_v(no_interpreter, dtype: torch.dtype, mode: dict) -> None:
    # The CPU path without the interpreter gathers through the same strides.
    case = make_paged_case(q_lens=[5, 12], k_lens=[30, 12], block_size=7, head_dim=80)
    key_gap = torch.tensor([[2, 11], [1, 3]], dtype=torch.int32)
    args, scales = quantized_args(case, dtype)
    launch = dict(**scales, **mode, key_gap=key_gap)
    want = kernels.paged_attention(*args, **launch)
    got = kernels.paged_attention(*args[:2], poisoned_keys_major(args[2]), *args[3:], **launch)
    assert torch.equal(got, want)

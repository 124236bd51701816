"""The key-loop variants of ``paged_attention`` (``variant=``) and the launch table.

The TMA and warp-specialized variants' descriptor loads run under the interpreter (Triton's
interpreter implements tensor descriptors; it ignores ``warp_specialize``, so the
warp-specialized kernel runs as a plain loop there), so both are checked against the float64
oracle like the default loop: on the contiguous path (whole tiles through descriptors, masked
tiles through pointers; for ``ws`` the partial tiles in the masked kernel, merged by LSE) and
on the other paths (where they keep the pointer loop). Their machine code (TMA loads, warp
partitions) is checked by tests/bench/test_compile_report.py.
"""

from __future__ import annotations

import importlib
import json

import pytest
import torch

from paged_video import kernels
from paged_video.kernels import launch_table
from tests.helpers import DEVICE, ON_GPU, nan_like, record_launches
from tests.kernels.paged_case import make_paged_case
from tests.kernels.test_paged_attention import run_and_compare

launcher = importlib.import_module("paged_video.kernels.paged_attention")
# The warp-specialized kernel takes 16-bit queries on a GPU; the interpreter runs float32 too.
WS_DTYPE = torch.float16 if ON_GPU else torch.float32


@pytest.mark.parametrize(
    "block_size, block_n, head_dim",
    [
        pytest.param(16, 16, 64, id="contiguous-B16-N16-D64"),
        pytest.param(64, 32, 128, id="contiguous-B64-N32-D128"),
        pytest.param(256, 64, 32, id="contiguous-B256-N64-D32"),
        pytest.param(31, 16, 64, id="block_tiles-B31-N16"),
        pytest.param(511, 256, 16, id="two_blocks-B511-N256"),
        pytest.param(1560, 64, 16, id="block_tiles-B1560-N64"),
        pytest.param(7, 16, 16, id="block_tiles-B7-N16"),
        pytest.param(31, 32, 16, id="block_tiles-B31-N32"),
        pytest.param(511, 512, 16, id="rows-B511-N512"),
        pytest.param(1, 16, 16, id="rows-B1-N16"),
        # Tiles of two whole blocks: a descriptor load per block (_attend_block_pairs).
        pytest.param(16, 32, 64, id="block-pairs-B16-N32"),
        pytest.param(64, 128, 32, id="block-pairs-B64-N128-D32"),
    ],
)
def test_tma_variant_matches_oracle(block_size: int, block_n: int, head_dim: int) -> None:
    # GQA, a chunk of queries at the end of the keys (causal), per-row limits and a gap: whole
    # tiles before, between and after masked ones; NaN-poisoned pool and output.
    k_len = 5 * block_n + 9 if block_size <= 64 else block_size + 2 * block_n + 9
    case = make_paged_case(
        q_lens=[21, 3],
        k_lens=[k_len, 2 * block_n + 5],
        block_size=block_size,
        num_heads=4,
        num_kv_heads=2,
        head_dim=head_dim,
        device=DEVICE,
    )
    tiles = kernels.choose_tiles(
        block_size=block_size,
        head_dim=head_dim,
        max_seqlen_q=21,
        dtype=torch.float32,
        block_n=block_n,
        variant="tma",
    )
    # Descriptor loads for tiles inside one block (a larger block's whole tiles) or of two whole
    # blocks; straddling tiles, small blocks' pieces and other per-row tiles keep pointers.
    pairs = tiles["KV_PATH"] == "rows" and block_n == 2 * block_size
    inside = tiles["KV_PATH"] == "contiguous" or (
        tiles["KV_PATH"] == "block_tiles" and block_size > block_n
    )
    assert tiles["TMA"] == (inside or pairs)
    gen = torch.Generator().manual_seed(block_size)
    key_limits = torch.randint(k_len // 2, k_len + 1, (24,), generator=gen, dtype=torch.int32)
    key_gap = torch.tensor([[[block_n + 3, 2 * block_n + 1]], [[1, 2]]], dtype=torch.int32)
    run_and_compare(
        case,
        causal=True,
        key_limits=key_limits.to(DEVICE),
        key_gap=key_gap.to(DEVICE),
        block_m=16,
        block_n=block_n,
        variant="tma",
    )


@pytest.mark.parametrize(
    "mode",
    [
        pytest.param({}, id="bf16"),
        pytest.param({"dequantize": True, "kv_dtype": torch.int8}, id="int8"),
        pytest.param({"k8v8": True, "kv_dtype": torch.int8}, id="k8v8"),
    ],
)
@pytest.mark.parametrize("block_size, block_n", [(64, 128), (16, 32), (64, 64), (32, 128)])
def test_tiles_of_two_blocks_take_descriptors_for_16_bit_pools_only(
    mode: dict, block_size: int, block_n: int
) -> None:
    # The quantized loops load tiles by descriptor only inside one block: there the launch
    # is their pointer loop, and says so.
    tiles = kernels.choose_tiles(
        block_size=block_size, head_dim=128, max_seqlen_q=64, dtype=torch.bfloat16,
        block_n=block_n, variant="tma", tma_ready=True, **mode,
    )  # fmt: skip
    pairs = block_n == 2 * block_size and not mode
    assert tiles["TMA"] == (pairs or tiles["KV_PATH"] == "contiguous"), tiles
    assert tiles["VARIANT"] == ("tma" if tiles["TMA"] else "cp_async"), tiles


def test_tma_variant_plain_long_run() -> None:
    # No masks: every tile but the last is a descriptor load, with a permuted table.
    case = make_paged_case(q_lens=[9, 16], k_lens=[200, 64], block_size=32, device=DEVICE)
    run_and_compare(case, block_m=16, block_n=32, variant="tma")


@pytest.mark.parametrize(
    "block_size, block_n, head_dim, k_lens",
    [
        pytest.param(16, 16, 64, [59, 17, 5, 32], id="B16-N16-D64"),
        pytest.param(64, 32, 128, [200, 64, 31, 1], id="B64-N32-D128"),
        pytest.param(256, 64, 32, [300, 0, 64, 129], id="B256-N64-D32"),
    ],
)
def test_warp_specialized_variant_matches_oracle(
    block_size: int, block_n: int, head_dim: int, k_lens: list[int]
) -> None:
    # Whole tiles and a partial last tile, a sequence shorter than a tile, one with no keys,
    # one with no queries; NaN-poisoned pool and output; the LSE of the merge.
    case = make_paged_case(
        q_lens=[32, 5, 0, 7],
        k_lens=k_lens,
        block_size=block_size,
        num_heads=2,
        num_kv_heads=2,
        head_dim=head_dim,
        dtype=WS_DTYPE,
        device=DEVICE,
    )
    tiles = kernels.choose_tiles(
        block_size=block_size,
        head_dim=head_dim,
        max_seqlen_q=32,
        dtype=WS_DTYPE,
        block_n=block_n,
        variant="ws",
    )
    assert (tiles["KV_PATH"], tiles["VARIANT"]) == ("contiguous", "ws")
    run_and_compare(case, block_m=16, block_n=block_n, variant="ws")


def test_warp_specialized_kernel_attends_the_whole_tiles(monkeypatch) -> None:
    # The masked kernel sees only the partial tiles: a key gap hides the whole ones from it.
    case = make_paged_case(
        q_lens=[8], k_lens=[70], block_size=16, num_kv_heads=4, dtype=WS_DTYPE, device=DEVICE
    )
    gaps = []
    real = kernels.paged_attention

    def spy(*args, **kwargs):
        if kwargs.get("key_gap") is not None:
            gaps.append(kwargs["key_gap"].tolist())
        return real(*args, **kwargs)

    monkeypatch.setattr(launcher, "paged_attention", spy)
    run_and_compare(case, block_m=16, block_n=16, variant="ws")
    assert gaps == [[[0, 64]]]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(causal=True), "no causal"),
        (dict(key_limits=torch.full((8,), 20, dtype=torch.int32)), "key_limits"),
        (dict(key_gap=torch.tensor([[3, 9]], dtype=torch.int32)), "key_gap"),
    ],
    ids=["causal", "key_limits", "key_gap"],
)
def test_warp_specialized_refusals(kwargs: dict, message: str) -> None:
    case = make_paged_case(q_lens=[8], k_lens=[40], block_size=16, num_kv_heads=4, device=DEVICE)
    out = nan_like(case.q)
    kwargs = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    with pytest.raises(ValueError, match=f"variant 'ws' .*{message}"):
        kernels.paged_attention(
            *case.args(), max_seqlen_q=8, out=out, block_n=16, variant="ws", **kwargs
        )
    assert torch.isnan(out).all()


def test_warp_specialized_refuses_gqa_and_falls_back_when_chosen(monkeypatch) -> None:
    case = make_paged_case(q_lens=[8], k_lens=[40], block_size=16, device=DEVICE)  # GQA 4:2
    with pytest.raises(ValueError, match="one query head per KV head"):
        kernels.paged_attention(*case.args(), max_seqlen_q=8, block_n=16, variant="ws")
    # Chosen by the table, it falls back to the TMA loop, which takes GQA and masks.
    real = launcher.choose_tiles
    monkeypatch.setattr(
        launcher, "choose_tiles", lambda **kw: real(**{**kw, "variant": kw["variant"] or "ws"})
    )
    key_limits = torch.full((8,), 30, dtype=torch.int32, device=DEVICE)
    run_and_compare(case, causal=True, key_limits=key_limits, block_m=16, block_n=16)


def test_warp_specialized_kernel_runs_two_stages_at_most(monkeypatch) -> None:
    # At 3 stages the warp-specialized loop wrote NaN on an H200 with Triton 3.6 (this kernel
    # and Triton's tutorial both; bench/RESULTS.md): whatever the table says, it gets 2.
    launches = record_launches(monkeypatch, launcher, "_paged_attention_ws_kernel")
    real_choose = launcher.choose_tiles
    monkeypatch.setattr(
        launcher, "choose_tiles", lambda **kw: {**real_choose(**kw), "num_stages": 4}
    )
    case = make_paged_case(
        q_lens=[8], k_lens=[40], block_size=16, num_kv_heads=4, dtype=WS_DTYPE, device=DEVICE
    )
    run_and_compare(case, block_m=16, block_n=16, variant="ws")
    stages = [launch["num_stages"] for launch in launches]
    assert stages == [launcher.WS_MAX_STAGES] and launcher.WS_MAX_STAGES == 2


def test_warp_specialized_refuses_float32_on_a_gpu(monkeypatch) -> None:
    monkeypatch.setattr(launcher, "interpreter_active", lambda: False)
    q = torch.zeros(4, 2, 64)
    assert "fp16/bf16" in launcher._warp_specialized_refusal(q, 1, False, None, None)
    assert launcher._warp_specialized_refusal(q.half(), 1, False, None, None) is None


def test_variant_names_are_checked() -> None:
    case = make_paged_case(q_lens=[4], k_lens=[20], block_size=16, device=DEVICE)
    out = nan_like(case.q)
    with pytest.raises(ValueError, match="variant"):
        kernels.paged_attention(*case.args(), max_seqlen_q=4, out=out, variant="wgmma")
    assert torch.isnan(out).all()


def test_tma_refuses_a_layout_descriptors_cannot_read() -> None:
    # head_dim 80 pads to 128 columns, which would run into the next head: refused, nothing
    # written. Without the check the tile's extra columns read the next head (NaN-poisoned).
    case = make_paged_case(q_lens=[4], k_lens=[40], block_size=16, head_dim=80, device=DEVICE)
    out = nan_like(case.q)
    with pytest.raises(ValueError, match="variant 'tma' needs caches"):
        kernels.paged_attention(*case.args(), max_seqlen_q=4, out=out, block_n=16, variant="tma")
    assert torch.isnan(out).all()


def test_strided_pool_refused_for_tma_and_fine_when_the_table_chose_it(monkeypatch) -> None:
    # Every other KV head of a wider pool: descriptors would read the wrong columns.
    case = make_paged_case(q_lens=[9], k_lens=[70], block_size=16, device=DEVICE)
    case.k_cache = torch.cat([case.k_cache, case.k_cache], dim=2)[:, :, ::2]
    case.v_cache = torch.cat([case.v_cache, case.v_cache], dim=2)[:, :, ::2]
    with pytest.raises(ValueError, match="variant 'tma' needs caches"):
        kernels.paged_attention(*case.args(), max_seqlen_q=9, block_n=16, variant="tma")
    # A default that cannot apply is not an error: the pointer loop runs.
    real = launcher.choose_tiles
    monkeypatch.setattr(
        launcher, "choose_tiles", lambda **kw: real(**{**kw, "variant": kw["variant"] or "tma"})
    )
    run_and_compare(case, block_m=16, block_n=16)


@pytest.mark.parametrize(
    "change",
    [
        dict(head_dim=80),
        dict(stride_dim=2),
        dict(stride_block_extra=64),
        dict(stride_slot_bytes=8),
        dict(slots=2**31),
    ],
    ids=str,
)
def test_descriptor_layout_conditions(change: dict) -> None:
    # Meta tensors: shapes and strides without memory, so 2**31 slots cost nothing.
    heads, head_dim, block_size = 2, 64, 16
    blocks = change.get("slots", 64) // block_size

    def pool(**c) -> torch.Tensor:
        d = c.get("head_dim", head_dim)
        slot = heads * d if "stride_slot_bytes" not in c else c["stride_slot_bytes"] // 2
        dim = c.get("stride_dim", 1)
        stride = (block_size * slot + c.get("stride_block_extra", 0), slot, d * dim, dim)
        return torch.empty_strided(
            (blocks, block_size, heads, d), stride, dtype=torch.bfloat16, device="meta"
        )

    good = pool()
    d = change.get("head_dim", head_dim)
    assert launcher._descriptor_layout(good, good, head_dim, head_dim) == ("slots" not in change)
    bad = pool(**change)
    block_d = 1 << (d - 1).bit_length()  # BLOCK_D: head_dim rounded up to a power of two
    assert not launcher._descriptor_layout(bad, bad, block_d, d)


@pytest.mark.parametrize("scales_keys_major", [True, False], ids=["keys-major", "slot-major"])
def test_call_tiles_is_the_launch_a_call_takes(scales_keys_major: bool, monkeypatch) -> None:
    # A k8v8 call on a GPU: the table's keys-major row (TMA over 128-key tiles at block 1560)
    # only where the pools are ones the TMA loop reads (paged_attention takes its launch from
    # call_tiles). Meta tensors: shapes and strides without memory.
    monkeypatch.setattr(launcher, "interpreter_active", lambda: False)
    heads, head_dim, block_size = 1, 128, 1560
    k_cache = torch.zeros(2, block_size, heads, head_dim, dtype=torch.int8, device="meta")
    v_cache = kernels.pool_layout.empty_keys_major(
        2, block_size, heads, head_dim, dtype=torch.float8_e4m3fn, device="meta"
    )
    k_scale = torch.empty(2, block_size, heads, device="meta")
    if scales_keys_major:
        k_scale = kernels.pool_layout.empty_keys_major(
            2, block_size, heads, dtype=torch.float32, device="meta"
        )
    channels = torch.empty(1, heads, head_dim, device="meta").expand(2, -1, -1)
    q = torch.empty(64, heads, head_dim, dtype=torch.bfloat16, device="meta")
    tiles = kernels.call_tiles(
        q, k_cache, v_cache, max_seqlen_q=64, k_scale=k_scale, v_channel_scale=channels
    )
    assert tiles["TMA_READY"] is scales_keys_major
    if scales_keys_major:
        assert (tiles["BLOCK_N"], tiles["TMA"], tiles["VARIANT"]) == (128, True, "tma")
    else:
        assert (tiles["BLOCK_N"], tiles["TMA"]) == (64, False)
    with pytest.raises(ValueError, match="k_cache must be 4-D"):
        kernels.call_tiles(q, k_cache[0], v_cache, max_seqlen_q=64)


def test_launch_table_routes_gpu_defaults(monkeypatch) -> None:
    monkeypatch.setattr(launcher, "interpreter_active", lambda: False)
    choices = {
        (128, "contiguous", "same"): dict(
            variant="tma", block_n=128, scores_ahead=False, num_warps=8, num_stages=2
        ),
        (128, "block_tiles", "same"): dict(
            variant="cp_async", block_n=64, scores_ahead=True, num_warps=4, num_stages=4
        ),
    }
    monkeypatch.setattr(launch_table, "lookup", lambda d, p, m: choices.get((d, p, m)))
    shipped = dict(head_dim=128, max_seqlen_q=4680, dtype=torch.bfloat16)
    tiles = kernels.choose_tiles(block_size=256, **shipped)
    assert (tiles["BLOCK_N"], tiles["TMA"], tiles["num_warps"], tiles["num_stages"]) == (
        128,
        True,
        8,
        2,
    )
    tiles = kernels.choose_tiles(block_size=1560, **shipped)
    assert (tiles["TMA"], tiles["num_warps"], tiles["num_stages"]) == (False, 4, 4)
    assert (
        tiles["SCORES_AHEAD"]
        and not kernels.choose_tiles(block_size=256, **shipped)["SCORES_AHEAD"]
    )
    # The caller's scores_ahead wins over the row's, which still gives the rest.
    tiles = kernels.choose_tiles(block_size=1560, scores_ahead=False, **shipped)
    assert (tiles["SCORES_AHEAD"], tiles["num_warps"], tiles["num_stages"]) == (False, 4, 4)
    # Caller overrides win; another variant or tile keeps the built-in settings, not the
    # table's (a launch candidate measures its own launch, whatever the table holds then).
    tiles = kernels.choose_tiles(block_size=256, variant="cp_async", **shipped)
    assert (tiles["BLOCK_N"], tiles["TMA"], tiles["num_stages"]) == (64, False, 3)
    tiles = kernels.choose_tiles(block_size=256, block_n=64, **shipped)
    assert (tiles["BLOCK_N"], tiles["TMA"], tiles["num_stages"]) == (64, False, 3)
    # The row's own variant and tile, named: the row, its warps and stages too.
    tiles = kernels.choose_tiles(block_size=256, variant="tma", block_n=128, **shipped)
    assert (tiles["BLOCK_N"], tiles["TMA"], tiles["num_stages"]) == (128, True, 2)
    # Quantized caches and float32 do not read the 16-bit table.
    tiles = kernels.choose_tiles(block_size=256, dequantize=True, **shipped)
    assert (tiles["BLOCK_N"], tiles["TMA"]) == (64, False)
    # Block 64 in the row's class: its 128-key tiles are two blocks each, which the row's GPU
    # run read by pointer; named, the tma variant reads them a block per descriptor load.
    tiles = kernels.choose_tiles(block_size=64, **shipped)
    assert (tiles["KV_PATH"], tiles["BLOCK_N"], tiles["TMA"]) == ("rows", 128, False)
    tiles = kernels.choose_tiles(block_size=64, variant="tma", **shipped)
    assert (tiles["KV_PATH"], tiles["BLOCK_N"], tiles["TMA"]) == ("rows", 128, True)
    # Block 32's 128-key tiles are four blocks each: the pointer loop.
    tiles = kernels.choose_tiles(block_size=32, variant="tma", block_n=128, **shipped)
    assert (tiles["KV_PATH"], tiles["BLOCK_N"], tiles["TMA"]) == ("rows", 128, False)


def test_head_dim_256_takes_128_by_64_tiles_and_quantized_caches_64_by_32(monkeypatch) -> None:
    # 16-bit at head_dim 256: 128 x 64 (8 warps split 32-key tiles into MMAs of 16 columns, 4x
    # the instructions per row and key); quantized caches keep 64 x 32, where they do not spill.
    monkeypatch.setattr(launcher, "interpreter_active", lambda: False)
    wide = dict(head_dim=256, max_seqlen_q=4680, dtype=torch.bfloat16)
    for block_size in (16, 256, 1560):
        tiles = kernels.choose_tiles(block_size=block_size, **wide)
        assert (tiles["BLOCK_M"], tiles["BLOCK_N"], tiles["num_warps"]) == (128, 64, 8), tiles
        tiles = kernels.choose_tiles(block_size=block_size, dequantize=True, **wide)
        assert (tiles["BLOCK_M"], tiles["BLOCK_N"]) == (64, 32), tiles
    assert kernels.choose_tiles(block_size=256, **wide)["TMA"]


def test_a_warp_specialized_row_leaves_its_fallbacks_the_built_in_warps(monkeypatch) -> None:
    # A ws row names the 4-warp consumers that ran (bench choose): the ws kernel sets those
    # itself, and where it does not run (block_tiles: the TMA loop; a straddling tile: the
    # pointer loop) the launch must not be a 4-warp, 2-stage one.
    monkeypatch.setattr(launcher, "interpreter_active", lambda: False)
    ws = dict(variant="ws", block_n=64, scores_ahead=False, num_warps=4, num_stages=2)
    rows = {(128, path, "same"): ws for path in ("contiguous", "block_tiles")}
    monkeypatch.setattr(launch_table, "lookup", lambda d, p, m: rows.get((d, p, m)))
    shipped = dict(head_dim=128, max_seqlen_q=4680, dtype=torch.bfloat16)
    for block_size, variant in ((256, "ws"), (1560, "tma"), (24, "cp_async")):
        tiles = kernels.choose_tiles(block_size=block_size, **shipped)
        got = (tiles["VARIANT"], tiles["BLOCK_N"], tiles["num_warps"], tiles["num_stages"])
        assert got == (variant, 64, 8, 3), (block_size, tiles)


@pytest.mark.parametrize(
    "block_size, changes, wanted",
    [
        pytest.param(1560, {}, (128, True), id="frame-block"),
        pytest.param(256, {}, (128, True), id="contiguous"),
        pytest.param(64, {}, (64, False), id="block-under-128"),  # a 128-key tile would straddle
        # 200 = 128 + 64 + 8 at 128 keys: two pieces' unmasked loops would run by pointer (the
        # quantized 128-key pointer loops spill); at 64 keys, 192 + a masked-only 8.
        pytest.param(200, {}, (64, False), id="pieces-by-pointer"),
        pytest.param(1560, {"tma_ready": False}, (64, False), id="slot-major-pools"),
        pytest.param(1560, {"block_n": 64}, (64, False), id="caller-tile"),
        pytest.param(1560, {"variant": "tma"}, (128, True), id="caller-variant-the-rows"),
        pytest.param(1560, {"variant": "cp_async"}, (64, False), id="caller-variant"),
        pytest.param(1560, {"head_dim": 64}, (64, False), id="head-dim-64"),
        pytest.param(
            1560,
            {"k8v16": False, "dequantize": True, "kv_dtype": torch.int8},
            (64, False),
            id="dequantizing",
        ),
    ],
)
def test_k8v16_over_tma_ready_pools_takes_128_key_tma_tiles(
    monkeypatch, block_size: int, changes: dict, wanted: tuple
) -> None:
    # Rows of k8v16_keys given here (a GPU run may rewrite the shipped ones): the rule they
    # go through is what is tested.
    monkeypatch.setattr(launcher, "interpreter_active", lambda: False)
    tma_128 = dict(variant="tma", block_n=128, scores_ahead=False, num_warps=8, num_stages=3)
    rows = {(128, path, "k8v16_keys"): tma_128 for path in ("contiguous", "block_tiles")}
    monkeypatch.setattr(launch_table, "lookup", lambda d, p, m: rows.get((d, p, m)))
    call = dict(head_dim=128, max_seqlen_q=4680, dtype=torch.bfloat16, k8v16=True)
    call.update({"tma_ready": True, **changes})
    tiles = kernels.choose_tiles(block_size=block_size, **call)
    assert (tiles["BLOCK_N"], tiles["TMA"]) == wanted, tiles


@pytest.mark.parametrize(
    "layout, ready", [("keys-major", True), ("slot-major", False)], ids=["keys-major", "slots"]
)
def test_the_launcher_tells_choose_tiles_whether_descriptors_read_the_pools(
    monkeypatch, layout: str, ready: bool
) -> None:
    seen = []
    real = launcher.choose_tiles
    monkeypatch.setattr(launcher, "choose_tiles", lambda **kw: seen.append(kw) or real(**kw))
    case = make_paged_case(q_lens=[5], k_lens=[70], block_size=32, head_dim=64, device=DEVICE)
    # k8v16: int8 K codes with their scales, V in q's dtype.
    k_scale = torch.ones(case.v_cache.shape[:3], device=DEVICE)
    if layout == "keys-major":
        k_scale = kernels.keys_major(k_scale)
    k_codes = case.k_cache.nan_to_num(0.0).to(torch.int8)
    args = (case.q, k_codes, case.v_cache.nan_to_num(0.0), *case.args()[3:])
    kernels.paged_attention(*args, max_seqlen_q=5, k_scale=k_scale, block_n=32)
    assert [kw["tma_ready"] for kw in seen] == [ready]
    # With the codes' dtype, these name the launch table's mode (``_keys``: descriptors read).
    [kw] = seen
    assert kw["kv_dtype"] == torch.int8
    mode = launch_table.kv_mode(kw["kv_dtype"], k8v16=kw["k8v16"], keys_major=kw["tma_ready"])
    assert mode == ("k8v16_keys" if ready else "k8v16")


def test_shipped_launch_table_is_complete() -> None:
    table = launch_table.read_table()
    keys = {(r["head_dim"], r["kv_path"], r["mode"]) for r in table["choices"]}
    for head_dim in launch_table.HEAD_DIM_CLASSES:
        for path in launch_table.KV_PATHS:
            assert (head_dim, path, "same") in keys
        # Every block size falls in one of the classes.
        for block_size in range(1, 3200):
            assert launcher.table_key(block_size, head_dim)[1] in launch_table.KV_PATHS
    assert all(r["source"] in launch_table.SOURCES for r in table["choices"])


@pytest.mark.parametrize(
    "breakage, message",
    [
        (lambda t: t["choices"][0].update(variant="wgmma"), "variant"),
        (lambda t: t["choices"][0].update(block_n=48), "block_n"),
        (lambda t: t["choices"].append(dict(t["choices"][0])), "repeats"),
        (lambda t: t["choices"][1].pop("commit"), "choice 1 needs"),
        (lambda t: t["choices"][0].update(source="a guess"), "source"),
        (lambda t: t["choices"][0].update(device=""), "device"),
        (lambda t: t.pop("about"), "about"),
        (lambda t: t["choices"][0].update(mode="int8", variant="ws"), "'ws' loads unquant"),
        (lambda t: t["choices"][0].update(mode="int8", variant="tma"), "needs a '_keys' mode"),
        (lambda t: t["choices"][0].update(mode="k8v8_keys", block_n=16), "block_n=16 < 32"),
        (lambda t: t["choices"][0].update(mode="int8_key"), "mode="),
        (lambda t: t["choices"][0].update(mode="int8_mma_keys"), "mode="),  # deleted (issue 45)
        (lambda t: t["choices"][0].update(mode="fp8_mma_keys"), "mode="),  # deleted (issue 45)
        (lambda t: t["choices"][0].update(mode="fp8_keys"), "mode="),  # the e4m3 pool's, deleted
        (lambda t: t["choices"][0].update(scores_ahead=1), "scores_ahead=1"),
        (lambda t: t["choices"][0].update(num_stages=True), "num_stages=True"),
        (lambda t: t["choices"][0].update(mode="int8_keys", scores_ahead=True), "16-bit"),
        (lambda t: t["choices"][0].update(variant="ws", scores_ahead=True), "'tma' loop's"),
    ],
)
def test_launch_table_checks(breakage, message: str) -> None:
    table = json.loads(launch_table.TABLE_PATH.read_text())
    launch_table.check_table(json.loads(json.dumps(table)))
    breakage(table)
    with pytest.raises(ValueError, match=message):
        launch_table.check_table(table)


@pytest.mark.parametrize(
    "kv_dtype, flags, keys_major, mode",
    [
        pytest.param(None, {}, False, "same", id="same"),
        pytest.param(None, {}, True, "same", id="same-ready"),
        pytest.param(torch.int8, {}, False, "int8", id="int8"),
        pytest.param(torch.int8, {}, True, "int8_keys", id="int8-keys"),
        pytest.param(torch.int8, {"k8v16": True}, False, "k8v16", id="k8v16"),
    ],
)
def test_kv_mode_names_the_tables_mode(kv_dtype, flags: dict, keys_major: bool, mode) -> None:
    assert launch_table.kv_mode(kv_dtype, keys_major=keys_major, **flags) == mode
    assert mode in launch_table.MODES


# A quantized row of each kind, beside the 16-bit rows of the shipped table.
QUANTIZED_ROWS = {
    (128, "block_tiles", "k8v16_keys"): dict(
        variant="tma", block_n=64, scores_ahead=False, num_warps=4, num_stages=2
    ),
    (128, "block_tiles", "int8"): dict(
        variant="cp_async", block_n=32, scores_ahead=False, num_warps=4, num_stages=5
    ),
}


@pytest.mark.parametrize(
    "block_size, call, wanted",
    [
        pytest.param(1560, {"k8v16": True, "tma_ready": True}, (64, True, 4, 2), id="row"),
        # 24 is a block_tiles block too, but a 64-key tile straddles its blocks.
        pytest.param(24, {"k8v16": True, "tma_ready": True}, (64, False, 8, 3), id="straddles"),
        pytest.param(1560, {"k8v16": True}, (64, False, 8, 3), id="slot-major-no-row"),
        pytest.param(
            1560, {"k8v16": True, "tma_ready": True, "block_n": 32}, (32, False, 8, 3),
            id="caller-tile",
        ),
        pytest.param(
            1560, {"k8v16": True, "tma_ready": True, "block_n": 64}, (64, True, 4, 2),
            id="caller-names-the-rows-tile",
        ),
        pytest.param(
            1560, {"k8v16": True, "tma_ready": True, "variant": "cp_async"}, (64, False, 8, 3),
            id="caller-variant",
        ),
        pytest.param(
            1560, {"k8v16": True, "tma_ready": True, "variant": "tma"}, (64, True, 4, 2),
            id="caller-names-the-rows-variant",
        ),
        # The row's stages as written: not the built-in dequantizing stage on top.
        pytest.param(
            1560, {"dequantize": True, "kv_dtype": torch.int8}, (32, False, 4, 5), id="dq"
        ),
        pytest.param(1560, {"dequantize": True}, (64, False, 8, 4), id="dq-codes-unnamed"),
    ],
)  # fmt: skip
def test_quantized_rows_apply_as_a_whole(
    monkeypatch, block_size: int, call: dict, wanted: tuple
) -> None:
    monkeypatch.setattr(launcher, "interpreter_active", lambda: False)
    monkeypatch.setattr(launch_table, "lookup", lambda d, p, m: QUANTIZED_ROWS.get((d, p, m)))
    shipped = dict(head_dim=128, max_seqlen_q=4680, dtype=torch.bfloat16)
    tiles = kernels.choose_tiles(block_size=block_size, **shipped, **call)
    got = (tiles["BLOCK_N"], tiles["TMA"], tiles["num_warps"], tiles["num_stages"])
    assert got == wanted, tiles

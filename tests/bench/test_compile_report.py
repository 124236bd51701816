"""``python -m paged_video.bench compile``: the sm_90a machine code of ``paged_attention``
against a table-free flash-attention loop, read on a CPU (no GPU needed; skipped where Triton's
wheel has no ptxas).

Every shipped bf16/fp16, head_dim 64/128 configuration at block sizes 16..1560 is compiled once
per session (two processes) and must: not spill, use wgmma, prefetch K/V as deep as the reference
loop, keep its hottest loop within 1.25x of the reference loop's instructions, and keep each
block-size class's path within 1.10x of the contiguous path (block 64).

Quantized caches (bf16 queries, head_dim 128, blocks 16/64/1560) compile with the MMA their mode
asks for, keep as many K/V tiles in flight, and the FP8-MMA loop is no longer than the
dequantizing one.
"""

from __future__ import annotations

import itertools
import json
import os

import pytest
from filelock import FileLock

from paged_video.bench import compile_report
from paged_video.bench.cli import main

DTYPES = ("bf16", "fp16")
HEAD_DIMS = (64, 128)
BLOCK_SIZES = compile_report.SHIPPED_BLOCK_SIZES
CONTIGUOUS_BLOCK = 64

# Measured (Triton 3.9.0, ptxas-blackwell 13.4, 2026-12-03); the same for bf16 and fp16.
# Kept exact and strict: a fix makes these XPASS and fail, so the marks must go then.
_PATH_RATIO_MISSES = {
    (128, 24): "rows path 463 vs contiguous 372 (1.245x)",
    (128, 520): "two_blocks path 422 vs contiguous 372 (1.134x)",
    (128, 1560): "two_blocks path 424 vs contiguous 372 (1.140x)",
    (64, 1560): "two_blocks path 347 vs contiguous 314 (1.105x)",
}
_REFERENCE_RATIO_MISSES = {
    (128, 24): "rows path 463 SASS instructions vs reference loop 369 (1.255x)",
}


def _xfail(misses: dict, key: tuple[int, int]) -> list:
    reason = misses.get(key)
    return [pytest.mark.xfail(strict=True, reason=reason)] if reason else []


def _cases(misses: dict | None = None) -> list:
    return [
        pytest.param(
            dtype,
            head_dim,
            block,
            id=f"{dtype}-D{head_dim}-B{block}",
            marks=_xfail(misses or {}, (head_dim, block)),
        )
        for dtype, head_dim, block in itertools.product(DTYPES, HEAD_DIMS, BLOCK_SIZES)
    ]


@pytest.fixture(scope="session")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str, int, object], dict]:
    """Rows by (kernel, dtype, head_dim, block_size); the reference row has block ``""``."""
    if not compile_report.find_ptxas() or not compile_report._tool("cuobjdump").is_file():
        pytest.skip("no ptxas/cuobjdump in Triton's wheel (triton/backends/nvidia/bin)")
    configs = compile_report.configs_for(
        kernels=("paged_attention",),
        block_sizes=BLOCK_SIZES,
        head_dims=HEAD_DIMS,
        dtypes=DTYPES,
    )
    # The exact window's gap, and causal with per-row limits, at the shipped frame block.
    configs += compile_report.configs_for(kernels=("paged_attention",), block_sizes=(1560,), gaps=1)
    configs += compile_report.configs_for(
        kernels=("paged_attention",), block_sizes=(1560,), causal=True, key_limits=True
    )
    configs += compile_report.configs_for(
        kernels=("paged_attention",), block_sizes=QUANTIZED_BLOCKS, kv_modes=QUANTIZED_MODES
    )
    if "PYTEST_XDIST_WORKER" not in os.environ:
        rows = compile_report.compile_rows(configs, "cuda:90", workers=2)
    else:
        # xdist runs session fixtures once per worker: the first compiles, the others read.
        shared = tmp_path_factory.getbasetemp().parent / "compile_report.json"
        with FileLock(f"{shared}.lock"):
            if shared.is_file():
                rows = json.loads(shared.read_text())
            else:
                rows = compile_report.compile_rows(configs, "cuda:90", workers=2)
                shared.write_text(json.dumps(rows))
    # Reference rows (variant "") are keyed by their stages: quantized launches add one.
    return {
        (
            r["kernel"],
            r["dtype"],
            r["head_dim"],
            r["block_size"],
            r["variant"] or r["num_stages"],
        ): r
        for r in rows
    }


def _rows(
    report: dict, dtype: str, head_dim: int, block: int, variant: str = "plain"
) -> tuple[dict, dict]:
    paged = report[("paged_attention", dtype, head_dim, block, variant)]
    reference = report[("reference", dtype, head_dim, "", paged["num_stages"])]
    assert (paged["tile"], paged["num_warps"], paged["num_stages"]) == (
        reference["tile"],
        reference["num_warps"],
        reference["num_stages"],
    )
    return paged, reference


@pytest.mark.parametrize("dtype, head_dim, block", _cases())
def test_no_spills_wgmma_no_divisions(report, dtype: str, head_dim: int, block: int) -> None:
    paged, _ = _rows(report, dtype, head_dim, block)
    assert (paged["spill_stores"], paged["spill_loads"]) == (0, 0), paged
    assert paged["mma"] == "wgmma", paged
    assert paged["loop_divisions"] == 0, paged


@pytest.mark.parametrize("dtype, head_dim, block", _cases())
def test_prefetch_as_deep_as_reference(report, dtype: str, head_dim: int, block: int) -> None:
    paged, reference = _rows(report, dtype, head_dim, block)
    assert reference["kv_buffers"] == reference["num_stages"]
    assert paged["kv_buffers"] == reference["kv_buffers"], (paged, reference)
    assert paged["wait_depth"] == reference["wait_depth"], (paged, reference)


@pytest.mark.parametrize("variant", ["gaps=1", "causal+key_limits"])
def test_masked_variants_keep_the_pipeline(report, variant: str) -> None:
    paged, reference = _rows(report, "bf16", 128, 1560, variant)
    assert (paged["spill_stores"], paged["spill_loads"], paged["mma"]) == (0, 0, "wgmma"), paged
    assert (paged["kv_buffers"], paged["wait_depth"]) == (
        reference["kv_buffers"],
        reference["wait_depth"],
    ), paged
    plain, _ = _rows(report, "bf16", 128, 1560)
    assert paged["loop_instructions"] <= 1.05 * plain["loop_instructions"], (paged, plain)


@pytest.mark.parametrize("dtype, head_dim, block", _cases(_REFERENCE_RATIO_MISSES))
def test_loop_within_1_25x_reference(report, dtype: str, head_dim: int, block: int) -> None:
    paged, reference = _rows(report, dtype, head_dim, block)
    ratio = paged["loop_instructions"] / reference["loop_instructions"]
    assert ratio <= 1.25, f"{paged['loop_instructions']} vs {reference['loop_instructions']}"


@pytest.mark.parametrize("dtype, head_dim, block", _cases(_PATH_RATIO_MISSES))
def test_path_within_1_10x_contiguous(report, dtype: str, head_dim: int, block: int) -> None:
    paged, _ = _rows(report, dtype, head_dim, block)
    contiguous, _ = _rows(report, dtype, head_dim, CONTIGUOUS_BLOCK)
    assert contiguous["path"] == "contiguous"
    ratio = paged["loop_instructions"] / contiguous["loop_instructions"]
    assert ratio <= 1.10, f"{paged['path']} {paged['loop_instructions']} vs {contiguous}"


QUANTIZED_BLOCKS = (16, 64, 1560)
QUANTIZED_MODES = ("fp8", "int8", "fp8_mma")
# Measured (Triton 3.9.0, ptxas-blackwell 13.4, 2026-12-03), strict like the marks above.
_QUANTIZED_SPILLS = {
    ("int8", 64): "255 registers, 20/20 bytes spilled",
    ("fp8_mma", 1560): "255 registers, 8/8 bytes spilled",
}


def _quantized_cases(misses: dict | None = None) -> list:
    return [
        pytest.param(
            mode,
            block,
            id=f"{mode}-B{block}",
            marks=[pytest.mark.xfail(strict=True, reason=(misses or {})[(mode, block)])]
            if (mode, block) in (misses or {})
            else [],
        )
        for mode, block in itertools.product(QUANTIZED_MODES, QUANTIZED_BLOCKS)
    ]


@pytest.mark.parametrize("mode, block", _quantized_cases())
def test_quantized_mma_and_prefetch(report, mode: str, block: int) -> None:
    paged, _ = _rows(report, "bf16", 128, block, f"kv={mode}")
    # Dequantizing: 16-bit wgmma only; fp8_mma: FP8 wgmma only (QK^T and PV).
    assert paged["mma"] == ("wgmma.fp8" if mode == "fp8_mma" else "wgmma"), paged
    assert paged["loop_divisions"] == 0, paged
    # As many K/V tiles in flight as the bf16 kernel (the dequantizing launch adds a stage for it).
    plain, _ = _rows(report, "bf16", 128, block)
    assert paged["kv_buffers"] == plain["kv_buffers"] == 3, (paged, plain)


@pytest.mark.parametrize("mode, block", _quantized_cases(_QUANTIZED_SPILLS))
def test_quantized_no_spills(report, mode: str, block: int) -> None:
    paged, _ = _rows(report, "bf16", 128, block, f"kv={mode}")
    assert (paged["spill_stores"], paged["spill_loads"]) == (0, 0), paged


@pytest.mark.parametrize("block", QUANTIZED_BLOCKS)
def test_fp8_mma_loop_no_longer_than_dequantizing(report, block: int) -> None:
    mma, _ = _rows(report, "bf16", 128, block, "kv=fp8_mma")
    dequantizing, _ = _rows(report, "bf16", 128, block, "kv=fp8")
    assert mma["loop_instructions"] <= dequantizing["loop_instructions"], (mma, dequantizing)


# ---------------------------------------------------------------- the parsers, no ptxas needed

_SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   I2F.U32.RP R6, R31 ;
        /*0020*/                   DEPBAR.LE SB0, 0x1 ;
        /*0030*/                   HGMMA.64x64x16.F32.BF16 R88, gdesc[UR8], RZ, !UPT ;
        /*0040*/                   NOP ;
        /*0048*/                   IADD3 R2, R3, R4, RZ ;
        /*0050*/              @!P0 BRA 0x10 ;
        /*0060*/                   IMAD R2, R3, R4, RZ ;
        /*0070*/                   HGMMA.64x64x16.F32.BF16 R88, gdesc[UR8], RZ, !UPT ;
        /*0080*/                   DEPBAR.LE SB0, 0x2 ;
        /*0090*/               @P1 BRA 0x60 ;
        /*00a0*/                   BRA 0xa0;
"""


def test_sass_hottest_loop_is_the_cheapest_mma_loop() -> None:
    measures = compile_report.analyse_sass(_SASS)
    assert measures["mma"] == "wgmma"
    assert measures["mma_loops"] == 2
    # Two MMA loops, 0x10..0x50 (5 instructions without the NOP) and 0x60..0x90 (4).
    assert measures["loop_instructions"] == 4
    assert measures["wait_depth"] == 2
    assert measures["loop_divisions"] == 0
    dividing = _SASS.replace("IMAD R2, R3, R4, RZ", "I2F.U32.RP R6, R31")
    assert compile_report.analyse_sass(dividing)["loop_divisions"] == 1


def test_sass_fp8_wgmma() -> None:
    fp8 = _SASS.replace("HGMMA.64x64x16.F32.BF16", "QGMMA.64x64x32.F32.E4M3.E4M3")
    assert compile_report.analyse_sass(fp8)["mma"] == "wgmma.fp8"
    assert compile_report.analyse_sass(fp8)["loop_instructions"] == 4
    mixed = _SASS.replace("HGMMA.64x64x16.F32.BF16", "QGMMA.64x64x32.F32.E4M3.E4M3", 1)
    assert compile_report.analyse_sass(mixed)["mma"] == "wgmma+wgmma.fp8"


def test_quantized_configs_are_labelled() -> None:
    configs = compile_report.configs_for(
        kernels=("paged_attention", "write_slots"), block_sizes=(64,), kv_modes=("same", "fp8")
    )
    assert [(c.kernel, c.kv_mode) for c in configs] == [
        ("paged_attention", "same"),
        ("paged_attention", "fp8"),
        ("write_slots", "same"),
    ]
    assert compile_report._variant(configs[1]) == "kv=fp8"
    with pytest.raises(ValueError, match="kv_modes"):
        compile_report.configs_for(kv_modes=("fp4",))


def test_sass_without_mma_loop() -> None:
    measures = compile_report.analyse_sass("        /*0000*/   HMMA.16816.F32 R0, R4, R8, R0 ;\n")
    assert measures["mma"] == "mma.sync"
    assert measures["loop_instructions"] is None


def test_kv_buffers_from_ttgir() -> None:
    ttgir = (
        "%0 = ttg.local_alloc : () -> !ttg.memdesc<3x64x128xbf16, #shared, #smem, mutable>\n"
        "%1 = ttg.local_alloc : () -> !ttg.memdesc<2x128x64xbf16, #shared, #smem, mutable>\n"
        "%2 = ttg.local_alloc %q : () -> !ttg.memdesc<128x128xbf16, #shared, #smem>\n"
    )
    assert compile_report.kv_buffers(ttgir, 64, 128) == 3
    assert compile_report.kv_buffers(ttgir, 32, 128) is None


def test_bad_target_is_rejected_by_name(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["compile", "--target", "rocm:942"])
    assert exit_info.value.code == 2
    assert "--target" in capsys.readouterr().err

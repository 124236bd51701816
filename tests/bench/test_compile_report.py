"""``python -m paged_video.bench compile``: the sm_90a machine code of ``paged_attention`` read
from the cubin Triton builds, against two yardsticks (a plain int32-offset flash loop and the
tutorial's warp-specialized TMA loop), on a CPU (skipped where Triton's wheel has no cuobjdump).

One session compiles everything once: bf16 at head_dim 64/128 and block sizes 16..1560 (the
launch table's defaults; at head_dim 128 also the 64-key TMA launch, ``GOAL_LAUNCH``, on which
the compile goals are checked: the table's head_dim 128 rows now hold a GPU run's 128-key
choice, checked on its own), the masked features at block 1560, the quantized modes at blocks
16/24/64/520/1560, one launch option (``block_n=32``), the key-loop variants forced at blocks
64/256/1560 and the loop with the scores a tile ahead (``scores_ahead``) at 256/1560, with
Triton 3.9 (this interpreter) and, where ``PAGED_VIDEO_TRITON36_PYTHON`` names a Python with
Triton 3.6 (a side virtual environment's ``bin/python``; CI has none, and without it these cases
skip), the shipped bf16 launches, the variants and the quantized modes with Triton 3.6 as well.

The parsers are tested on planted SASS and TTGIR: a masked key loop shorter than the unmasked
one, an mbarrier retry placed after the kernel's exit, 64-bit integer arithmetic, spills, and
warp-specialized partitions.
"""

from __future__ import annotations

import csv
import importlib
import itertools
import json
import os
import sys
from pathlib import Path

import pytest
import torch
from filelock import FileLock

from paged_video.bench import compile_report, sass
from paged_video.bench.cli import main
from paged_video.kernels import launch_table
from paged_video.kernels.paged_attention import block_pieces, table_key

# A Python with Triton 3.6 (the GPU image's), from the environment: no machine's path here.
TRITON36_PYTHON = "PAGED_VIDEO_TRITON36_PYTHON"
BLOCK_SIZES = compile_report.SHIPPED_BLOCK_SIZES
HEAD_DIMS = (64, 128)
QUANTIZED_BLOCKS = (16, 24, 64, 520, 1560)
# The dequantizing modes (the e4m3 pool's fp8 ones were deleted, issue 45).
QUANTIZED_MODES = ("int8", "int8_keys")
# k8v8 over keys-major pools at one block (its own evidence: docs/quantization.md), for the FP8
# anchor it is weighed against and the 8-bit MMA's operands.
K8V8_BLOCK = 64
CONTIGUOUS_BLOCK = 256  # contiguous at 64- and 128-key tiles
# The head_dim 128 launch the compile goals are judged on: 64-key tiles through descriptors
# where a tile lies inside a block (the launcher keeps the pointer loop elsewhere). The launch
# table's own head_dim 128 rows are a GPU run's choice (128-key tiles, 2026-12-04), faster on
# the H200 though they spill a little at Triton's flags (test_gpu_chosen_launches_compile).
GOAL_LAUNCH = {"variant": "tma", "block_n": 64}
GOAL_VARIANT = compile_report.variant_label(tuple(GOAL_LAUNCH.items()))


def _triton36() -> str | None:
    """The Triton 3.6 interpreter ``PAGED_VIDEO_TRITON36_PYTHON`` names; None when unset (a
    path that is no file is a usage error, never a silent skip)."""
    python = os.environ.get(TRITON36_PYTHON)
    if not python:
        return None
    if not Path(python).is_file():
        raise pytest.UsageError(f"{TRITON36_PYTHON}={python}: no such interpreter")
    return python


def _configs_39() -> list[compile_report.Config]:
    configs = _configs_both()
    one = dict(kernels=("paged_attention",), block_sizes=(1560,))
    # The exact window's gap, and causal with per-row limits, at the shipped frame block.
    configs += compile_report.configs_for(**one, gaps=1, launches=(GOAL_LAUNCH,))
    configs += compile_report.configs_for(
        **one, causal=True, key_limits=True, launches=(GOAL_LAUNCH,)
    )
    configs += compile_report.configs_for(**one, launches=({"block_n": 32}, {"block_n": 48}))
    # A launch that spills at Triton's own flags (the report must read it from the cubin).
    configs += compile_report.configs_for(**one, head_dims=(256,), launches=({"block_n": 128},))
    return list(dict.fromkeys(configs))


# The key-loop variants forced at the contiguous blocks and at the frame block (block_tiles:
# TMA for the blocks' whole tiles; ws takes contiguous blocks only and falls back to tma), at
# 64-key tiles (the TMA one is GOAL_LAUNCH, compiled at every block).
VARIANT_LAUNCHES = ({"variant": "cp_async", "block_n": 64}, {"variant": "ws", "block_n": 64})
VARIANT_BLOCKS = (64, 256, 1560)
CP_ASYNC = "cp_async+block_n=64"
WS = "ws+block_n=64"


def _goal_configs() -> list[compile_report.Config]:
    return compile_report.configs_for(
        kernels=("paged_attention",), block_sizes=BLOCK_SIZES, launches=(GOAL_LAUNCH,)
    )


def _variant_configs() -> list[compile_report.Config]:
    return compile_report.configs_for(
        kernels=("paged_attention",), block_sizes=VARIANT_BLOCKS, launches=VARIANT_LAUNCHES
    )


# The TMA loop over keys-major quantized pools (codes and scales by descriptor) and the pointer
# loop, forced at 64-key tiles. Over these pools and blocks the launch table picks the default,
# and a GPU probe may rewrite those rows (bench choose --probe): so the tests that hold a loop
# to a goal name the loop, not the default, and one test holds the defaults to whatever the
# table says.
QUANTIZED_TMA_MODES = ("int8_keys",)
QUANTIZED_TMA_BLOCKS = (64, 520, 1560)
FORCED_TMA_LAUNCH = {"variant": "tma", "block_n": 64}
FORCED_CP_ASYNC_LAUNCH = {"variant": "cp_async", "block_n": 64}
FORCED_TMA, FORCED_CP_ASYNC = (
    compile_report.variant_label(tuple(launch.items()))
    for launch in (FORCED_TMA_LAUNCH, FORCED_CP_ASYNC_LAUNCH)
)


def _pointer_variant(mode: str, block: int) -> str:
    """The row of a quantized mode's 64-key pointer loop: forced where a launch-table row may
    pick another loop, the default elsewhere (the built-in pointer loop)."""
    table_picks = mode in QUANTIZED_TMA_MODES and block in QUANTIZED_TMA_BLOCKS
    return FORCED_CP_ASYNC if table_picks else "default"


def _quantized_tma_configs() -> list[compile_report.Config]:
    return compile_report.configs_for(
        kernels=("paged_attention",),
        block_sizes=QUANTIZED_TMA_BLOCKS,
        kv_modes=QUANTIZED_TMA_MODES,
        launches=(FORCED_TMA_LAUNCH, FORCED_CP_ASYNC_LAUNCH),
    )


# The dequantizing modes over keys-major scales, where the launch table takes the 128-key TMA
# loop (compile evidence, 2026-12-05), beside their 64-key pointer loop.
DEQUANT_TMA_MODES = ("int8_keys",)
DEQUANT_TMA_BLOCKS = (256, 1560)


def _dequant_tma_configs() -> list[compile_report.Config]:
    return compile_report.configs_for(
        kernels=("paged_attention",),
        block_sizes=DEQUANT_TMA_BLOCKS,
        kv_modes=DEQUANT_TMA_MODES,
        launches=({}, FORCED_CP_ASYNC_LAUNCH),
    )


# The dequantizing modes at head_dim 256 (32-key tiles), where float16 query rows spilled.
WIDE_HEAD_QUANTIZED = dict(
    kernels=("paged_attention",),
    head_dims=(256,),
    block_sizes=(16, 24, 1560),
    kv_modes=("int8",),
)


# Blocks cut into pieces at 128-key tiles (7 = 4 + 2 + 1, 94 = 64 + 16 + 8 + 4 + 2), at the
# launcher's defaults.
PIECE_BLOCKS = (7, 94)

# Head_dim 256 at the launcher's defaults (16-bit: 128 x 64 tiles; TMA at contiguous blocks).
WIDE_HEAD_BLOCKS = (16, 256, 1560)

# Blocks of one slot: keys-major pools of them are laid out slot-major (unpadded).
ONE_SLOT_BLOCKS = dict(
    kernels=("paged_attention",), block_sizes=(1,), kv_modes=("int8", "int8_keys")
)


# The loop with the scores a tile ahead (scores_ahead): the table's 128-key TMA launch at the
# frame block, the 64-key TMA one (GOAL_LAUNCH's loop) at a contiguous and the frame block, and
# the pair loop (128-key tiles of two 64-slot blocks, variant "tma" named) with and without it.
AHEAD_128_LAUNCH = {"scores_ahead": True}
AHEAD_64_LAUNCH = {**GOAL_LAUNCH, "scores_ahead": True}
PAIRS_LAUNCH = {"variant": "tma", "block_n": 128}
AHEAD_PAIRS_LAUNCH = {**PAIRS_LAUNCH, "scores_ahead": True}
AHEAD_128, AHEAD_64, PAIRS, AHEAD_PAIRS = (
    compile_report.variant_label(tuple(launch.items()))
    for launch in (AHEAD_128_LAUNCH, AHEAD_64_LAUNCH, PAIRS_LAUNCH, AHEAD_PAIRS_LAUNCH)
)


def _ahead_configs() -> list[compile_report.Config]:
    one = dict(kernels=("paged_attention",))
    return (
        compile_report.configs_for(**one, block_sizes=(1560,), launches=(AHEAD_128_LAUNCH,))
        + compile_report.configs_for(**one, block_sizes=(256, 1560), launches=(AHEAD_64_LAUNCH,))
        + compile_report.configs_for(
            **one, block_sizes=(64,), launches=(PAIRS_LAUNCH, AHEAD_PAIRS_LAUNCH)
        )
    )


def _configs_both() -> list[compile_report.Config]:
    """What both Tritons compile (Triton 3.9 adds the masked features and other tiles)."""
    configs = compile_report.configs_for(
        kernels=("paged_attention",), block_sizes=BLOCK_SIZES, head_dims=HEAD_DIMS
    )
    configs += _goal_configs()
    configs += _ahead_configs()
    configs += _variant_configs()
    configs += _quantized_tma_configs()
    configs += _dequant_tma_configs()
    configs += compile_report.configs_for(
        kernels=("paged_attention",), block_sizes=QUANTIZED_BLOCKS, kv_modes=QUANTIZED_MODES
    )
    configs += compile_report.configs_for(**WIDE_HEAD_QUANTIZED)
    configs += compile_report.configs_for(**ONE_SLOT_BLOCKS)
    configs += compile_report.configs_for(
        kernels=("paged_attention",), block_sizes=(K8V8_BLOCK,), kv_modes=("k8v8_keys",)
    )
    configs += compile_report.configs_for(kernels=("paged_attention",), block_sizes=PIECE_BLOCKS)
    configs += compile_report.configs_for(
        kernels=("paged_attention",), head_dims=(256,), block_sizes=WIDE_HEAD_BLOCKS
    )
    return list(dict.fromkeys(configs))  # (the dequantizing TMA launches are in two sets)


def _compile_all() -> list[dict]:
    rows = compile_report.compile_rows(
        list(dict.fromkeys(_configs_39() + _eight_bit_configs())), "cuda:90", workers=2
    )
    python36 = _triton36()
    if python36 is not None:
        rows += compile_report.compile_rows(
            list(dict.fromkeys(_configs_both() + _eight_bit_configs())),
            "cuda:90",
            workers=2,
            pythons=[python36],
        )
    return rows


class Report:
    """The session's rows, looked up by what a test names."""

    def __init__(self, rows: list[dict]) -> None:
        self.rows = rows
        self.versions = list(dict.fromkeys(r["triton"] for r in rows))

    def version(self, minor: str) -> str:
        found = [v for v in self.versions if v.startswith(minor + ".")]
        if not found:
            pytest.skip(f"no Triton {minor} in this session ({TRITON36_PYTHON})")
        return found[0]

    def paged(
        self,
        triton: str,
        block: int,
        *,
        head_dim=128,
        kv="same",
        features="plain",
        variant=None,
    ) -> dict:
        """A paged_attention row; ``variant`` None: the goal launch for 16-bit K/V at head_dim
        128, the launcher's own choice otherwise."""
        if variant is None:
            variant = GOAL_VARIANT if (head_dim, kv) == (128, "same") else "default"
        [row] = [
            r
            for r in self.rows
            if r["kernel"] == "paged_attention"
            and (r["triton"], r["block_size"], r["head_dim"], r["kv_mode"])
            == (triton, block, head_dim, kv)
            and (r["features"], r["variant"]) == (features, variant)
        ]
        assert row["error"] == "", row
        return row

    def yardstick(self, kind: str, like: dict) -> dict:
        """The yardstick a launch is weighed against (k8v8 launches: the FP8 anchor)."""
        keys = ("triton", "head_dim", "dtype")
        if kind == "anchor":
            keys += ("tile", "num_warps", "num_stages")
        fp8_modes = compile_report.FP8_ANCHOR_MODES
        fp8 = compile_report.FP8_ANCHOR if like["kv_mode"] in fp8_modes else ""
        [row] = [
            r
            for r in self.rows
            if r["kernel"] == kind
            and all(r[k] == like[k] for k in keys)
            and (kind != "anchor" or r["kv_mode"] == fp8)
        ]
        assert row["error"] == "", row
        return row


@pytest.fixture(scope="session")
def report(tmp_path_factory: pytest.TempPathFactory) -> Report:
    from triton import knobs

    tool = knobs.nvidia.cuobjdump
    if tool is None or not Path(tool.path).is_file():
        pytest.skip("no cuobjdump in Triton's wheel (triton/backends/nvidia/bin)")
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return Report(_compile_all())
    # xdist runs session fixtures once per worker: the first compiles, the others read.
    shared = tmp_path_factory.getbasetemp().parent / "compile_report.json"
    with FileLock(f"{shared}.lock"):
        if shared.is_file():
            return Report(json.loads(shared.read_text()))
        rows = _compile_all()
        shared.write_text(json.dumps(rows))
    return Report(rows)


def _version_marks(minor: str) -> list:
    if minor == "3.6" and not _triton36():
        return [pytest.mark.skip(reason=f"no Triton 3.6 Python ({TRITON36_PYTHON} unset)")]
    return []


def _versions() -> list:
    return ["3.9", pytest.param("3.6", marks=_version_marks("3.6"))]


# ---------------------------------------------------------------- the report tells the truth


def test_every_launch_compiled_and_checked_against_tritons_ptxas_log(report: Report) -> None:
    # A row's registers and spills agree with the ptxas -v log of Triton's own build, or the
    # row carries the mismatch as its error.
    rows = [r for r in report.rows if r["variant"] != "block_n=48"]  # refused, see below
    assert [r for r in rows if r["error"]] == []
    for row in rows:
        assert row["ptxas"].startswith("ptxas"), row
        # Spilling needs a stack frame; no stack, no spills.
        assert (row["spill_stores"] > 0) == (row["stack_bytes"] > 0), row


def test_spills_are_read_from_tritons_build(report: Report) -> None:
    # Head_dim 256 at 128-key tiles spills on Triton 3.9 (312 bytes; the launcher's 32-key
    # tiles do not): the figures come from the SASS and agree with the ptxas -v log of Triton's
    # own build (--regAllocOptLevel=2; a mismatch would be the row's error). (FP8-MMA at 128-key
    # pointer tiles, this test's launch until 2026-12-05, spills no more on 3.9.)
    row = report.paged(report.version("3.9"), 1560, head_dim=256, variant="block_n=128")
    assert row["spill_stores"] > 0 and row["spill_loads"] > 0, row
    assert row["registers"] == 255 and row["stack_bytes"] > 0, row


@pytest.mark.parametrize("minor", _versions())
def test_hot_loop_is_the_unmasked_key_loop(report: Report, minor: str) -> None:
    triton = report.version(minor)
    paged = [r for r in report.rows if r["kernel"] == "paged_attention" and not r["error"]]
    for row in (r for r in paged if r["triton"] == triton):
        loops = row["key_loops"].split(",")
        unmasked = [int(s) for s in loops if s.isdigit()]
        masked = [int(s[1:]) for s in loops if s.startswith("m")]
        # The kernel has both: whole tiles unmasked, the first and last tiles of a run masked.
        assert unmasked and masked, row
        assert row["loop_instructions"] == max(unmasked), row
        assert row["masked_loop_instructions"] == max(masked), row


@pytest.mark.parametrize("minor", _versions())
def test_anchor_is_a_lean_flash_loop(report: Report, minor: str) -> None:
    triton = report.version(minor)
    anchor = report.yardstick("anchor", report.paged(triton, 1560))
    # 2026-12-03: 348 instructions, 8 64-bit integer ops (one IMAD.WIDE per K/V address) on
    # Triton 3.9; 325 and 28 on 3.6 (whose ptxas also adds the wgmma descriptors in 64 bits).
    most_instructions, most_int64 = {"3.9": (355, 10), "3.6": (330, 30)}[minor]
    assert anchor["loop_instructions"] <= most_instructions, anchor
    assert anchor["loop_int64_ops"] <= most_int64, anchor
    assert (anchor["loop_divisions"], anchor["wait_depth"], anchor["kv_buffers"]) == (0, 2, 3)
    assert (anchor["spill_stores"], anchor["mma"], anchor["masked_loop_instructions"]) == (
        0,
        "HGMMA",
        None,
    )


@pytest.mark.parametrize("minor", _versions())
def test_fp8_anchor_is_a_lean_fp8_loop(report: Report, minor: str) -> None:
    triton = report.version(minor)
    keys_major = report.paged(triton, K8V8_BLOCK, kv="k8v8_keys")
    anchor = report.yardstick("anchor", keys_major)
    # 2026-12-04: 379 instructions on Triton 3.9, 361 on 3.6 (the 16-bit anchor: 348, 325);
    # 3 and 2 barriers, no shared store: V's keys-major tile feeds the MMA as prefetched.
    most_instructions = {"3.9": 390, "3.6": 370}[minor]
    assert anchor["loop_instructions"] <= most_instructions, anchor
    assert (anchor["mma"], anchor["kv_buffers"], anchor["spill_stores"]) == ("QGMMA", 3, 0)
    assert anchor["loop_barriers"] <= 3 and anchor["loop_shared_stores"] == 0, anchor
    # The k8v8 launches are weighed against it.
    per_key = keys_major["loop_instructions"] / anchor["loop_instructions"]
    assert keys_major["vs_anchor"] == round(per_key, 3), (keys_major, anchor)


@pytest.mark.parametrize("minor", _versions())
def test_tutorial_is_warp_specialized_over_tma(report: Report, minor: str) -> None:
    triton = report.version(minor)
    tutorial = report.yardstick("tutorial_ws", report.paged(triton, 1560))
    # A producer partition issuing the TMA loads, two 4-warp consumer warpgroups doing the MMAs.
    assert tutorial["partitions"] == 3, tutorial
    assert (tutorial["partition_warps"], tutorial["partition_roles"]) == ("4+4+4", "load,mma,mma")
    assert tutorial["tma_loads"] > 0 and tutorial["mbarriers"] > 0, tutorial
    assert "+" in tutorial["setmaxnreg"] and "-" in tutorial["setmaxnreg"], tutorial
    assert tutorial["producer_loop_instructions"] < 100, tutorial
    assert tutorial["loop_global_loads"] == 0 and tutorial["wait_depth"] is None, tutorial
    assert tutorial["kv_buffers"] == 3, tutorial
    # Consumer loops (2026-12-03): 327 and 366 on Triton 3.9, 304 and 304 on 3.6.
    consumers = [int(s) for s in tutorial["key_loops"].split(",")]
    assert len(consumers) == 2 and min(consumers) <= {"3.9": 335, "3.6": 310}[minor], tutorial


def test_a_refused_launch_is_a_row_with_its_error(report: Report) -> None:
    [row] = [r for r in report.rows if r["variant"] == "block_n=48"]
    assert "block_n" in row["error"] and "power of two" in row["error"], row
    assert row["loop_instructions"] is None and row["registers"] is None, row


def test_launch_options_reach_the_launcher(report: Report) -> None:
    triton = report.version("3.9")
    row = report.paged(triton, 1560, variant="block_n=32")
    assert (row["tile"], row["path"]) == ("128x32", "block_tiles"), row
    # Its anchor is built at the launch's own tile, and ratios are per key.
    anchor = report.yardstick("anchor", row)
    assert anchor["tile"] == "128x32"
    assert row["vs_anchor"] == round(row["loop_instructions"] / anchor["loop_instructions"], 3)
    tutorial = report.yardstick("tutorial_ws", row)
    per_key = min(int(s) for s in tutorial["key_loops"].split(",")) / 64
    assert row["vs_tutorial"] == round(row["loop_instructions"] / 32 / per_key, 3)


# ---------------------------------------------------------------- what the kernel achieves


def _misses(misses: dict, keys: tuple) -> list:
    reason = misses.get(keys)
    return [pytest.mark.xfail(strict=True, reason=reason)] if reason else []


# Measured 2026-12-04 (Triton 3.9.0, ptxas-blackwell 13.4), the launch table's defaults, every
# bf16 launch meets both ratios (block 24, cut 16 + 8: 372 vs the anchor's 348, 1.069x; block
# 1560: 353, 1.014x). Kept strict: a regression fails, and a miss listed here that is fixed
# XPASSes and fails, so the marks must go then.
_ANCHOR_GOAL_MISSES: dict = {}
# Per key, against the contiguous path at block 256 (472 per 128 keys at head_dim 64, 353 per
# 64 at 128).
_PATH_RATIO_MISSES: dict = {}
# Spill stores/loads in bytes, with Triton's own ptxas flags (255 registers), outside the key
# loops. The output's row offsets (the query load's) stayed live across the loops and spilled
# at FP8-MMA's 255 registers (16-68 bytes at blocks 16-1560 on Triton 3.9, 20 at block 16 on
# 3.6) until the output took its rows from the tile index read again (_tile_index_again,
# 2026-12-04). Then a block's second piece reused the first piece's quotients by the block
# size, kept from one piece's loops to the other's (8 bytes at 1560 on 3.9 over keys-major
# pools, 4 at block 24 on 3.6) until the second piece divided again (_unknown_again).
_QUANTIZED_SPILLS: dict = {}
# The same on Triton 3.6 (the GPU image's).
_TRITON36_QUANTIZED_SPILLS: dict = {}


def _bf16_cases(misses: dict) -> list:
    return [
        pytest.param(d, b, id=f"D{d}-B{b}", marks=_misses(misses, (d, b)))
        for d, b in itertools.product(HEAD_DIMS, BLOCK_SIZES)
    ]


@pytest.mark.parametrize("head_dim, block", _bf16_cases({}))
def test_bf16_no_spills_hgmma_no_divisions(report: Report, head_dim: int, block: int) -> None:
    row = report.paged(report.version("3.9"), block, head_dim=head_dim)
    assert (row["spill_stores"], row["spill_loads"], row["mma"]) == (0, 0, "HGMMA"), row
    assert row["loop_divisions"] == 0, row


def _assert_pipelined_like(row: dict, anchor: dict) -> None:
    """As many K/V buffers in flight as the anchor; cp.async loops wait as deep as it does,
    TMA loops wait on mbarriers instead (no cp.async group)."""
    assert anchor["kv_buffers"] == anchor["num_stages"]
    assert row["kv_buffers"] == anchor["kv_buffers"], (row, anchor)
    if row["tma_loads"]:
        assert row["wait_depth"] is None and row["mbarriers"] > 0, row
    else:
        assert row["wait_depth"] == anchor["wait_depth"], (row, anchor)


@pytest.mark.parametrize("head_dim, block", _bf16_cases({}))
def test_prefetch_as_deep_as_anchor(report: Report, head_dim: int, block: int) -> None:
    row = report.paged(report.version("3.9"), block, head_dim=head_dim)
    _assert_pipelined_like(row, report.yardstick("anchor", row))


@pytest.mark.parametrize("minor", _versions())
@pytest.mark.parametrize("head_dim, block", _bf16_cases(_ANCHOR_GOAL_MISSES))
def test_loop_within_1_10x_anchor(report: Report, minor: str, head_dim: int, block: int) -> None:
    # The goal launch at head_dim 128 (64-key TMA tiles), the table's (128-key tiles) at 64: on
    # Triton 3.6 (2026-12-04) 1.01-1.10x and 1.01-1.05x (64-key tiles at head_dim 64: 1.06-1.13x).
    row = report.paged(report.version(minor), block, head_dim=head_dim)
    assert row["vs_anchor"] <= 1.10, row


def _per_key(row: dict, count: str = "loop_instructions") -> float:
    """A hot-loop count (all its instructions by default) per key of the launch's tile."""
    return row[count] / int(row["tile"].split("x")[1])


@pytest.mark.parametrize("minor", _versions())
@pytest.mark.parametrize("head_dim, block", _bf16_cases(_PATH_RATIO_MISSES))
def test_path_within_1_10x_contiguous(
    report: Report, minor: str, head_dim: int, block: int
) -> None:
    triton = report.version(minor)
    row = report.paged(triton, block, head_dim=head_dim)
    contiguous = report.paged(triton, CONTIGUOUS_BLOCK, head_dim=head_dim)
    assert contiguous["path"] == "contiguous"
    ratio = _per_key(row) / _per_key(contiguous)
    assert ratio <= 1.10, f"{row['path']} {row['loop_instructions']} vs {contiguous}"


@pytest.mark.parametrize("minor", _versions())
@pytest.mark.parametrize("block", PIECE_BLOCKS)
def test_blocks_cut_into_pieces_within_1_10x_anchor(report: Report, minor: str, block: int) -> None:
    # Block 7 took the rows path (an entry, a division and a modulo per row: 1.29-1.30x the
    # plain loop), block 94 tiles straddling two blocks at 64 keys (1.13x); in pieces, each
    # tile reads one entry per piece (2026-12-05), an unmasked and a masked loop per piece.
    row = report.paged(report.version(minor), block, variant="default")
    assert (row["path"], row["tile"], row["spill_stores"]) == ("block_tiles", "128x128", 0), row
    loops = 2 * len(block_pieces(block, 128))
    assert len(row["key_loops"].split(",")) == loops and row["loop_divisions"] == 0, row
    assert row["vs_anchor"] <= 1.10, row


@pytest.mark.parametrize("minor", _versions())
@pytest.mark.parametrize("block", WIDE_HEAD_BLOCKS)
def test_head_dim_256_tiles_within_1_10x_anchor(report: Report, minor: str, block: int) -> None:
    # 128 x 64 tiles (the 64 x 32 ones did 4x the instructions per row and key, 1.13-1.22x
    # their plain loop); the pointer loop adds the tile's scalar base to loop-invariant pointers
    # (block 1560: 1.10-1.12x when each address took an add and a 64-bit add, 2026-12-05).
    row = report.paged(report.version(minor), block, head_dim=256)
    assert (row["tile"], row["spill_stores"], row["spill_loads"]) == ("128x64", 0, 0), row
    assert row["vs_anchor"] <= 1.10, row


@pytest.mark.parametrize("head_dim, block", _bf16_cases({}))
def test_triton36_bf16_no_spills_full_pipeline(report: Report, head_dim: int, block: int) -> None:
    row = report.paged(report.version("3.6"), block, head_dim=head_dim)
    assert (row["spill_stores"], row["mma"], row["loop_divisions"]) == (0, "HGMMA", 0), row
    _assert_pipelined_like(row, report.yardstick("anchor", row))


@pytest.mark.parametrize("minor", _versions())
@pytest.mark.parametrize("block", [64, 256])
def test_tma_variant_loads_whole_tiles_through_descriptors(
    report: Report, minor: str, block: int
) -> None:
    triton = report.version(minor)
    tma = report.paged(triton, block, variant=GOAL_VARIANT)
    pointers = report.paged(triton, block, variant=CP_ASYNC)
    assert tma["path"] == pointers["path"] == "contiguous"
    # K and V by TMA; the loop's only global loads are the next tile's table entry.
    assert tma["tma_loads"] > 0 and pointers["tma_loads"] == 0, (tma, pointers)
    assert tma["loop_global_loads"] < pointers["loop_global_loads"], (tma, pointers)
    assert (tma["spill_stores"], tma["mma"]) == (0, "HGMMA"), tma
    _assert_pipelined_like(tma, report.yardstick("anchor", tma))
    # No longer than the pointer loop, and within 1.10x the plain loop (2026-12-03: 345 and 353
    # on Triton 3.9, 0.99x and 1.01x; 328 and 336 on 3.6, 1.01x and 1.03x). Since the pointer
    # loop adds its scalar base to loop-invariant pointers (2026-12-05) the two are within an
    # instruction of each other on 3.6 at block 64 (331 against 330).
    assert tma["loop_instructions"] <= pointers["loop_instructions"] * 1.01, (tma, pointers)
    assert tma["vs_anchor"] <= 1.10, tma


WS_KERNEL = "paged_attention/_paged_attention_ws_kernel"


@pytest.mark.parametrize("minor", _versions())
@pytest.mark.parametrize("block", [64, 256])
def test_ws_variant_is_warp_specialized_over_tma(report: Report, minor: str, block: int) -> None:
    triton = report.version(minor)
    rows = [r for r in report.rows if r["triton"] == triton and r["variant"] == WS]
    [ws] = [r for r in rows if r["kernel"] == WS_KERNEL and r["block_size"] == block]
    # The whole tiles: a producer warp issuing the TMA loads, two 4-warp consumer warpgroups.
    assert ws["error"] == "" and ws["num_warps"] == 4, ws
    assert (ws["partitions"], ws["partition_warps"]) == (3, "4+4+4"), ws
    assert ws["partition_roles"].startswith("load,"), ws
    assert ws["tma_loads"] > 0 and ws["mbarriers"] > 0, ws
    assert "+" in ws["setmaxnreg"] and "-" in ws["setmaxnreg"], ws
    # Two K/V buffers: the launcher's stage cap (3 stages wrote NaN on an H200, Triton 3.6).
    assert (ws["spill_stores"], ws["kv_buffers"], ws["loop_global_loads"]) == (0, 2, 0), ws
    assert ws["producer_loop_instructions"] < 100, ws
    # 2026-12-03: consumer loops of 325 instructions on Triton 3.9, 303 on 3.6 (the anchor with
    # as many MMA warps: 348 and 325).
    consumers = [int(s) for s in ws["key_loops"].split(",")]
    assert len(consumers) == 2 and ws["vs_anchor"] <= 1.10, ws
    # The partial tiles: the masked kernel beside it.
    kernel = "paged_attention/_paged_attention_kernel"
    [masked] = [r for r in rows if r["kernel"] == kernel and r["block_size"] == block]
    assert masked["error"] == "" and masked["spill_stores"] == 0, masked


@pytest.mark.parametrize("minor", _versions())
def test_block_tiles_load_whole_tiles_through_descriptors(report: Report, minor: str) -> None:
    # Block 1560: 24 whole 64-key tiles per block by TMA, the remainders (24 keys a block)
    # gathered into masked pointer-loaded tiles (2026-12-04: 355 on Triton 3.9, 338 on 3.6,
    # 1.02x and 1.04x the plain loop; the tiles straddling blocks took 391 and 366).
    triton = report.version(minor)
    tma = report.paged(triton, 1560, variant=GOAL_VARIANT)
    pointers = report.paged(triton, 1560, variant=CP_ASYNC)
    assert tma["path"] == pointers["path"] == "block_tiles"
    assert tma["tma_loads"] > 0 and pointers["tma_loads"] == 0, (tma, pointers)
    assert tma["loop_instructions"] < pointers["loop_instructions"], (tma, pointers)
    assert (tma["spill_stores"], tma["mma"]) == (0, "HGMMA"), tma
    _assert_pipelined_like(tma, report.yardstick("anchor", tma))
    assert tma["vs_anchor"] <= 1.10, tma
    # ws takes contiguous blocks only: here it is the tma kernel.
    ws = report.paged(triton, 1560, variant=WS)
    assert ws["loop_instructions"] == tma["loop_instructions"] and ws["partitions"] == 1, ws


# The launch table's head_dim 128 rows, chosen by the H200 run of 2026-12-04 (bench/RESULTS.md):
# 128-key tiles, TMA where a tile lies inside a block. Measured 4.91-5.07 ms against 5.38-5.57
# for the 64-key TMA loop at blocks 256/520/1560. At Triton's flags they spilled 0-36 bytes a
# launch on Triton 3.9 (24 at block 1560, in and around the masked loops) until masked tiles
# took half the tile (2026-12-04): none spill now, on either Triton.
GPU_CHOSEN_MOST_SPILL_BYTES = 0


@pytest.mark.parametrize("minor", _versions())
@pytest.mark.parametrize("block", BLOCK_SIZES)
def test_gpu_chosen_launches_compile(report: Report, minor: str, block: int) -> None:
    # The launcher's own launch: where the table picks ws, its warp-specialized kernel (with
    # the masked kernel beside it).
    launched = [
        r
        for r in report.rows
        if r["kernel"].startswith("paged_attention")
        and (r["triton"], r["block_size"], r["head_dim"], r["kv_mode"], r["features"])
        == (report.version(minor), block, 128, "same", "plain")
        and r["variant"] == "default"
    ]
    [row] = [r for r in launched if r["kernel"] == WS_KERNEL] or launched
    chosen = launch_table.lookup(*table_key(block, 128), "same")  # the block's own class
    assert row["tile"] == f"128x{chosen['block_n']}", (row, chosen)
    assert (row["mma"], row["loop_divisions"]) == ("HGMMA", 0), row
    assert row["spill_stores"] <= GPU_CHOSEN_MOST_SPILL_BYTES, row
    assert row["spill_loads"] <= GPU_CHOSEN_MOST_SPILL_BYTES, row


@pytest.mark.parametrize("minor", _versions())
@pytest.mark.parametrize(
    "block, ahead, plain",
    [
        pytest.param(1560, AHEAD_128, "default", id="tma-n128-B1560"),
        pytest.param(256, AHEAD_64, GOAL_VARIANT, id="tma-n64-B256"),
        pytest.param(1560, AHEAD_64, GOAL_VARIANT, id="tma-n64-B1560"),
        pytest.param(64, AHEAD_PAIRS, PAIRS, id="tma-pairs-n128-B64"),
    ],
)
def test_scores_ahead_issue_the_next_scores_under_the_softmax(
    report: Report, minor: str, block: int, ahead: str, plain: str
) -> None:
    # Against the same loop without it: fewer than half the instructions issued with no MMA in
    # flight, at most 1.25x the instructions, the same K/V buffers, no spills. (Triton waits for
    # each Q K^T MMA right after it; ptxas issues the softmax of the tile before under it.)
    version = report.version(minor)
    row = report.paged(version, block, variant=ahead)
    base = report.paged(version, block, variant=plain)
    assert row["tile"] == base["tile"], (row, base)
    assert row["loop_serial_instructions"] <= 0.5 * base["loop_serial_instructions"], (row, base)
    assert row["loop_instructions"] <= 1.25 * base["loop_instructions"], (row, base)
    assert row["shared_bytes"] == base["shared_bytes"], (row, base)
    # (The pair loop's buffers hold a block, not a tile: the report counts no tile buffers.)
    assert row["kv_buffers"] == base["kv_buffers"] == (None if ahead == AHEAD_PAIRS else 3), (
        row,
        base,
    )
    assert (row["spill_stores"], row["spill_loads"]) == (0, 0), row


def _quantized_cases(misses: dict) -> list:
    return [
        pytest.param(m, b, id=f"{m}-B{b}", marks=_misses(misses, (m, b)))
        for m, b in itertools.product(QUANTIZED_MODES, QUANTIZED_BLOCKS)
    ]


@pytest.mark.parametrize("mode, block", _quantized_cases(_TRITON36_QUANTIZED_SPILLS))
def test_triton36_quantized_64_key_tiles_without_spills(
    report: Report, mode: str, block: int
) -> None:
    # The GPU image's Triton takes the quantized modes' 64-key pointer loop at the bf16 tile
    # too (before the wide scale loads it spilled 250-480 bytes there and took 32-key tiles).
    row = report.paged(report.version("3.6"), block, kv=mode, variant=_pointer_variant(mode, block))
    assert row["kv_buffers"] == 3 and row["tile"] == "128x64", row
    assert (row["spill_stores"], row["spill_loads"]) == (0, 0), row


@pytest.mark.parametrize("minor", _versions())
@pytest.mark.parametrize("mode", QUANTIZED_TMA_MODES)
@pytest.mark.parametrize("block", QUANTIZED_TMA_BLOCKS)
def test_quantized_defaults_are_the_launch_tables(
    report: Report, monkeypatch, minor: str, mode: str, block: int
) -> None:
    # Whatever the table holds (compile evidence, or a GPU probe's choice), the report compiles
    # the launch the launcher makes: its tile, and descriptor loads where it takes the TMA loop.
    launcher = importlib.import_module("paged_video.kernels.paged_attention")
    monkeypatch.setattr(launcher, "interpreter_active", lambda: False)
    tiles = launcher.choose_tiles(
        block_size=block, head_dim=128, max_seqlen_q=4680, dtype=torch.bfloat16,
        dequantize=True, tma_ready=True,
        kv_dtype=torch.int8,
    )  # fmt: skip
    row = report.paged(report.version(minor), block, kv=mode)
    assert row["tile"] == f"{tiles['BLOCK_M']}x{tiles['BLOCK_N']}", (row, tiles)
    assert (row["tma_loads"] > 0) == tiles["TMA"], (row, tiles)
    assert (row["num_warps"], row["num_stages"]) == (tiles["num_warps"], tiles["num_stages"])


@pytest.mark.parametrize("features", ["gaps=1", "causal+key_limits"])
def test_masked_features_keep_the_pipeline(report: Report, features: str) -> None:
    triton = report.version("3.9")
    row = report.paged(triton, 1560, features=features)
    plain = report.paged(triton, 1560)
    assert (row["spill_stores"], row["mma"]) == (0, "HGMMA"), row
    assert (row["kv_buffers"], row["wait_depth"]) == (plain["kv_buffers"], plain["wait_depth"])
    assert row["loop_instructions"] <= 1.05 * plain["loop_instructions"], (row, plain)


@pytest.mark.parametrize("mode, block", _quantized_cases({}))
def test_quantized_mma_and_prefetch(report: Report, mode: str, block: int) -> None:
    triton = report.version("3.9")
    row = report.paged(triton, block, kv=mode)
    # Dequantizing: 16-bit wgmma only.
    assert row["mma"] == "HGMMA", row
    assert row["loop_divisions"] == 0, row
    # As many K/V tiles in flight as the bf16 kernel (the dequantizing launch adds a stage for it).
    plain = report.paged(triton, block)
    assert row["kv_buffers"] == plain["kv_buffers"] == 3, (row, plain)


@pytest.mark.parametrize("minor", _versions())
@pytest.mark.parametrize("mode", WIDE_HEAD_QUANTIZED["kv_modes"])
@pytest.mark.parametrize("block", WIDE_HEAD_QUANTIZED["block_sizes"])
def test_dequantizing_modes_at_head_dim_256_without_spills(
    report: Report, minor: str, mode: str, block: int
) -> None:
    # Scored through float16 query rows (int8 K under a bf16 q, up to 128 channels), the
    # (since deleted) e4m3 pool's 32-key loop at head_dim 256 spilled 20-108 bytes on Triton
    # 3.6 (2026-12-05); with bf16 K it spills none on either Triton.
    row = report.paged(report.version(minor), block, head_dim=256, kv=mode)
    assert row["tile"] == "64x32", row
    assert (row["spill_stores"], row["spill_loads"]) == (0, 0), row


@pytest.mark.parametrize("minor", _versions())
@pytest.mark.parametrize("mode", DEQUANT_TMA_MODES)
@pytest.mark.parametrize("block", DEQUANT_TMA_BLOCKS)
def test_dequantizing_tma_defaults_without_spills(
    report: Report, minor: str, mode: str, block: int
) -> None:
    # The table's 128-key TMA loop over keys-major scales: descriptor loads, no spills (it
    # spilled 8-32 bytes while its masked tiles ran after it), and at most 0.9x the 64-key
    # pointer loop's instructions per key (0.84-0.87x, 2026-12-05).
    triton = report.version(minor)
    row = report.paged(triton, block, kv=mode)
    pointer = report.paged(triton, block, kv=mode, variant=FORCED_CP_ASYNC)
    assert (row["tile"], row["tma_loads"] > 0) == ("128x128", True), row
    assert (row["spill_stores"], row["spill_loads"]) == (0, 0), row
    assert row["kv_buffers"] == pointer["kv_buffers"] == 3, (row, pointer)
    per_key = row["loop_instructions"] / 128
    assert per_key <= 0.9 * pointer["loop_instructions"] / 64, (row, pointer)


@pytest.mark.parametrize("minor", _versions())
def test_keys_major_pools_of_one_slot_blocks_read_as_slot_major(report: Report, minor: str) -> None:
    # Padded to 16 keys a row, the (since deleted) FP8-MMA's keys-major V at block 1 was
    # gathered a byte at a time (39 global loads an iteration on Triton 3.6, 623 instructions,
    # 16 bytes spilled); stored unpadded it is the slot-major pool and reads as one.
    triton = report.version(minor)
    keys_major = report.paged(triton, 1, kv="int8_keys")
    slot_major = report.paged(triton, 1, kv="int8")
    assert (keys_major["spill_stores"], keys_major["spill_loads"]) == (0, 0), keys_major
    assert keys_major["loop_global_loads"] <= slot_major["loop_global_loads"], keys_major
    assert keys_major["loop_instructions"] <= 1.03 * slot_major["loop_instructions"], (
        keys_major,
        slot_major,
    )


@pytest.mark.parametrize("mode, block", _quantized_cases(_QUANTIZED_SPILLS))
def test_quantized_no_spills(report: Report, mode: str, block: int) -> None:
    row = report.paged(report.version("3.9"), block, kv=mode, variant=_pointer_variant(mode, block))
    assert (row["spill_stores"], row["spill_loads"]) == (0, 0), row


# Per 64-key iteration, same tile, int32 offsets on both sides (2026-12-04): Triton 3.9
# 599/600/559/543 against 372 (fp8/int8/fp8_mma/int8_mma); 3.6 591/592/571/544 against 356.
# Before the wide scale loads, 1109-1158 on 3.9. Block 24's quantized loops now cost what the
# contiguous path's do (589/590/559/538 at block 64 on 3.9): the rest over 1.5x is the
# dequantization itself (code conversions, scale columns), at every block size. Cutting block
# 24 in pieces took the bf16 loop from 420 to 372 (393 to 356 on 3.6), the quantized ones from
# 624 to 599, so the ratio grew.
# After the plain scale loads (2026-12-04): 3.9 592/593/583/531/551/545 (fp8, int8, fp8_mma,
# fp8_mma_keys, int8_mma, int8_mma_keys); 3.6 661/662/679/615/617/575, its plain scale loads
# copying every thread's columns (about 70 instructions more; keys-major scales, two at a time).
# With e4m3 K scored through float16 query rows and the output's rows read again (2026-12-04,
# bench/COMPILE.md): 3.9 532/590/583/527/540/539; 3.6 603/665/682/617/619/579 (fp8 converted K
# to bfloat16 through float16, 4 instructions a pair against 1: 60 fewer on 3.9). FP8-MMA's
# query rows by descriptor and its unit per sequence (2026-12-05): 3.9 536/502, 3.6 616/562
# (fp8_mma, fp8_mma_keys; 586/538 and 686/616 with the tile maximum of the V scales).
# Each scale copied once (3.6) and int8 K converted to float16 by PTX (2026-12-05, fifth
# session, bench/COMPILE.md): every mode within 1.5x on both, 3.9 519/545/526/486/529/526 and
# 3.6 500/526/512/476/511/511 (fp8, int8, fp8_mma, fp8_mma_keys, int8_mma, int8_mma_keys).
# V converted to float16 for the 16-bit P V, its rows scaled there (2026-12-05, tenth
# session): 3.9 466/515/526/486/503/500, 3.6 448/497/512/476/484/485.


def _block24_cases() -> list:
    return [
        pytest.param(
            mode,
            minor,
            id=f"{mode}-{minor}",
            marks=_version_marks(minor),
        )
        for mode, minor in itertools.product(QUANTIZED_MODES, ("3.9", "3.6"))
    ]


@pytest.mark.parametrize("mode, minor", _block24_cases())
def test_block24_quantized_loop_within_1_5x_bf16(report: Report, minor: str, mode: str) -> None:
    triton = report.version(minor)
    row = report.paged(triton, 24, kv=mode)
    plain = report.paged(triton, 24)
    assert row["tile"] == plain["tile"], (row, plain)
    assert row["loop_instructions"] <= 1.5 * plain["loop_instructions"], (row, plain)


@pytest.mark.parametrize("minor", _versions())
@pytest.mark.parametrize("mode", QUANTIZED_TMA_MODES)
@pytest.mark.parametrize("block", QUANTIZED_TMA_BLOCKS)
def test_quantized_tma_loop_loads_codes_and_scales_through_descriptors(
    report: Report, minor: str, mode: str, block: int
) -> None:
    triton = report.version(minor)
    tma = report.paged(triton, block, kv=mode, variant=FORCED_TMA)
    pointers = report.paged(triton, block, kv=mode, variant=FORCED_CP_ASYNC)
    # K, V and both scale tiles by descriptor: no per-thread copies left in the loop.
    assert tma["tma_loads"] > 0 and pointers["tma_loads"] == 0, (tma, pointers)
    assert tma["loop_global_loads"] < pointers["loop_global_loads"], (tma, pointers)
    assert (tma["mma"], tma["kv_buffers"]) == (pointers["mma"], 3), (tma, pointers)
    # At 64 keys it is no longer the shorter loop on either Triton (2026-12-05: on 3.6 the
    # deleted FP8-MMA 497-507 against 447-465 at blocks 64/520/1560, INT8-MMA 551-562 against
    # 506-519, since the pointer loop copies each scale once; before, 536-554 against 560-572):
    # a GPU probe weighs them (bench/gpu_check.sh), and the table takes its 128-key tiles.


# FP8-MMA over keys-major pools at block 1560 spilled 4/4 bytes outside the loops (a lane
# quotient by 24 kept from one piece's masked loop to the other's) until its query rows were
# loaded rather than rounded in the kernel (kernels/query_codes.py, 2026-12-05).
_TRITON36_TMA_SPILLS: dict = {}


@pytest.mark.parametrize(
    "mode, block",
    [
        pytest.param(
            m,
            b,
            id=f"{m}-B{b}",
            marks=_version_marks("3.6") + _misses(_TRITON36_TMA_SPILLS, (m, b)),
        )
        for m, b in itertools.product(QUANTIZED_TMA_MODES, QUANTIZED_TMA_BLOCKS)
    ],
)
def test_triton36_quantized_tma_loop_without_spills(report: Report, mode: str, block: int) -> None:
    tma = report.paged(report.version("3.6"), block, kv=mode, variant=FORCED_TMA)
    assert (tma["spill_stores"], tma["spill_loads"]) == (0, 0), tma


# k8v8's unmasked loops read K's rows and the scales in the 8-bit MMA's key order
# (kernels/_attention_jit.py, _fp8_mma_key_order), so the probabilities feed P V as they lie in
# registers: the loop's shuffles are then the row maxima's and sums' butterflies, as in a
# 16-bit loop. Converted to the operand's layout they took 8 (64-key tiles) and 16 (128) more,
# with as many selects and byte permutes (2026-12-05: 22-27 instructions per 64 keys).
@pytest.mark.parametrize("minor", _versions())
def test_k8v8_probabilities_feed_the_mma_unmoved(report: Report, minor: str) -> None:
    triton = report.version(minor)
    attention = [r for r in report.rows if r["kernel"] == "paged_attention" and r["error"] == ""]
    ours = [r for r in attention if r["triton"] == triton]
    k8v8 = [r for r in ours if r["kv_mode"] == "k8v8_keys"]
    bf16 = [r["loop_shuffles"] for r in ours if r["kv_mode"] == "same" and r["loop_shuffles"]]
    assert k8v8 and bf16
    for row in k8v8:
        assert row["loop_shuffles"] <= min(bf16), row


@pytest.mark.parametrize("minor", _versions())
def test_k8v8_reads_query_rows_from_shared_memory(report: Report, minor: str) -> None:
    # The launcher rounds the query rows before the kernel (kernels/query_codes.py), which loads
    # them, so Q K^T takes them from shared memory and P is the only register operand: an MMA
    # per 32 keys. Rounded in the kernel, they stayed a register operand read back from shared
    # memory every tile (128 channels: 4 more register-operand MMAs, 4 ldmatrix and their
    # addresses, which ptxas spilled at the 128-key TMA loop on Triton 3.6). P feeds two: P V
    # and the row sums' MMA over a column of ones.
    row = report.paged(report.version(minor), K8V8_BLOCK, kv="k8v8_keys")
    keys = int(row["tile"].split("x")[1])
    assert row["mma"] == "QGMMA+IGMMA" and row["loop_register_a_mmas"] == 2 * keys // 32, row


@pytest.mark.parametrize("minor", _versions())
@pytest.mark.parametrize("kernel", ["query_codes", "value_units"])
def test_quantized_passes_compile(report: Report, minor: str, kernel: str) -> None:
    # The pass that rounds the query rows to int8 runs before each k8v8 (and k8v16) launch, and
    # only there; the one that takes the probability unit before every other quantized launch.
    # Both build without spills on both Tritons (no MMA).
    triton = report.version(minor)
    rows = [r for r in report.rows if r["kernel"] == kernel and r["triton"] == triton]
    modes = {r["kv_mode"] for r in report.rows if r["kernel"] == "paged_attention"} - {"same"}
    rounded = {m for m in modes if m.startswith(("k8v8", "k8v16"))}
    want = rounded if kernel == "query_codes" else modes - rounded
    assert {r["kv_mode"] for r in rows} == want, rows
    for row in rows:
        assert row["error"] == "" and (row["spill_stores"], row["spill_loads"]) == (0, 0), row
        assert (row["mma"], row["key_loops"]) == ("none", ""), row


# Per-thread global copies in the quantized 64-key pointer loops (2026-12-05): 6-12 on both
# Tritons, K's and V's code tiles (16 bytes a copy; 8 for block 24's 8-key pieces), the scale
# pairs (one each) and the table's entries. Loaded a column at a time, Triton 3.6 made every
# thread copy its own 16 columns of each (21-46 copies, 60-160 instructions more a tile).
QUANTIZED_MOST_LOOP_COPIES = 12


@pytest.mark.parametrize("minor", _versions())
@pytest.mark.parametrize("mode", QUANTIZED_MODES)
@pytest.mark.parametrize("block", QUANTIZED_BLOCKS)
def test_quantized_scales_are_copied_once(report: Report, minor: str, mode: str, block: int):
    row = report.paged(report.version(minor), block, kv=mode, variant=_pointer_variant(mode, block))
    assert row["tile"] == "128x64", row
    assert row["loop_global_loads"] <= QUANTIZED_MOST_LOOP_COPIES, row


# Barriers per hot-loop iteration, 2026-12-04: bf16 3 (Triton 3.9) and 2 (3.6); with the plain
# scale loads 4 and 2 (dequantizing, INT8-MMA) and 4 and 4 (FP8-MMA over keys-major V); the
# wide scale loads took 6-8 (3.9) and 10-14 (3.6). FP8-MMA over slot-major V transposes V
# through shared memory: 6 and 5 (4 and 2 without the tile maximum of the V scales).
QUANTIZED_MOST_BARRIERS = 4


@pytest.mark.parametrize("minor", _versions())
@pytest.mark.parametrize("mode", QUANTIZED_MODES)
@pytest.mark.parametrize("block", QUANTIZED_BLOCKS)
def test_quantized_scales_add_no_barriers(report: Report, minor: str, mode: str, block: int):
    # The pointer loop's scale loads (the TMA loop waits on its descriptor loads: 7-12).
    row = report.paged(report.version(minor), block, kv=mode, variant=_pointer_variant(mode, block))
    assert row["loop_barriers"] <= QUANTIZED_MOST_BARRIERS, row


# ---------------------------------------------------------------- the parsers, no compiling


def _sass(lines: list[tuple[int, str]]) -> str:
    return "\n".join(f"        /*{a:04x}*/                   {text} ;" for a, text in lines)


# An unmasked key loop (0x30..0xe0) whose mbarrier wait retries out of line after the exit
# (0x300..0x320), then a shorter masked key loop (0x100..0x120).
_PLANTED = [
    (0x00, "MOV R1, c[0x0][0x28]"),
    (0x10, "ISETP.GE.AND P0, PT, R2, 0x1, PT"),
    (0x20, "@!P0 BRA 0x100"),
    (0x30, "DEPBAR.LE SB0, 0x2"),
    (0x40, "IMAD.WIDE R4, R3, 0x2, R6"),
    (0x50, "LDGSTS.E.BYPASS.128 [R8], desc[UR4][R4.64], !P4"),
    (0x58, "LDGDEPBAR"),
    (0x60, "HGMMA.64x64x16.F32.BF16 R88, gdesc[UR8], RZ, !UPT"),
    (0x70, "SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR7+0x100], R10"),
    (0x80, "@!P1 BRA 0x300"),
    (0x90, "SHFL.BFLY PT, R10, R11, 0x1, 0x1f"),
    (0xA0, "IADD3 R12, P2, R12, R13, RZ"),
    (0xB0, "IADD3.X R14, R15, R16, RZ, P2, !PT"),
    (0xC0, "NOP"),
    (0xD0, "HGMMA.64x64x16.F32.BF16 R88, R40, gdesc[UR8], R88"),
    (0xE0, "@P0 BRA 0x30"),
    (0x100, "HGMMA.64x64x16.F32.BF16 R88, gdesc[UR8], R88"),
    (0x110, "FSEL R20, R20, -INF , !P3"),
    (0x120, "@P5 BRA 0x100"),
    (0x130, "EXIT"),
    (0x300, "SYNCS.PHASECHK.TRANS64 P1, [UR7+0x100], R10"),
    (0x310, "@!P1 BRA 0x300"),
    (0x320, "BRA 0x90"),
]


def test_planted_hot_loop_is_unmasked_not_smallest() -> None:
    measures = sass.analyse(_sass(_PLANTED))
    # 0x30..0xe0 without the NOP: 12 instructions; the masked loop has 3.
    assert measures["key_loops"] == "12,m3"
    assert measures["loop_instructions"] == 12
    assert measures["masked_loop_instructions"] == 3
    assert measures["wait_depth"] == 2
    # IMAD.WIDE, and the carry-out add with its .X half; one cp.async load (its group commit
    # is no load); the inline wait.
    assert measures["loop_int64_ops"] == 3
    assert measures["loop_global_loads"] == 1
    assert measures["loop_mbarrier_ops"] == 1
    assert measures["mma"] == "HGMMA"
    # 0x60 reads A from shared memory (one descriptor pair), 0xd0 from registers R40..
    assert measures["loop_register_a_mmas"] == 1
    assert measures["loop_shuffles"] == 1
    # Without its -inf select the second loop is unmasked too: the hot loop is the longest.
    unmasked = [(a, t.replace("-INF", "RZ")) for a, t in _PLANTED]
    assert sass.analyse(_sass(unmasked))["loop_instructions"] == 12
    assert sass.analyse(_sass(unmasked))["masked_loop_instructions"] is None


def test_planted_out_of_line_retry_is_not_a_loop_around_the_kernel() -> None:
    loops = sass.find_loops(sass.parse_sass(_sass(_PLANTED)))
    # The retry's jump back to 0x90 closes no loop; the retry spins on itself.
    assert [(loop.header, loop.size) for loop in loops] == [(0x30, 12), (0x100, 3), (0x300, 2)]
    assert [loop.header for loop in sass.key_loops(loops)] == [0x30, 0x100]


# A key loop whose P V MMA, issued last, runs on under the next iteration's first instruction;
# its Q K^T runs under one instruction until the wait for all.
_OVERLAP = [
    (0x00, "MOV R1, c[0x0][0x28]"),
    (0x10, "IADD3 R4, R4, 0x1, RZ"),
    (0x20, "HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8], RZ, !UPT"),
    (0x30, "MUFU.EX2 R10, R11"),
    (0x40, "WARPGROUP.DEPBAR.LE gsb0, 0x0"),
    (0x50, "FADD R12, R12, R13"),
    (0x60, "F2FP.BF16.F32.PACK_AB R14, R15, R16"),
    (0x70, "HGMMA.64x64x16.F32.BF16 R88, R14, gdesc[UR8], R88"),
    (0x80, "ISETP.GE.AND P0, PT, R4, 0x4, PT"),
    (0x90, "@!P0 BRA 0x10"),
    (0xA0, "EXIT"),
]


@pytest.mark.parametrize(
    ("change", "serial"),
    [
        pytest.param({}, 2, id="fadd-and-f2fp-between-the-wait-and-p-v"),
        # A wait that leaves one group in flight does not end the Q K^T.
        pytest.param({0x40: "WARPGROUP.DEPBAR.LE gsb0, 0x1"}, 0, id="partial-wait"),
        # A warp-level MMA is synchronous: the loop's top then runs with nothing in flight.
        pytest.param({0x70: "HMMA.16816.F32.BF16 R88, R14, R20, R88"}, 6, id="warp-level-p-v"),
    ],
)
def test_planted_serial_instructions(change: dict[int, str], serial: int) -> None:
    lines = [(a, change.get(a, text)) for a, text in _OVERLAP]
    assert sass.analyse(_sass(lines))["loop_serial_instructions"] == serial


def test_planted_producer_loop_and_setmaxnreg() -> None:
    producer = [
        (0x00, "USETMAXREG.DEALLOC.CTAPOOL 0x28"),
        (0x10, "UTMALDG.2D [UR8], [UR4]"),
        (0x20, "SYNCS.ARRIVE.TRANS64 RZ, [UR7], RZ"),
        (0x30, "@P0 BRA 0x10"),
        (0x40, "USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xe8"),
        (0x50, "EXIT"),
    ]
    measures = sass.analyse(_sass(producer))
    assert measures["producer_loop_instructions"] == 3
    assert measures["tma_loads"] == 1
    assert measures["setmaxnreg"] == "-40,+232"
    assert measures["loop_instructions"] is None and measures["mma"] == "none"


def test_64bit_integer_ops() -> None:
    def wide(text: str) -> bool:
        return sass.is_64bit_integer(sass.parse_sass(_sass([(0, text)]))[0])

    for text in (
        "IMAD.WIDE.U32 R2, R3, 0x4, R4",
        "LEA.HI.X.SX32 R5, R6, UR7, 0x1, P0",
        "IADD3 R2, P0, R3, R4, RZ",
        "UIADD3.64 UR24, UR12, 0x2, URZ",
        "SHF.L.U64.HI R2, R3, 0x1, R4",
        "SHF.R.S32.HI R2, RZ, 0x1f, R3",
        "ISETP.GE.U32.AND.EX P0, PT, R2, R3, PT, P1",
    ):
        assert wide(text), text
    for text in (
        "IADD3 R2, R3, R4, RZ",
        "IMAD R2, R3, R4, RZ",
        "FADD R2, R3, R4",
        "SHF.L.U32 R2, R3, 0x1, RZ",
    ):
        assert not wide(text), text


def test_spill_bytes_from_local_memory() -> None:
    text = _sass(
        [
            (0x00, "STL [R1], R2"),
            (0x10, "STL.64 [R1+0x8], R4"),
            (0x20, "LDL.128 R8, [R1]"),
            (0x30, "LDL.LU R2, [R1+0x10]"),
        ]
    )
    assert sass.spill_bytes(sass.parse_sass(text)) == (12, 20)


def test_global_access_widths_of_plain_loads_and_stores() -> None:
    text = _sass(
        [
            (0x00, "LDG.E.64 R2, desc[UR4][R2.64]"),
            (0x10, "@P0 LDG.E.128 R4, desc[UR4][R6.64]"),
            (0x20, "LDGSTS.E [R8], desc[UR4][R4.64]"),  # cp.async: not counted
            (0x28, "LDGDEPBAR"),
            (0x30, "STG.E.128 desc[UR4][R10.64], R4"),
            (0x40, "STG.E.U16 desc[UR4][R12.64], R2"),
            (0x50, "LDG.E.U16 R3, desc[UR4][R14.64]"),
            (0x60, "STG.E desc[UR4][R16.64], R3"),
        ]
    )
    widths = sass.global_access_bytes(sass.parse_sass(text))
    assert widths == "16+4+2/16+8+2"
    assert not compile_report.full_width({"global_access_bytes": widths})  # a 2-byte store
    assert compile_report.full_width({"global_access_bytes": "16/16+8"})
    assert not compile_report.full_width({"global_access_bytes": "16/8+4"})
    assert sass.global_access_bytes(sass.parse_sass(_sass([(0, "NOP")]))) == "-/-"


def test_copy_kernels_move_16_bytes_an_access_at_every_block_size(tmp_path) -> None:
    # The pools a cache of each shipped block size holds: the same kernel, 16-byte data loads
    # and stores (the index loads narrower), so write_slots' H200 spread (45-91% of a copy)
    # is not its machine code (bench/COMPILE.md).
    argv = ["compile", "--kernels", "write_slots,gather_blocks", "--workers", "1"]
    assert main([*argv, "--block-sizes", "16,24,520,1560", "--out", str(tmp_path)]) == 0
    with open(tmp_path / "compile.csv", newline="") as stream:
        rows = list(csv.DictReader(stream))
    assert {(r["kernel"], r["block_size"]) for r in rows} == {
        (kernel, str(block))
        for kernel in ("write_slots", "gather_blocks")
        for block in (16, 24, 520, 1560)
    }
    assert all(compile_report.full_width(r) and not r["error"] for r in rows), rows


def test_regrow_kernels_compile_without_spills(tmp_path) -> None:
    # kernels.regrow's two launches (a later write's check, the codes' rescale over a cache's
    # pools) build for sm_90a at an odd block and the frame block, no spills.
    argv = ["compile", "--kernels", "regrow", "--workers", "1", "--heads", "4"]
    assert main([*argv, "--block-sizes", "7,1560", "--out", str(tmp_path)]) == 0
    with open(tmp_path / "compile.csv", newline="") as stream:
        rows = list(csv.DictReader(stream))
    assert {(r["kernel"], r["block_size"]) for r in rows} == {
        (f"regrow/{kernel}_kernel", str(block))
        for kernel in ("regrow_rule", "regrow_codes")
        for block in (7, 1560)
    }
    assert all(not r["error"] and r["spill_stores"] == r["spill_loads"] == "0" for r in rows)


def test_ptxas_log_contradiction_is_refused() -> None:
    log = (
        "ptxas info    : Function properties for k\n"
        "    144 bytes stack frame, 140 bytes spill stores, 176 bytes spill loads\n"
        "ptxas info    : Used 255 registers, used 1 barriers\n"
    )
    compile_report.check_ptxas_log(log, 255, (140, 176))
    compile_report.check_ptxas_log("", 12, (0, 0))  # from Triton's cache: nothing to check
    with pytest.raises(RuntimeError, match="spill"):
        compile_report.check_ptxas_log(log, 255, (0, 0))
    with pytest.raises(RuntimeError, match="registers"):
        compile_report.check_ptxas_log(log, 254, (140, 176))


def test_wgmma_notes_from_ptxas_log() -> None:
    used = "ptxas info    : Used 255 registers, used 1 barriers\n"
    injected = (
        "ptxas info    : (C7517) wgmma.wait_group is injected in around line 872 by compiler to "
        "allow use of registers defined by GMMA in function 'k'\n"
    )
    serialized = (
        "ptxas info    : (C7514) Potential Performance Loss: wgmma.mma_async instructions are "
        "serialized due to non wgmma instructions reading accumulator registers of  a wgmma "
        "between start and end of the pipeline stage in the function 'k' in line 0\n"
    )
    notes = compile_report.wgmma_notes
    assert notes(used) == {"wgmma_serialized": False, "wgmma_injected_waits": 0}
    assert notes(injected * 2 + used) == {"wgmma_serialized": False, "wgmma_injected_waits": 2}
    assert notes(serialized + used)["wgmma_serialized"] is True
    # From Triton's cache there is no log: unknown, not "none".
    assert notes("") == {"wgmma_serialized": None, "wgmma_injected_waits": None}


def test_no_launch_has_its_mmas_serialized(report: Report) -> None:
    # ptxas serializes warpgroup MMAs (a wait after each) where an instruction may read an
    # accumulator in flight: every overlap of an MMA with other work is then gone, which no
    # instruction count shows. No launch the report compiles may have it, and none of the
    # launcher's own (default) launches may have waits ptxas put in on its own.
    checked = [r for r in report.rows if r["wgmma_serialized"] is not None]
    assert len(checked) > len(report.rows) // 2
    assert not [r for r in checked if r["wgmma_serialized"]]
    attention = [r for r in checked if r["kernel"].startswith("paged_attention")]
    defaults = [r for r in attention if r["variant"] == "default"]
    assert defaults
    assert not [r for r in defaults if r["wgmma_injected_waits"]]


def test_partitions_from_ttgir() -> None:
    ttgir = """module attributes {"ttg.num-warps" = 4 : i32} {
    ttg.warp_specialize(%a) attributes {requestedRegisters = array<i32: 232, 232>}
    default {
      ttng.async_tma_copy_global_to_local %d[%x] %b, %c, %true
      ttg.warp_yield
    }
    partition0(%arg0: i32 loc("x"(#loc))) num_warps(4) {
      %s = ttng.warp_group_dot %a, %b, %c
      ttg.warp_return
    }
    partition1(%arg0: i32) num_warps(2) {
      ttg.warp_return
    } : (i32) -> ()
"""
    assert compile_report.partitions(ttgir) == {
        "partitions": 3,
        "partition_warps": "4+4+2",
        "partition_roles": "load,mma,other",
    }
    plain = 'module attributes {"ttg.num-warps" = 8 : i32} {\n %0 = tt.dot %a, %b\n'
    assert compile_report.partitions(plain)["partitions"] == 1


def test_ratios_per_key_against_as_many_mma_warps() -> None:
    def row(kernel: str, tile: str, warps: int, consumers: int, loops: str, **more) -> dict:
        hot = max(int(s) for s in loops.split(",") if s.isdigit())
        return dict(
            kernel=kernel, triton="3.9.0", head_dim=128, dtype="bf16", tile=tile,
            num_warps=warps, consumer_warps=consumers, num_stages=3, key_loops=loops,
            loop_instructions=hot, **more,
        )  # fmt: skip

    rows = [
        row("anchor", "128x64", 8, 8, "350"),
        row("anchor", "128x64", 4, 4, "600"),
        row("tutorial_ws", "128x64", 4, 8, "320,360"),
        # Warp-specialized at 4 launch warps, two 4-warp consumers: the 8-warp anchor is its own.
        row("paged_attention", "128x64", 4, 8, "385,m500"),
        row("paged_attention", "128x128", 8, 8, "700,m900"),  # no anchor at this tile
    ]
    compile_report.add_ratios(rows)
    assert (rows[3]["vs_anchor"], rows[3]["vs_tutorial"]) == (1.1, round(385 / 320, 3))
    # Per key: 700 instructions for 128 keys against the tutorial's 320 for 64.
    assert (rows[4]["vs_anchor"], rows[4]["vs_tutorial"]) == (None, round(700 / 640, 3))
    assert rows[0]["vs_anchor"] is None and rows[2]["vs_tutorial"] is None


def test_kv_buffers_from_ttgir() -> None:
    ttgir = (
        "%0 = ttg.local_alloc : () -> !ttg.memdesc<3x64x128xbf16, #shared, #smem, mutable>\n"
        "%1 = ttg.local_alloc : () -> !ttg.memdesc<2x128x64xbf16, #shared, #smem, mutable>\n"
        "%2 = ttg.local_alloc %q : () -> !ttg.memdesc<128x128xbf16, #shared, #smem>\n"
    )
    assert compile_report.kv_buffers(ttgir, 64, 128) == 3
    assert compile_report.kv_buffers(ttgir, 32, 128) is None


def test_configs_are_labelled() -> None:
    configs = compile_report.configs_for(
        kernels=("paged_attention", "write_slots"),
        block_sizes=(64,),
        kv_modes=("same", "int8"),
        launches=({}, {"variant": "tma", "block_n": 128}),
    )
    assert [(c.kernel, c.kv_mode, compile_report.variant_label(c.launch)) for c in configs] == [
        ("paged_attention", "same", "default"),
        ("paged_attention", "same", "tma+block_n=128"),
        ("paged_attention", "int8", "default"),
        ("paged_attention", "int8", "tma+block_n=128"),
        ("write_slots", "same", "default"),
    ]
    gapped = compile_report.configs_for(kernels=("paged_attention",), causal=True, gaps=2)[0]
    assert compile_report.features_label(gapped) == "causal+gaps=2"
    with pytest.raises(ValueError, match="kv_modes"):
        compile_report.configs_for(kv_modes=("fp4",))
    assert compile_report.parse_launch("variant=ws,block_n=128,x=true") == {
        "variant": "ws",
        "block_n": 128,
        "x": True,
    }


# ---------------------------------------------------------------- the command line


@pytest.mark.parametrize(
    ("argv", "named", "says"),
    [
        (["--target", "rocm:942"], "--target", "cuda:90"),
        (["--out", "{file}"], "--out", "is a file"),
        (["--out", "{file}/sub"], "--out", "cannot be created"),
        (["--python", "{tmp}/no-python"], "--python", "not an executable"),
        (["--python", "no-such-python-on-path"], "--python", "not an executable"),
        (["--triton-venv", "{tmp}"], "--triton-venv", "not a virtual environment"),
        (["--launch", "tile=big"], "--launch", "no keyword 'tile'"),
        (["--launch", "causal=true"], "--launch", "report's own options"),
        (["--launch", "block_n"], "--launch", "NAME=VALUE"),
        (["--launch", "SCORE_BITS=1"], "--launch", "SCORE_BITS is true or false"),
        (["--launch", "SCORE_BIT=true"], "--launch", "no keyword 'SCORE_BIT'"),
    ],
)
def test_bad_arguments_are_refused_in_one_line(capsys, tmp_path, argv, named, says) -> None:
    file = tmp_path / "a-file"
    file.write_text("")
    argv = [a.format(file=file, tmp=tmp_path) for a in argv]
    out = [] if "--out" in argv else ["--out", str(tmp_path / "out")]
    with pytest.raises(SystemExit) as exit_info:
        main(["compile", *argv, *out])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert named in error and says in error, error
    assert not (tmp_path / "out").exists()  # refused before anything was written


def test_out_is_a_folder_created_for_compile_csv(report: Report, tmp_path, capsys) -> None:
    out = tmp_path / "new" / "folder"
    # One block size: write_slots is compiled at every block size asked for (all shipped ones
    # by default), and this test is about the output folder.
    argv = ["compile", "--kernels", "write_slots", "--block-sizes", "16", "--heads", "4"]
    argv += ["--workers", "1"]
    assert main([*argv, "--python", sys.executable, "--out", str(out)]) == 0
    with open(out / "compile.csv", newline="") as stream:
        rows = list(csv.DictReader(stream))
    assert [(r["kernel"], r["triton"], r["error"]) for r in rows] == [
        ("write_slots", report.version("3.9"), "")
    ]
    assert list(rows[0]) == list(compile_report.COLUMNS)
    assert f"wrote {out / 'compile.csv'}" in capsys.readouterr().out


# ---------------------------------------------------------------- the one-switch 8-bit formats

# k8v8 and k8v16 over the pools PagingConfig(kv_format=...) lays out (K's scales keys-major,
# k8v8's V keys-major), the launcher's own launch: at the frame block (128-key TMA tiles) and at
# block 24 (64-key tiles from pieces of 16 + 8). Both Tritons build them with an 8-bit MMA for
# Q K^T, an FP8 (k8v8) or 16-bit (k8v16) one for P V, no spills (2026-12-06, Triton 3.9.0 and
# 3.6.0; bench/COMPILE.md).
EIGHT_BIT_MMAS = {"k8v8_keys": "QGMMA+IGMMA", "k8v16_keys": "HGMMA+IGMMA"}
EIGHT_BIT_BLOCKS = (16, 24, 1560)
# The spills measured and kept (docs/quantization.md, "Row sums by MMA"): (Triton minor, K/V
# mode, block, launch) -> the most bytes stored, loaded. k8v8's row-sum MMA holds 8 registers a
# thread beside the 128-key loop of gathered blocks (the rows path, block 16): Triton 3.9 keeps
# 5 values in local memory (2 loads a tile in the hot loop), 3.6 (the GPU image's) 1-2 around
# the loops.
KNOWN_SPILLS = {
    ("3.9", "k8v8_keys", 16, "default"): (20, 20),
    ("3.6", "k8v8_keys", 16, "default"): (8, 8),
    ("3.6", "k8v8_keys", 16, "SCORE_BITS=True"): (4, 4),
}


def check_spills(row: dict, minor: str, mode: str, block: int, variant: str = "default") -> None:
    """No spills, or no more than the kept ones (``KNOWN_SPILLS``), which must still spill."""
    spills = (row["spill_stores"], row["spill_loads"])
    known = KNOWN_SPILLS.get((minor, mode, block, variant))
    if known is None:
        assert spills == (0, 0), row
    else:
        assert spills != (0, 0), f"{(minor, mode, block, variant)} spills no more: drop it"
        assert spills[0] <= known[0] and spills[1] <= known[1], row


# The probe's +bits twin (the kernel's SCORE_BITS): at blocks 16 and 1560 k8v8's 128-key loop
# with the scores a tile ahead and k8v16's plain one; at block 24 both formats' 64-key
# P-V-behind loops.
SCORE_BITS_LAUNCH = {"SCORE_BITS": True}


# The 64-key loop that runs each tile's P V MMA under the next tile's softmax
# (_attend_pv_behind), at the frame block: the launch the GPU probe times beside the table's
# 128-key loop there.
PV_BEHIND_LAUNCH = {"block_n": 64}
PV_BEHIND_BLOCK = 1560


def _eight_bit_configs() -> list[compile_report.Config]:
    """Both Tritons: the shipped geometry with and without ``SCORE_BITS``, the 64-key
    P-V-behind loop at the frame block, then the tests' awkward shapes (``AWKWARD_EIGHT_BIT``)."""
    shipped = compile_report.configs_for(
        kernels=("paged_attention",),
        block_sizes=EIGHT_BIT_BLOCKS,
        kv_modes=tuple(EIGHT_BIT_MMAS),
        launches=({}, SCORE_BITS_LAUNCH),
    )
    pv_behind = compile_report.configs_for(
        kernels=("paged_attention",),
        block_sizes=(PV_BEHIND_BLOCK,),
        kv_modes=tuple(EIGHT_BIT_MMAS),
        launches=(PV_BEHIND_LAUNCH,),
    )
    awkward = [
        config
        for block, mode in AWKWARD_EIGHT_BIT
        for config in compile_report.configs_for(
            kernels=("paged_attention",),
            block_sizes=(block,),
            head_dims=(AWKWARD_HEAD_DIM,),
            heads=4,
            gqa_group=2,
            max_seqlen_q=100,
            causal=True,
            key_limits=True,
            gaps=1,
            kv_modes=(mode,),
        )
    ]
    return shipped + pv_behind + awkward


@pytest.mark.parametrize("minor", _versions())
@pytest.mark.parametrize("mode", EIGHT_BIT_MMAS)
@pytest.mark.parametrize("block", EIGHT_BIT_BLOCKS)
def test_eight_bit_formats_build_on_both_tritons(
    report: Report, minor: str, mode: str, block: int
) -> None:
    triton = report.version(minor)
    row = report.paged(triton, block, kv=mode)
    assert row["mma"] == EIGHT_BIT_MMAS[mode], row
    assert row["loop_shared_stores"] == 0, row
    check_spills(row, minor, mode, block)
    # The pass before the kernel that rounds the query rows to int8 codes builds too.
    [codes] = [
        r
        for r in report.rows
        if (r["kernel"], r["triton"], r["kv_mode"], r["block_size"], r["variant"], r["head_dim"])
        == ("query_codes", triton, mode, block, "default", 128)
    ]
    assert codes["error"] == "" and codes["mma"] == "none", codes


@pytest.mark.parametrize("minor", _versions())
@pytest.mark.parametrize("mode", EIGHT_BIT_MMAS)
def test_p_v_under_the_next_softmax_meets_the_serial_goal(
    report: Report, minor: str, mode: str
) -> None:
    # Issue 45's compile goal: per key, at most 1.1x the instructions bf16's default loop
    # issues with no MMA in flight. The 64-key loop meets it at the frame block on both
    # Tritons (2026-12-07: 0.71-0.82x); the table's 128-key loop does not (k8v8: 1.23x on 3.9,
    # 1.30x on 3.6) but issues fewer instructions in all, which bounds an 8-bit loop too
    # (docs/quantization.md, "What bounds an 8-bit loop"): which of the two is faster is the
    # GPU probe's question.
    triton = report.version(minor)
    row = report.paged(triton, PV_BEHIND_BLOCK, kv=mode, variant="block_n=64")
    bf16 = report.paged(triton, PV_BEHIND_BLOCK, variant="default")
    assert (row["mma"], row["tile"]) == (EIGHT_BIT_MMAS[mode], "128x64"), row
    assert row["loop_shared_stores"] == 0, row
    check_spills(row, minor, mode, PV_BEHIND_BLOCK, "block_n=64")
    serial = "loop_serial_instructions"
    assert _per_key(row, serial) <= 1.1 * _per_key(bf16, serial), (row, bf16)


# The CUDA tests' shapes beyond the shipped geometry, in both 8-bit formats: head_dim 80 (a
# padded head), GQA 2 and every masked feature (causal, per-row key limits, a key gap), at a block
# cut into pieces (7 = 4 + 2 + 1) and at the frame block. A kernel path that only a GPU compiles
# fails here, as the FP8 MMA's 16-key tiles did on the H200 (bench/RESULTS.md).
AWKWARD_EIGHT_BIT = ((7, "k8v8_keys"), (1560, "k8v16_keys"))
AWKWARD_HEAD_DIM = 80
AWKWARD_FEATURES = "causal+key_limits+gaps=1"


@pytest.mark.parametrize("minor", _versions())
@pytest.mark.parametrize("block, mode", AWKWARD_EIGHT_BIT)
def test_eight_bit_formats_build_at_the_tests_awkward_shapes(
    report: Report, minor: str, block: int, mode: str
) -> None:
    triton = report.version(minor)
    row = report.paged(triton, block, head_dim=AWKWARD_HEAD_DIM, kv=mode, features=AWKWARD_FEATURES)
    assert row["kv_heads"] == 2 and row["mma"] == EIGHT_BIT_MMAS[mode], row


@pytest.mark.parametrize("minor", _versions())
@pytest.mark.parametrize("mode", EIGHT_BIT_MMAS)
@pytest.mark.parametrize("block", EIGHT_BIT_BLOCKS)
def test_score_bits_take_the_scores_with_no_conversion(
    report: Report, minor: str, mode: str, block: int
) -> None:
    # Each score's int-to-float conversion (I2FP) becomes an integer add (and the K scale's
    # multiply an FFMA with a per-column addend): none left in the hot loop, the exponentials
    # and MMAs as they were, at most 1.1x the loop's instructions (an addend a column), no
    # spills. The conversions counted in the default loop: one a score of the thread's tile.
    triton = report.version(minor)
    base = report.paged(triton, block, kv=mode)
    row = report.paged(triton, block, kv=mode, variant="SCORE_BITS=True")
    rows, keys = map(int, base["tile"].split("x"))
    scores_per_thread = rows * keys // (32 * base["num_warps"])
    assert base["loop_int_to_float"] == scores_per_thread, base
    assert row["loop_int_to_float"] == 0, row
    assert row["loop_exponentials"] == base["loop_exponentials"] >= scores_per_thread, row
    assert (row["mma"], row["tile"]) == (base["mma"], base["tile"]), row
    assert row["loop_instructions"] <= 1.1 * base["loop_instructions"], (row, base)
    check_spills(row, minor, mode, block, "SCORE_BITS=True")

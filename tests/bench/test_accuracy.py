"""``python -m paged_video.bench accuracy`` on a tiny geometry: the metrics, the goal, the rows,
the CSV."""

from __future__ import annotations

import csv
import math

import pytest
import torch

from paged_video import reference
from paged_video.bench import accuracy
from paged_video.bench.accuracy import (
    ACCURACY_COLUMNS,
    AccuracyConfig,
    Variant,
    attend,
    make_data,
    metrics,
    run_accuracy,
    smoothing_mean,
)
from paged_video.bench.cli import main

# One query frame of 8 tokens over 3 frames of keys, blocks of 5 (a frame straddles blocks).
TINY = AccuracyConfig(
    heads=2, head_dim=16, chunk_size=8, sink_chunks=1, window_chunks=2, block_size=5
)


def test_metrics_on_a_case_worked_by_hand():
    expected = torch.tensor([[1.0, 1.0], [2.0, 0.0]])
    output = torch.tensor([[1.0, 2.0], [2.0, 0.0]])
    m = metrics(output, expected)
    # o.r = 1 + 2 + 4 = 7, |o| = 3, |r| = sqrt(6); sum|o - r| = 1, sum|r| = 4.
    assert m.cosine == pytest.approx(7 / (3 * math.sqrt(6)))
    assert m.rel_l1 == pytest.approx(0.25)
    assert m.max_abs_error == 1.0
    assert not m.meets_goal
    same = metrics(expected, expected.double())
    assert (same.cosine, same.rel_l1, same.max_abs_error) == (pytest.approx(1.0), 0.0, 0.0)
    assert same.meets_goal


def test_the_goal_needs_both_cosine_and_rel_l1_and_nan_meets_nothing():
    assert accuracy.Metrics(0.9995, 0.02, 1.0).meets_goal
    assert not accuracy.Metrics(0.9994, 0.01, 0.0).meets_goal
    assert not accuracy.Metrics(0.99999, 0.021, 0.0).meets_goal
    nan = metrics(torch.tensor([math.nan, 1.0]), torch.tensor([1.0, 1.0]))
    assert not nan.meets_goal


def test_variants_are_the_baseline_then_each_format_mode_and_smoothing():
    labels = [v.label for v in accuracy.variants(("e4m3", "int8"), (False, True))]
    assert labels == [
        "bf16 pool",
        "e4m3 dequant",
        "e4m3 dequant smooth-K",
        "e4m3 fp8-mma",
        "e4m3 fp8-mma smooth-K",
        "int8 dequant",
        "int8 dequant smooth-K",
    ]


def test_k_outliers_offset_a_few_channels_of_k_only():
    plain, outliers = make_data("random", TINY), make_data("k-outliers", TINY)
    assert torch.equal(plain.q, outliers.q) and torch.equal(plain.values, outliers.values)
    offset = (outliers.keys - plain.keys).mean(dim=0)  # (heads, head_dim)
    shifted = offset.abs() > 5
    assert shifted.sum(dim=1).tolist() == [accuracy.OUTLIER_CHANNELS] * TINY.heads
    low, high = accuracy.OUTLIER_OFFSET
    assert bool((offset.abs()[shifted] >= low - 0.5).all() and (offset.abs() <= high + 0.5).all())
    for x in (outliers.q, outliers.keys, outliers.values):  # bf16-rounded
        assert torch.equal(x, x.to(torch.bfloat16).float())


def test_a_smoothed_row_is_the_kernel_over_codes_of_k_minus_the_first_frame_mean():
    """The bench hands the kernels the data and the mean it says: the output equals float64
    attention over the oracle's codes of (K - mean) and V (softmax ignores the shift)."""
    data = make_data("k-outliers", TINY)
    mean = smoothing_mean(data.keys, TINY.chunk_size)
    assert torch.allclose(mean, data.keys[: TINY.chunk_size].mean(dim=0))
    dtype = torch.float8_e4m3fn
    keys = reference.quantize.dequantize(
        *reference.quantize.quantize(data.keys, dtype, smooth=mean)
    )
    values = reference.quantize.dequantize(*reference.quantize.quantize(data.values, dtype))
    want = reference.dense_attention(data.q, keys, values)
    got = attend(Variant("e4m3", smooth=True), data, TINY)
    assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max()


@pytest.fixture(scope="module")
def tiny_rows(tmp_path_factory):
    csv_path = tmp_path_factory.mktemp("accuracy") / "accuracy.csv"
    return csv_path, run_accuracy(TINY, csv_path)


def test_every_row_is_measured_and_written_with_provenance(tiny_rows):
    csv_path, rows = tiny_rows
    assert [(r["data"], r["format"], r["mode"], r["k_smooth"]) for r in rows[:7]] == [
        ("random", "bf16", "", "off"),
        ("random", "e4m3", "dequant", "off"),
        ("random", "e4m3", "dequant", "on"),
        ("random", "e4m3", "fp8-mma", "off"),
        ("random", "e4m3", "fp8-mma", "on"),
        ("random", "int8", "dequant", "off"),
        ("random", "int8", "dequant", "on"),
    ]
    assert [r["data"] for r in rows[7:]] == ["k-outliers"] * 7
    with open(csv_path, newline="") as stream:
        reader = csv.DictReader(stream)
        assert tuple(reader.fieldnames) == ACCURACY_COLUMNS
        written = list(reader)
    assert len(written) == 14
    for row in written:
        assert row["kv_tokens"] == "24" and row["q_rows"] == "8" and row["block_size"] == "5"
        assert row["torch"] == torch.__version__ and row["commit"] and row["timestamp"]
        assert row["figures"] and row["device"]
        assert row["meets_goal"] in ("yes", "no")


def test_the_bf16_pool_meets_the_goal_and_quantized_pools_lose_some(tiny_rows):
    _, rows = tiny_rows
    for row in rows:
        if row["format"] == "bf16":
            assert row["cosine"] > 1 - 1e-9 and row["rel_l1"] < 1e-5 and row["meets_goal"] == "yes"
        else:
            assert 0.9 < row["cosine"] < 1 - 1e-9 and row["rel_l1"] > 1e-4
    by = {(r["data"], r["format"], r["mode"], r["k_smooth"]): r for r in rows}
    # K's channel offsets cost int8 most: smoothing takes them out.
    raw = by["k-outliers", "int8", "dequant", "off"]["rel_l1"]
    assert by["k-outliers", "int8", "dequant", "on"]["rel_l1"] < raw / 2


def test_a_corrupted_output_is_flagged_as_missing_the_goal(tmp_path):
    def corrupted(variant, data, config):
        out = attend(variant, data, config)
        return out * 1.05 if variant.format == "bf16" else out

    config = AccuracyConfig(**{**TINY.__dict__, "data": ("random",), "formats": ()})
    (row,) = run_accuracy(config, tmp_path / "a.csv", attend_fn=corrupted)
    assert row["rel_l1"] == pytest.approx(0.05, rel=1e-3)
    assert row["cosine"] == pytest.approx(1.0)  # a scaled output keeps its direction
    assert row["meets_goal"] == "no"
    assert "MISSES" in accuracy.format_rows([row])
    markdown = accuracy.format_rows([row], markdown=True).splitlines()
    assert markdown[0].startswith("| data | format |") and markdown[1].startswith("| --- |")
    assert markdown[2].startswith("| random | bf16 | - | off | 1.000000 | 5.00% |")


def test_the_command_prints_the_table_and_names_a_query_subset(tmp_path, capsys):
    argv = ["accuracy", "--heads", "1", "--head-dim", "16", "--chunk-size", "8"]
    argv += ["--sink-chunks", "1", "--window-chunks", "1", "--block-size", "4", "--queries", "3"]
    argv += ["--data", "random", "--formats", "int8", "--smoothing", "on", "--out", str(tmp_path)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "the first 3 of the frame's 8 queries (a subset)" in printed
    assert "of the shipped 40" in printed or "shipped model has 40" in printed
    table = [line for line in printed.splitlines() if line.startswith("random")]
    assert [line.split()[:4] for line in table] == [
        ["random", "bf16", "-", "off"],
        ["random", "int8", "dequant", "on"],
    ]
    assert (tmp_path / "accuracy.csv").exists()


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--data", "gaussian"], "--data"),
        (["--formats", "e5m2"], "--formats"),
        (["--smoothing", "maybe"], "--smoothing"),
        (["--heads", "0"], "--heads"),
        (["--head-dim", "512"], "--head-dim"),
    ],
)
def test_bad_accuracy_arguments_are_rejected_by_name(capsys, argv, named):
    with pytest.raises(SystemExit) as exit_info:
        main(["accuracy", *argv])
    assert exit_info.value.code == 2
    assert named in capsys.readouterr().err

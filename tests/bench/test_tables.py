"""The ratio table, the noise mark, ``compare`` and the one-line errors, on hand-made rows."""

from __future__ import annotations

import re

import pytest

from paged_video.bench.cli import main
from paged_video.bench.compare import compare_rows, verdict
from paged_video.bench.results import noise_verdict, read_rows, write_rows
from paged_video.bench.table import format_ratios, format_table, ratio_cases, sig3
from tests.bench.rows import STEADY_CEILINGS, ceiling, measured


def _case_rows(block_size: int, ours: float, flash: float, cudnn: float) -> list:
    return [
        measured("paged_attention", "triton", block_size, ours, role="ours"),
        measured("paged_attention", "reference", block_size, ours * 100, role="oracle"),
        measured("paged_attention", "sdpa-cudnn", block_size, cudnn),
        measured("paged_attention", "sdpa-flash", block_size, flash),
        measured(
            "paged_attention",
            "sdpa-best",
            block_size,
            min(flash, cudnn),
            role="best-of",
            backend="sdpa-flash" if flash < cudnn else "sdpa-cudnn",
        ),
    ]


ROWS = [
    *STEADY_CEILINGS[:2],
    *_case_rows(16, ours=2.0, flash=3.0, cudnn=3.5),  # 1.5x
    *_case_rows(1560, ours=4.0, flash=3.8, cudnn=3.0),  # 0.75x: below the goal
    measured("write_slots", "triton", 16, 0.5, role="ours"),
    measured("write_slots", "torch", 16, 1.0),
    measured("write_slots", "copy", 16, 0.4, role="bound"),
    *STEADY_CEILINGS[2:],
]


def test_sig3_prints_three_significant_digits_in_fixed_notation():
    assert [sig3(v) for v in (1234.5, 12.345, 1.0, 0.012345, 0.0000123, 0)] == [
        "1230",
        "12.3",
        "1.00",
        "0.0123",
        "0.0000123",
        "0",
    ]
    assert sig3(None) == "-" and sig3(float("inf")) == "inf"


def test_the_ratio_is_the_fastest_baseline_over_ours():
    cases = {(c["row"]["kernel"], c["row"]["block_size"]): c for c in ratio_cases(ROWS)}
    assert cases["paged_attention", 16]["speedup"] == pytest.approx(3.0 / 2.0)
    # sdpa-best repeats the cuDNN row and the oracle is no baseline: neither changes the ratio.
    assert cases["paged_attention", 1560]["speedup"] == pytest.approx(3.0 / 4.0)
    assert cases["paged_attention", 1560]["baseline"]["provider"] == "sdpa-cudnn"
    assert cases["write_slots", 16]["speedup"] == pytest.approx(2.0)
    assert cases["write_slots", 16]["of_copy"] == pytest.approx(0.8)
    assert cases["paged_attention", 16]["of_copy"] is None


def test_the_table_prints_medians_ratio_and_marks_the_goal(tmp_path, capsys):
    csv_path = tmp_path / "sweep.csv"
    write_rows(csv_path, ROWS)
    assert main(["table", str(csv_path), "--goal"]) == 0
    printed = capsys.readouterr().out
    assert re.search(
        r"^paged_attention\s+16\s+2\.00\s+sdpa-flash\s+3\.00\s+1\.50x\s+-$", printed, re.M
    )
    assert re.search(
        r"^paged_attention\s+1560\s+4\.00\s+sdpa-cudnn\s+3\.00\s+0\.750x\s.*BELOW 1\.0x",
        printed,
        re.M,
    )
    assert re.search(
        r"^write_slots\s+16\s+0\.500\s+torch\s+1\.00\s+2\.00x\s+80\.0%\s+BELOW 85% of copy$",
        printed,
        re.M,
    )
    assert "goal 1.00x: 1 of 3 rows below; 85% of copy: 1 of 1 below" in printed
    assert "noise: steady" in printed
    assert main(["table", str(csv_path)]) == 0
    assert "BELOW" not in capsys.readouterr().out


def test_noise_verdict_reads_the_ceilings_at_both_ends():
    assert noise_verdict(ROWS) == "steady"
    assert noise_verdict(ROWS[:-2]) == ""  # cut short: no end ceilings, nothing to say
    drifted = [*ROWS[:-1], ceiling("copy", "end", 3000.0)]  # 4000 -> 3000: 33% apart
    assert noise_verdict(drifted) == "noisy: copy ceiling 4000 at start, 3000 at end"
    within = [*ROWS[:-1], ceiling("copy", "end", 3500.0)]  # 14% apart
    assert noise_verdict(within) == "steady"
    too_fast = [*ROWS, measured("write_slots", "torch", 64, 1 / 5000)]  # 5000 GB/s > 4000
    assert noise_verdict(too_fast) == "noisy: 1 rows above their ceiling (write_slots/torch B=64)"


def test_a_noisy_run_is_marked_in_the_table(tmp_path, capsys):
    rows = [dict(r) for r in (*ROWS[:-1], ceiling("copy", "end", 2000.0))]  # copies: marked below
    why = noise_verdict(rows)
    for row in rows:
        row["noise"] = why
    csv_path = tmp_path / "sweep.csv"
    write_rows(csv_path, rows)
    assert {r["noise"] for r in read_rows(csv_path)} == {why}
    for argv in (["table", str(csv_path)], ["table", str(csv_path), "--long"]):
        assert main(argv) == 0
        assert "NOISY RUN, figures unreliable: copy ceiling" in capsys.readouterr().out
    assert "noise: unknown" in format_table([{**r, "noise": ""} for r in rows])
    assert "noise: unknown" in format_ratios([{**r, "noise": ""} for r in rows])


def test_compare_calls_a_change_only_when_the_ranges_are_apart(tmp_path, capsys):
    old = [
        measured("paged_attention", "triton", 16, 2.0, role="ours", spread=0.05),
        measured("paged_attention", "triton", 24, 2.0, role="ours", spread=0.05),
        measured("paged_attention", "triton", 32, 2.0, role="ours", spread=0.05),
        measured("paged_attention", "triton", 64, 2.0, role="ours"),  # absent from the new run
    ]
    new = [
        measured("paged_attention", "triton", 16, 1.5, role="ours", spread=0.05),  # apart
        measured("paged_attention", "triton", 24, 1.95, role="ours", spread=0.05),  # overlap
        measured("paged_attention", "triton", 32, 2.5, role="ours", spread=0.05),  # apart
        measured("paged_attention", "triton", 128, 2.0, role="ours"),  # absent from the old
    ]
    calls = [(n["block_size"], v) for _, n, v in compare_rows(old, new)]
    assert calls == [(16, "faster"), (24, "same"), (32, "slower")]
    assert (
        verdict(old[0], {**old[0], "p50_ms": 1.0, "p20_ms": 0.5, "p80_ms": old[0]["p20_ms"]})
        == "same"
    )

    old_csv, new_csv = tmp_path / "old.csv", tmp_path / "new.csv"
    write_rows(old_csv, [*STEADY_CEILINGS, *old])
    write_rows(new_csv, [*STEADY_CEILINGS, *new])
    assert main(["compare", str(old_csv), str(new_csv)]) == 0
    printed = capsys.readouterr().out
    assert re.search(r"^paged_attention\s+triton\s+16\s.*\s0\.750x\s+faster$", printed, re.M)
    assert re.search(r"^paged_attention\s+triton\s+24\s.*\s0\.975x\s+same$", printed, re.M)
    assert re.search(r"^paged_attention\s+triton\s+32\s.*\s1\.25x\s+slower$", printed, re.M)
    assert "3 cases: 1 faster, 1 slower, 1 same" in printed
    assert not re.search(r"^paged_attention\s+triton\s+(64|128)\s", printed, re.M)


def _last_line(err: str) -> str:
    return err.strip().splitlines()[-1]


def test_bad_paths_end_in_one_line_naming_the_argument(tmp_path, capsys):
    a_file = tmp_path / "results.csv"
    write_rows(a_file, ROWS)
    cases = [
        (["sweep", "--preset", "small", "--out", str(a_file)], "--out"),
        (["plot", str(a_file), "--out", str(a_file)], "--out"),
        (["table", str(tmp_path)], str(tmp_path)),
        (["plot", str(tmp_path)], str(tmp_path)),
        (["compare", str(tmp_path / "absent.csv"), str(a_file)], "old"),
        (["compare", str(a_file), str(tmp_path)], "new"),
    ]
    for argv, named in cases:
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2, argv
        last = _last_line(capsys.readouterr().err)
        assert "error:" in last and named in last, (argv, last)
    assert not list(tmp_path.glob("*.png"))  # refused: nothing drawn


def test_a_csv_from_before_the_new_columns_still_reads(tmp_path, capsys):
    """``compare OLD.csv NEW.csv`` must take a CSV written before backend/role/noise existed."""
    from paged_video.bench.results import COLUMNS, LATER_COLUMNS

    old_columns = [c for c in COLUMNS if c not in LATER_COLUMNS]
    rows = [measured("write_slots", "triton", 16, 0.5), measured("write_slots", "torch", 16, 1.0)]
    lines = [",".join(old_columns)]
    lines += [",".join("" if r[c] is None else str(r[c]) for c in old_columns) for r in rows]
    csv_path = tmp_path / "old.csv"
    csv_path.write_text("\n".join(lines) + "\n")
    read = read_rows(csv_path)
    assert [(r["provider"], r["role"], r["noise"]) for r in read] == [
        ("triton", "ours", ""),
        ("torch", "baseline", ""),
    ]
    assert main(["table", str(csv_path)]) == 0
    printed = capsys.readouterr().out
    assert "noise: unknown" in printed
    assert re.search(r"^write_slots\s+16\s+0\.500\s+torch\s+1\.00\s+2\.00x$", printed, re.M)


def test_the_headline_plot_draws_the_ratio_with_the_one_line_on_a_log_axis_when_needed():
    from paged_video.bench.plot import draw_kernel, draw_speedup

    ax = draw_speedup(ROWS).axes[0]
    lines = {line.get_label(): line for line in ax.get_lines()}
    one = next(line for label, line in lines.items() if label.startswith("1.0"))
    assert set(one.get_ydata()) == {1.0}
    attention = next(line for label, line in lines.items() if label.startswith("paged_attention"))
    assert list(attention.get_xdata()) == [16, 1560]
    assert list(attention.get_ydata()) == pytest.approx([1.5, 0.75])
    assert ax.get_yscale() == "linear"  # 0.75 .. 2: no decade spanned

    slow = [*ROWS, *_case_rows(64, ours=300.0, flash=3.0, cudnn=3.5)]  # 0.01x
    assert draw_speedup(slow).axes[0].get_yscale() == "log"
    kernel_axes = draw_kernel(slow, "paged_attention").axes[0]
    assert kernel_axes.get_yscale() == "log"  # TFLOP/s from 0.33 to 50

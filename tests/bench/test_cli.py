"""``python -m paged_video.bench``: bad input names the argument; the README's command works end
to end."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from paged_video.bench.cli import main
from paged_video.bench.results import read_rows

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--block-sizes", "0"], "--block-sizes"),
        (["--block-sizes", "16,,32"], "--block-sizes"),
        (["--chunk-sizes", "x"], "--chunk-sizes"),
        (["--dtypes", "fp8"], "--dtypes"),
        (["--kernels", "paged_attention,nope"], "--kernels"),
        (["--providers", "cudnn"], "--providers"),
        (["--tiles", "48x32"], "--tiles"),
        (["--frames", "3", "--window-chunks", "2"], "--window-chunks"),
        (["--heads", "6", "--gqa-groups", "4"], "--gqa-groups"),
        (["--head-dims", "512"], "--head-dims"),
        (["--sink-chunks", "-1"], "--sink-chunks"),
    ],
)
def test_bad_sweep_arguments_are_rejected_by_name(capsys, argv, named):
    with pytest.raises(SystemExit) as exit_info:
        main(["sweep", "--preset", "small", *argv])
    assert exit_info.value.code == 2
    assert named in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the size guard is for CPU runs")
def test_a_gpu_sized_sweep_is_refused_on_a_cpu(capsys):
    with pytest.raises(SystemExit):
        main(["sweep", "--preset", "shipped"])
    assert "--preset small" in capsys.readouterr().err


def test_plot_and_table_reject_a_file_that_is_not_a_results_csv(tmp_path, capsys):
    bad = tmp_path / "bad.csv"
    bad.write_text("kernel,provider\nx,y\n")
    for command in ("plot", "table"):
        with pytest.raises(SystemExit):
            main([command, str(bad)])
        assert "missing columns" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["table", str(tmp_path / "absent.csv")])
    assert "no such file" in capsys.readouterr().err


def test_sweep_then_plot_and_table_from_the_csv(tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["sweep", "--preset", "small", "--block-sizes", "24", "--out", str(out)]
    assert main([*argv, "--kernels", "paged_attention,write_slots", "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "sdpa+gather" in printed
    assert ("CPU timings" in printed) != torch.cuda.is_available()
    assert sorted(p.name for p in out.glob("*.png")) == [
        "paged_attention.png",
        "speedup.png",
        "write_slots.png",
    ]
    rows = read_rows(out / "sweep.csv")
    assert {r["kernel"] for r in rows} == {"ceiling", "paged_attention", "write_slots"}

    redrawn = tmp_path / "redrawn"
    assert main(["plot", str(out / "sweep.csv"), "--out", str(redrawn)]) == 0
    assert (redrawn / "paged_attention.png").stat().st_size > 10_000
    assert main(["table", str(out / "sweep.csv"), "--long"]) == 0
    assert re.search(r"^write_slots\s+triton\s+24\s", capsys.readouterr().out, re.MULTILINE)
    assert main(["table", str(out / "sweep.csv")]) == 0
    ratios = capsys.readouterr().out
    assert re.search(r"^paged_attention\s+24\s+\S+\s+sdpa", ratios, re.MULTILINE)
    assert re.search(r"^write_slots\s+24\s+\S+\s+torch\s+\S+\s+\S+x\s+\S+%", ratios, re.M)


@pytest.mark.skipif(torch.cuda.is_available(), reason="times the CPU run of the README command")
def test_the_readme_main_job_runs_the_small_preset(tmp_path):
    """``python -m paged_video.bench sweep --preset small --out out/``, as README.md gives it."""
    assert (
        "python -m paged_video.bench sweep --preset small --out out/"
        in (REPO / "README.md").read_text()
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-m", "paged_video.bench", "sweep", "--preset", "small", "--out", "out/"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        # A guard against a hang, not a speed test: on 2 loaded cores the run takes minutes.
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.search(r"^paged_attention\s+triton\s+8\s", done.stdout, re.MULTILINE)
    assert "speedup = fastest baseline" in done.stdout
    assert {p.name for p in (tmp_path / "out").iterdir()} == {
        "sweep.csv",
        "speedup.png",
        "paged_attention.png",
        "staged.png",
        "gather_blocks.png",
        "write_slots.png",
    }

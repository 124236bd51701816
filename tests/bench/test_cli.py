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
        timeout=120,
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


def test_the_gpu_check_runs_the_shipped_block_sizes_first_and_ends_with_the_ratio_table():
    script = (REPO / "bench" / "gpu_check.sh").read_text()
    assert subprocess.run(["bash", "-n", str(REPO / "bench" / "gpu_check.sh")]).returncode == 0
    assert "BLOCK_SIZES:-16,1560,24,64,256,520,32,128}" in script
    assert "--time-limit" in script and '"$python" -m paged_video.bench compile' in script
    commands = [line for line in script.splitlines() if '"$python" -m paged_video.bench' in line]
    assert "sweep" in commands[0]  # the sweep first, the plots and the ratio table last
    assert any(
        "-m paged_video.bench accuracy" in line for line in commands
    )  # FP8/INT8 accuracy on the GPU
    assert (
        commands[-1].strip() == '"$python" -m paged_video.bench table "$out_dir/sweep.csv" --goal'
    )


def test_the_gpu_check_names_real_providers_and_configs_and_fits_one_call():
    # A typo here would cost a GPU window (one run a session): every provider the script names
    # exists, every probe config parses, and the stages' limits fit the documented wrapper.
    from paged_video.bench.launch_probe import parse_launch, parse_runs
    from paged_video.bench.providers import PROVIDERS

    script = (REPO / "bench" / "gpu_check.sh").read_text()
    names = {p.name for p in PROVIDERS}
    listed = re.findall(r"--providers\s+([\w,.-]+)", script)
    assert listed
    for providers in listed:
        assert set(providers.split(",")) <= names, providers
    for configs in re.findall(r"--configs\s+([\w,+.-]+)", script):
        for config in configs.split(","):
            parse_launch(config)
    # The probe's runs, with the script's own variables put in.
    variables = dict(re.findall(r"^(\w+)=([\w.-]+)$", script, flags=re.M))
    probes = re.findall(r'--runs\s+"([^"]+)"', script)
    assert len(probes) == 3, probes  # FP8-MMA's candidates, the dequantizing ones, INT8-MMA's
    for runs in probes:
        for name, value in variables.items():
            runs = runs.replace(f"${name}", value)
        assert len(parse_runs(runs)) >= 3, runs
    # Each stage's limit by name (a name may be written twice: the echo and the timeout).
    stages = {name: int(n) for name, n in re.findall(r"\$\{([A-Z]+_TIMEOUT):-(\d+)\}", script)}
    assert len(stages) == 6, stages
    docs = (REPO / "docs" / "benchmarks.md").read_text()
    wrapper = int(re.search(r"timeout (\d+) bash bench/gpu_check.sh", docs).group(1))
    assert sum(stages.values()) < wrapper <= 600, (stages, wrapper)

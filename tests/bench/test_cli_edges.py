"""The command lines' edges end in one line, never a traceback: ``--out`` that is no folder,
a CSV that is not a sweep's, a file that cannot be written, a GPU that is not there, a format
spelled the old way."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from paged_video.bench import cli
from paged_video.bench.cli import main
from paged_video.bench.results import read_rows, write_rows
from tests.bench.rows import STEADY_CEILINGS, measured

REPO = Path(__file__).resolve().parents[2]
ROWS = [
    *STEADY_CEILINGS[:2],
    measured("paged_attention", "triton", 16, 2.0, role="ours"),
    measured("paged_attention", "sdpa-flash", 16, 3.0),
    *STEADY_CEILINGS[2:],
]
NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")


def _refused(capsys, argv: list[str], code: int = 2) -> str:
    """Run ``argv``, expect exit ``code``, return the error's last line."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == code, argv
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_out_must_be_a_folder_that_can_be_made(tmp_path, capsys):
    csv_path = tmp_path / "sweep.csv"
    write_rows(csv_path, ROWS)
    a_file = tmp_path / "file"
    a_file.write_text("")
    under_a_file = a_file / "out"
    sweep = ["sweep", "--preset", "small", "--block-sizes", "8", "--kernels", "write_slots"]
    cases = [
        ([*sweep, "--out", str(a_file)], "(the CSV and the PNGs go inside)"),
        ([*sweep, "--out", str(under_a_file)], "cannot create the folder"),
        (["plot", str(csv_path), "--out", str(a_file)], "(the PNGs go inside)"),
        (["plot", str(csv_path), "--out", str(under_a_file)], "cannot create the folder"),
        (["accuracy", "--out", str(a_file)], "(accuracy.csv goes inside)"),
        (["accuracy", "--out", str(under_a_file)], "cannot create the folder"),
    ]
    for argv, said in cases:
        last = _refused(capsys, argv)
        assert last.startswith("python -m paged_video.bench") or "error: --out" in last
        assert said in last and f"--out {argv[-1]}" in last, (argv, last)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "sweep.csv"]


def test_an_os_error_while_writing_is_one_line_and_exit_1(tmp_path, capsys, monkeypatch):
    csv_path = tmp_path / "sweep.csv"
    write_rows(csv_path, ROWS)

    def full_disk(rows, out):
        raise OSError(28, "No space left on device", str(out / "speedup.png"))

    monkeypatch.setattr(cli, "plot_rows", full_disk)
    assert main(["plot", str(csv_path)]) == 1
    err = capsys.readouterr().err
    assert err == f"error: {tmp_path / 'speedup.png'}: No space left on device\n"


def test_a_csv_that_is_not_a_sweeps_is_named_in_one_line(tmp_path, capsys):
    accuracy_csv = tmp_path / "accuracy.csv"
    accuracy_csv.write_text("data,format,mode,k_smooth,cosine,rel_l1,max_abs_error,meets_goal\n")
    last = _refused(capsys, ["table", str(accuracy_csv)])
    assert "is an accuracy CSV" in last
    short = tmp_path / "short.csv"
    short.write_text("kernel,provider\nx,y\n")
    last = _refused(capsys, ["table", str(short)])
    assert "missing columns block_size, tile, chunk_size, frames and " in last
    assert last.endswith(" more (usage: python -m paged_video.bench table --help)")
    bad_number = tmp_path / "bad.csv"
    write_rows(bad_number, ROWS)
    bad_number.write_text(bad_number.read_text().replace("2,", "two,", 1))
    last = _refused(capsys, ["compare", str(bad_number), str(bad_number)])
    assert re.search(r"bad\.csv, line \d+: not a number where one belongs", last), last


def test_formats_have_one_spelling_and_the_old_ones_name_the_new(capsys):
    sweep = ["sweep", "--preset", "small"]
    for argv, new in [
        ([*sweep, "--providers", "triton-fp8-mma"], "'triton-k8v8'"),
        ([*sweep, "--providers", "triton-e4m3-mma-keys"], "'triton-k8v8'"),
    ]:
        last = _refused(capsys, argv)
        assert f"is spelled {new} now" in last, last
    # The e4m3 pool was deleted (issue 45): each of its spellings names k8v16 and k8v8.
    for argv, new in [
        ([*sweep, "--providers", "triton-e4m3"], "triton-k8v16 (more accurate"),
        ([*sweep, "--providers", "triton-fp8"], "triton-k8v16 (more accurate"),
        (["accuracy", "--formats", "e4m3"], "k8v16 (more accurate"),
        (["accuracy", "--formats", "float8_e4m3fn"], "k8v16 (more accurate"),
    ]:
        last = _refused(capsys, argv)
        assert "(the e4m3 dequantizing pool) was deleted (issue 45): use " + new in last, last
        assert "k8v8 (the same bytes)" in last, last


def test_an_old_csv_with_the_old_provider_names_reads_with_the_new(tmp_path):
    old = tmp_path / "old.csv"
    write_rows(old, [measured("paged_attention", "triton-fp8", 16, 1.0, role="quantized")])
    assert [r["provider"] for r in read_rows(old)] == ["triton-e4m3"]


@NO_GPU
def test_cuda_without_a_gpu_is_one_line(capsys):
    for argv in (
        ["sweep", "--preset", "small", "--device", "cuda"],
        ["accuracy", "--device", "cuda"],
    ):
        assert "--device cuda: no CUDA device is visible" in _refused(capsys, argv)
    from paged_video.bench import prepare_timing

    with pytest.raises(SystemExit):
        prepare_timing.main(["--device", "cuda"])
    assert "--device cuda: no CUDA device" in capsys.readouterr().err


def test_wan_rollout_refuses_old_spellings_and_a_missing_gpu(capsys):
    pytest.importorskip("diffusers")
    from paged_video.bench import wan_rollout

    with pytest.raises(SystemExit):
        wan_rollout.main(["--tiny", "--kv-dtype", "float8_e4m3fn"])
    assert "'float8_e4m3fn' (the e4m3 dequantizing pool) was deleted" in capsys.readouterr().err
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            wan_rollout.main(["--tiny", "--device", "cuda"])
        assert "--device cuda: no CUDA device is visible" in capsys.readouterr().err


def test_as_a_new_user_runs_it_no_traceback(tmp_path):
    """``--out`` under a file, from the shell: the usage and one error line, exit 2."""
    (tmp_path / "here").write_text("a file, not a folder")
    argv = ["-m", "paged_video.bench", "sweep", "--preset", "small", "--out", "here/x"]
    done = subprocess.run(
        [sys.executable, *argv],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("python -m paged_video.bench sweep: error: --out here/x: cannot")


def _exit_and_stderr(capsys, argv: list[str]) -> tuple[int, list[str]]:
    try:
        code = main(argv)
    except SystemExit as exit_info:
        code = exit_info.code
    return code, capsys.readouterr().err.strip().splitlines()


def test_a_refusal_is_one_line_the_error_first_and_the_exit_codes_are_the_docs(
    tmp_path, capsys, monkeypatch
):
    docs = " ".join((REPO / "docs" / "benchmarks.md").read_text().split())
    bullet = docs.split("**Mistakes end in one line**")[1].split("\n- ")[0]
    usage, run = bullet.split("**exit 2**")[0], bullet.split("**exit 2**")[1]
    assert "A bad argument is refused" in usage and "An error while working" in run
    assert "**exit 1**" in run
    a_csv = tmp_path / "sweep.csv"
    write_rows(a_csv, ROWS)
    # What the docs list under exit 2: an option value, a missing or wrong input file, an
    # --out that cannot be a folder.
    for argv in (
        ["sweep", "--preset", "nope"],
        ["accuracy", "--smoothing", "maybe"],
        ["table", str(tmp_path / "absent.csv")],
        ["plot", str(tmp_path)],
        ["plot", str(a_csv), "--out", str(a_csv)],
    ):
        code, lines = _exit_and_stderr(capsys, argv)
        assert code == cli.USAGE_ERROR == 2, argv
        assert len(lines) == 1 and " error: " in lines[0], (argv, lines)
        assert lines[0].endswith(f"(usage: python -m paged_video.bench {argv[0]} --help)")

    # Under exit 1: a file that cannot be written, a missing optional package.
    def full_disk(rows, out):
        raise OSError(28, "No space left on device", str(out / "speedup.png"))

    monkeypatch.setattr(cli, "plot_rows", full_disk)
    code, lines = _exit_and_stderr(capsys, ["plot", str(a_csv)])
    assert (code, len(lines)) == (cli.RUN_ERROR, 1) and "speedup.png" in lines[0]

    def missing(module, needed_for):
        raise cli.extras.MissingExtraError(f"{needed_for} need matplotlib: pip install ...")

    monkeypatch.setattr(cli.extras, "require", missing)
    code, lines = _exit_and_stderr(capsys, ["plot", str(a_csv)])
    assert (code, len(lines)) == (1, 1) and "matplotlib" in lines[0]


def test_every_option_of_every_subcommand_says_what_it_does():
    parser = cli.build_parser()
    [commands] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    silent = [
        f"{name} {action.option_strings[0]}"
        for name, command in commands.choices.items()
        for action in command._actions
        if action.option_strings and not action.help
    ]
    assert not silent

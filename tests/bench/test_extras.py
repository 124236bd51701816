"""A plain ``pip install`` (no extras) runs the bench CLI: ``--help`` and the subcommands that
draw nothing work without matplotlib and tqdm, a plot asked for is one line naming the
``bench`` extra (before any work), and a sweep without tqdm runs without its bar."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# Run in a fresh interpreter: a sys.meta_path finder refuses matplotlib and tqdm as if they
# were not installed, then each CLI call's exit status, stderr and the modules it loaded.
SCRIPT = r"""
import contextlib, io, json, sys

class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ("matplotlib", "tqdm"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, Refuse())
from paged_video.bench.cli import main
from paged_video.bench.sweep import _progress_bar

out = sys.argv[1]
results = {}
for name, argv in {
    "help": ["--help"],
    "sweep_help": ["sweep", "--help"],
    "sweep": ["sweep", "--preset", "small", "--out", out],
    "plot": ["plot", out + "/missing.csv"],
}.items():
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            status = main(argv)
        except SystemExit as exit:
            status = exit.code
    results[name] = [status, stdout.getvalue(), stderr.getvalue()]
stderr = io.StringIO()
with contextlib.redirect_stderr(stderr), _progress_bar(3, True) as bar:
    bar.set_postfix_str("run")
    bar.update()
results["bar"] = [type(bar).__name__, stderr.getvalue()]
results["loaded"] = sorted({m.partition(".")[0] for m in sys.modules} & {"matplotlib", "tqdm"})
print(json.dumps(results))
"""


def test_the_cli_runs_without_matplotlib_and_tqdm(tmp_path):
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(out)],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    results = json.loads(done.stdout.strip().splitlines()[-1])
    for name in ("help", "sweep_help"):
        status, stdout, stderr = results[name]
        assert (status, stderr) == (0, ""), name
        assert stdout.startswith("usage: python -m paged_video.bench"), name
    for name in ("sweep", "plot"):
        status, stdout, stderr = results[name]
        assert status == 1 and stdout == "", name
        lines = stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), (name, stderr)
        assert "matplotlib" in lines[0] and "paged-video-attention[bench]" in lines[0], stderr
    assert "--no-plot" in results["sweep"][2]
    assert not out.exists(), "the sweep refused before making its folder"
    bar, note = results["bar"]
    assert bar == "_NoBar" and "tqdm" in note and "[bench]" in note and note.count("\n") == 1
    assert results["loaded"] == []

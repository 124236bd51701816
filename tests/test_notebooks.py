"""Every notebook runs as a plain script at small sizes and writes its figures, so none can rot;
and every axis whose values span more than a decade is logarithmic."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jupytext
import pytest

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = {
    "ar_rollout.py": {"ar_rollout_reads.png", "ar_rollout_blocks.png"},
    "kernel_playground.py": {
        "playground_error.png",
        "playground_grid.png",
        "playground_quantized.png",
    },
    "window_anatomy.py": {"window_block_tables.png", "window_reads.png", "window_forks.png"},
    "sweep_plots.py": {
        "paged_attention.png",
        "staged.png",
        "sweep_speedup.png",
        "sweep_paged_vs_staged.png",
    },
}

NEEDS_DIFFUSERS = {"ar_rollout.py"}
# Values spanning more than this factor need a log axis (bench.plot draws by the same rule).
DECADE = 10.0


def test_every_notebook_is_listed():
    assert {p.name for p in (REPO / "notebooks").glob("*.py")} == set(NOTEBOOKS)


@pytest.mark.parametrize("name", sorted(NOTEBOOKS))
def test_notebook_runs_at_small_size_and_writes_its_figures(tmp_path, name):
    if name in NEEDS_DIFFUSERS:
        pytest.importorskip("diffusers")
    path = REPO / "notebooks" / name
    cells = jupytext.read(path).cells
    assert sum(cell.cell_type == "code" for cell in cells) >= 3
    assert any(cell.cell_type == "markdown" for cell in cells)

    out = tmp_path / "figures"
    axes_json = tmp_path / "axes.json"
    env = {
        **os.environ,
        "NOTEBOOK_SMALL": "1",
        "NOTEBOOK_OUT": str(out),
        "MPLBACKEND": "Agg",
        "PYTHONPATH": str(REPO),
        "AXES_JSON": str(axes_json),
    }
    env.pop("SWEEP_CSV", None)
    done = subprocess.run(
        [sys.executable, str(REPO / "tests" / "notebook_axes.py"), str(path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    written = {p.name for p in out.glob("*.png")}
    assert NOTEBOOKS[name] <= written, f"missing {NOTEBOOKS[name] - written}"
    assert all((out / png).stat().st_size > 5_000 for png in NOTEBOOKS[name])
    records = json.loads(axes_json.read_text())
    assert NOTEBOOKS[name] <= {r["file"] for r in records}
    assert not linear_axes_spanning_decades(records)


def linear_axes_spanning_decades(records: list[dict]) -> list[str]:
    """``file: axis 'label'`` of every linear value axis whose data span more than a decade
    (index axes, with integer or placed ticks, are left out: frames and block ids are counts)."""
    found = []
    for record in records:
        for ax in record["axes"]:
            for name in ("x", "y"):
                axis = ax[name]
                if axis["scale"] == "linear" and not axis["index"] and axis["span"] > DECADE:
                    found.append(
                        f"{record['file']}: {name} axis {axis['label']!r} of {ax['title']!r}"
                    )
    return found


def test_the_decade_check_flags_a_linear_axis_and_passes_a_log_one(tmp_path):
    """The check above can fail: a linear y axis over 0.001 .. 1 is caught, a log one is not."""
    script = tmp_path / "figure.py"
    script.write_text(
        "import os\n"
        "import matplotlib.pyplot as plt\n"
        "for scale in ('linear', 'log'):\n"
        "    figure, ax = plt.subplots()\n"
        "    ax.plot([8, 16, 32], [0.001, 0.01, 1.0])\n"
        "    ax.set_yscale(scale)\n"
        "    ax.set_xticks([8, 16, 32])\n"
        "    ax.set_ylabel(scale)\n"
        "    figure.savefig(os.path.join(os.environ['NOTEBOOK_OUT'], scale + '.png'))\n"
    )
    axes_json = tmp_path / "axes.json"
    env = {**os.environ, "NOTEBOOK_OUT": str(tmp_path), "MPLBACKEND": "Agg"}
    env["AXES_JSON"] = str(axes_json)
    done = subprocess.run(
        [sys.executable, str(REPO / "tests" / "notebook_axes.py"), str(script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    found = linear_axes_spanning_decades(json.loads(axes_json.read_text()))
    assert found == ["linear.png: y axis 'linear' of 'linear'"]


@pytest.mark.parametrize("name", sorted(NOTEBOOKS))
def test_the_output_folder_is_the_clones_as_a_script_and_as_a_notebook(monkeypatch, name):
    # A script runs from the clone, jupytext and Jupyter from notebooks/: one folder for both.
    lines = (REPO / "notebooks" / name).read_text().splitlines()
    setup = "\n".join(line for line in lines if line.startswith(("ROOT = ", "OUT = ")))
    monkeypatch.delenv("NOTEBOOK_OUT", raising=False)
    found = []
    for folder in (REPO, REPO / "notebooks"):
        monkeypatch.chdir(folder)
        namespace = {"Path": Path, "os": os}
        exec(setup, namespace)
        found.append(namespace["OUT"].resolve())
    assert found == [REPO / "out" / "notebooks"] * 2

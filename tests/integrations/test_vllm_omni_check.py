"""vllm-omni's own AR-Diffusion tests on the backend (``bench/vllm_omni_check.sh``).

The real run happens only when ``PAGED_VIDEO_VLLM_OMNI_CHECKOUT`` names a vllm-omni v0.30.0
checkout: the script builds a separate ~3.3 GB venv once (about 16 minutes) and runs for
minutes, so CI leaves it out. What the script deletes and writes is tested on stubs: an
interpreter whose ``-m venv`` makes a venv whose python fakes pip (writing into the source it is
given, as setuptools does) and pytest (writing bytecode beside the tests unless told not to).
"""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest

CHECKOUT = os.environ.get("PAGED_VIDEO_VLLM_OMNI_CHECKOUT")
SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "vllm_omni_check.sh"


@pytest.mark.skipif(not CHECKOUT, reason="PAGED_VIDEO_VLLM_OMNI_CHECKOUT is not set")
def test_vllm_omnis_tests_pass_on_the_backend_and_fail_on_a_perturbed_one() -> None:
    result = subprocess.run(
        ["bash", str(SCRIPT), CHECKOUT], capture_output=True, text=True, timeout=3600
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    counts = dict(re.findall(r"^(shipped|backend|perturbed): (.*)$", result.stdout, re.M))
    passed = {label: re.search(r"(\d+) passed", line) for label, line in counts.items()}
    assert passed["shipped"] and passed["shipped"].group(1) == passed["backend"].group(1)
    assert "failed" in counts["perturbed"]


# The venv's python: pip and pytest faked, every call logged to $STUB_LOG.
VENV_PYTHON = r"""#!/usr/bin/env bash
echo "$*" >>"$STUB_LOG"
if [ "$1 $2" = "-m pip" ]; then
    last=${@: -1}
    case "$*" in
    *" download "*) mkdir -p "$last" && : >"$last/vllm-0.30.0-py3-none-any.whl" ;;
    *--force-reinstall*)  # setuptools builds beside its sources
        echo "source $last" >>"$STUB_LOG" && mkdir -p "$last/build" "$last/stub.egg-info" ;;
    esac
elif [ "$1 $2" = "-m pytest" ]; then
    # pytest writes the rewritten test modules' bytecode beside them unless told not to
    [ -n "${PYTHONDONTWRITEBYTECODE:-}" ] || mkdir -p "${@: -1}/__pycache__"
    case "$*" in
    *--paged-video-perturb*) echo "===== 1 failed, 2 passed in 0.10s =====" && exit 1 ;;
    *) echo "===== 3 passed in 0.10s =====" ;;
    esac
elif [ "$1" = "-c" ]; then
    echo 0  # no GPU
fi
"""

# The interpreter the venv is made from: only `-m venv DIR`.
BASE_PYTHON = r"""#!/usr/bin/env bash
echo "base $*" >>"$STUB_LOG"
[ "$1 $2" = "-m venv" ] || exit 3
mkdir -p "$3/bin" && : >"$3/pyvenv.cfg" && cp "$(dirname "$0")/venv_python" "$3/bin/python"
"""


def _tree(root: Path) -> dict[str, bytes | None]:
    """Every path under ``root`` with a file's bytes (None for a folder)."""
    return {
        str(path.relative_to(root)): None if path.is_dir() else path.read_bytes()
        for path in sorted(root.rglob("*"))
    }


class Stubs:
    def __init__(self, tmp_path: Path) -> None:
        self.bin = tmp_path / "stubs"
        self.bin.mkdir()
        for name, text in (("venv_python", VENV_PYTHON), ("python", BASE_PYTHON)):
            (self.bin / name).write_text(text)
            (self.bin / name).chmod(stat.S_IRWXU)
        self.log = tmp_path / "stub.log"
        self.checkout = tmp_path / "vllm-omni"
        (self.checkout / "tests" / "diffusion" / "ar_diffusion").mkdir(parents=True)
        (self.checkout / "tests" / "diffusion" / "ar_diffusion" / "test_x.py").write_text("")
        self.tmp = tmp_path / "tmp"
        self.tmp.mkdir()
        # A clone to run the script from (it installs the clone it sits in).
        self.clone = tmp_path / "clone"
        (self.clone / "bench").mkdir(parents=True)
        (self.clone / "bench" / SCRIPT.name).write_bytes(SCRIPT.read_bytes())
        (self.clone / "pyproject.toml").write_text("[project]\nname = 'stand-in'\n")

    def run(self, venv: Path) -> subprocess.CompletedProcess:
        self.log.write_text("")
        env = dict(os.environ)
        env.pop("PYTHONDONTWRITEBYTECODE", None)  # the script must set it for pytest itself
        env.update(
            VLLM_OMNI_VENV=str(venv),
            PYTHON=str(self.bin / "python"),
            STUB_LOG=str(self.log),
            TMPDIR=str(self.tmp),
        )
        return subprocess.run(
            ["bash", str(self.clone / "bench" / SCRIPT.name), str(self.checkout)],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )


def _plant_venv(venv: Path) -> None:
    """A venv someone else made (no stamp of the script's)."""
    (venv / "bin").mkdir(parents=True)
    # Python's own venv line; its home is the running interpreter's folder, no machine's path.
    (venv / "pyvenv.cfg").write_text(f"home = {Path(sys.executable).parent}\n")
    (venv / "bin" / "python").write_text("#!/bin/sh\n")
    (venv / "lib" / "site-packages").mkdir(parents=True)
    (venv / "lib" / "site-packages" / "theirs.py").write_text("precious = True\n")


@pytest.mark.parametrize("kind", ["venv", "folder", "file"])
def test_a_venv_path_the_script_did_not_make_is_refused_and_left_alone(tmp_path, kind):
    stubs = Stubs(tmp_path)
    venv = tmp_path / "theirs"
    if kind == "venv":
        _plant_venv(venv)
    elif kind == "folder":  # e.g. VLLM_OMNI_VENV=$HOME by mistake
        venv.mkdir()
        (venv / "notes.txt").write_text("mine")
    else:
        venv.write_text("a file")
    before = _tree(tmp_path)
    result = stubs.run(venv)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "was not made by this script" in result.stderr and "refusing" in result.stderr
    log = stubs.log.read_text()
    stubs.log.unlink()
    assert _tree(tmp_path) == before and log == ""  # nothing deleted, nothing run


def test_the_script_writes_only_its_venv_and_deletes_only_its_own(tmp_path):
    stubs = Stubs(tmp_path)
    venv = tmp_path / "cache" / "venv"
    clone_before, checkout_before = _tree(stubs.clone), _tree(stubs.checkout)

    result = stubs.run(venv)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "vllm_omni_check: OK" in result.stdout and "== building" in result.stdout
    source = re.search(r"^source (.+)$", stubs.log.read_text(), re.M).group(1)
    assert Path(source).is_relative_to(stubs.tmp)  # built from a copy, not the clone
    assert _tree(stubs.clone) == clone_before and _tree(stubs.checkout) == checkout_before
    assert list(stubs.tmp.iterdir()) == []  # its temporary folder is gone
    stamps = sorted(path.name for path in venv.glob(".paged_video*"))  # the recipe's, its own
    assert len(stamps) == 2 and stamps[0].startswith(".paged_video_recipe_")
    assert stamps[1] == ".paged_video_vllm_omni_check"

    assert "== reusing" in stubs.run(venv).stdout  # its recipe is current: kept

    # Its own venv is rebuilt, the one folder it may delete: of another recipe (made by an older
    # script, which wrote the recipe stamp alone), or from a build that failed (no recipe).
    for left in ([".paged_video_recipe_0123456789abcdef"], [stamps[1]]):
        for stamp in stamps:
            (venv / stamp).unlink()
        for stamp in left:
            (venv / stamp).write_text("")
        (venv / "left_from_before").write_text("")
        result = stubs.run(venv)
        assert result.returncode == 0 and "== building" in result.stdout
        assert not (venv / "left_from_before").exists()
        assert sorted(path.name for path in venv.glob(".paged_video*")) == stamps


def test_an_empty_folder_is_used_for_the_venv(tmp_path):
    stubs = Stubs(tmp_path)
    venv = tmp_path / "empty"
    venv.mkdir()
    result = stubs.run(venv)
    assert result.returncode == 0, result.stdout + result.stderr
    assert (venv / ".paged_video_vllm_omni_check").is_file()

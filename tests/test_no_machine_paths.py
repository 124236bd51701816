"""Nothing tracked names a location outside the repository or on a particular machine: a side
tool comes from an environment variable or an option, an example writes under the clone."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# Top folders of absolute paths that only mean something on one machine. Spelled without their
# slashes so this file does not name them itself.
MACHINE_ROOTS = (
    "work",
    "root",
    "home",
    "tmp",
    "mnt",
    "opt",
    "usr",
    "var",
    "data",
    "scratch",
    "Users",
    "srv",
    "media",
    "private",
)
MACHINE_PATH = re.compile(r"(?<![\w.~$/-])/(?:" + "|".join(MACHINE_ROOTS) + r")/[^\s`'\"();,]*")
# The only absolute paths allowed: the same on every Unix (a shebang's env, GNU time).
ALLOWED = {"/" + "usr/bin/env", "/" + "usr/bin/time"}


def machine_paths(text: str) -> list[str]:
    """The absolute paths in ``text`` that name a machine's folders."""
    return [path for path in MACHINE_PATH.findall(text) if path not in ALLOWED]


def test_the_pattern_finds_machine_paths_and_leaves_the_rest():
    venv = "/" + "work/venvs/triton36"
    gc, cache = "/" + "tmp/gc", "/" + "root/.cache/x"
    assert machine_paths(f"default {venv}; `mkdir -p {gc}`") == [venv, gc]
    assert machine_paths(f"home: ({cache}), {gc}/x") == [cache, gc + "/x"]
    assert machine_paths("#!" + "/usr/bin/env bash\n" + "/usr/bin/time -v pytest") == []
    assert machine_paths("out/tmp/x, https://example.org/home/page, $HOME/x, a/work/b") == []


def test_no_tracked_file_names_a_path_outside_the_repository():
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git clone (an installed copy has no tracked files to read)")
    listed = subprocess.run(
        ["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True
    ).stdout.decode()
    found = []
    for name in filter(None, listed.split("\0")):
        path = REPO / name
        if not path.is_file() or path.is_symlink():
            continue
        text = path.read_bytes().decode("utf-8", errors="replace")
        for number, line in enumerate(text.splitlines(), 1):
            found += [f"{name}:{number}: {hit}" for hit in machine_paths(line)]
    assert not found, "paths outside the repository:\n" + "\n".join(found)

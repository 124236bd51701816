"""`.ci/run` is CI: it runs the README's test command, type-checks from the clone, and runs the
README's main job and the smoke selection from the built wheel, timing each step."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_ci_runs_the_readmes_commands_and_the_wheel_steps():
    script = (REPO / ".ci" / "run").read_text()
    readme = (REPO / "README.md").read_text()
    assert subprocess.run(["bash", "-n", str(REPO / ".ci" / "run")]).returncode == 0
    test_command = "python -m pytest -n 2 --hypothesis-profile=ci"
    main_job = "python -m paged_video.bench sweep --preset small --out out/"
    assert f"```bash\n{test_command}\n```" in readme and f"step tests {test_command}" in script
    assert main_job in readme and main_job.replace("python", '"$python"', 1) in script
    assert '"$python" -m pytest -n 2 -m smoke' in script
    steps = re.findall(r"^step (\S+) ", script, re.M)
    assert steps == ["install", "ruff", "mypy", "tests", "package", "wheel"]
    for name in ("mypy", "package", "wheel"):  # the README gives the times the script prints
        assert re.search(rf"`{name}` \d+ s", readme), name

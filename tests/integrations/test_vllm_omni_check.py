"""vllm-omni's own AR-Diffusion tests on the backend (``bench/vllm_omni_check.sh``).

Runs only when ``PAGED_VIDEO_VLLM_OMNI_CHECKOUT`` names a vllm-omni v0.30.0 checkout: the script
builds a separate ~3.3 GB venv once (about 16 minutes) and runs for minutes, so CI leaves it out.
"""

from __future__ import annotations

import os
import re
import subprocess
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

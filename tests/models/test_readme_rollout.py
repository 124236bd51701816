"""The README's Wan rollout block runs as written (a CPU, a few seconds)."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

pytest.importorskip("diffusers")

README = Path(__file__).resolve().parents[2] / "README.md"
SECTION = "## A video transformer on the paged cache: autoregressive Wan rollout"


def test_readme_rollout_block_runs():
    text = README.read_text()
    section = text[text.index(SECTION) :].split("\n## ", 1)[0]
    (code,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, str(README), "exec"), {"__name__": "readme"})
    # 3 blocks of one 24-token frame; the last block's forwards read the sink frame and 2 more.
    assert printed.getvalue().strip() == "torch.Size([1, 4, 3, 8, 12]) [72, 72]"

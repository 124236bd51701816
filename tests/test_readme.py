"""Every ```python block of README.md runs as written, on its own (a fresh namespace each).

Blocks are found anew on every run, so a block added later is run too. On a CPU they run
under Triton's interpreter (tests/conftest.py switches it on), so they must stay small.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCK = re.compile(r"^```python\n(.*?)^```$", re.MULTILINE | re.DOTALL)


def python_blocks(text: str) -> list[tuple[int, str]]:
    """``(line number, code)`` of every ```python block of ``text``."""
    return [(text.count("\n", 0, m.start()) + 2, m.group(1)) for m in BLOCK.finditer(text)]


BLOCKS = python_blocks(README.read_text())


def test_the_readme_has_python_blocks_and_the_finder_sees_each():
    assert len(BLOCKS) >= 4
    assert len(BLOCKS) == README.read_text().count("```python")


@pytest.mark.parametrize(("line", "code"), BLOCKS, ids=[f"README.md:{n}" for n, _ in BLOCKS])
def test_readme_block_runs_as_written(line, code):
    if "device=" in code:  # a block that places tensors shows the GPU line beside the CPU one
        assert re.search(r"#.*\"cuda\"", code), f"README.md:{line}: no CUDA line in a comment"
    namespace: dict[str, object] = {"__name__": f"readme_line_{line}"}
    exec(compile(code, f"README.md:{line}", "exec"), namespace)

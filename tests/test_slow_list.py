"""The quick subset (``-m "not slow"``): its list of slow tests (tests/conftest.py) names tests
that exist, so a renamed test cannot silently join the quick subset, and the rule marks what
it says."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.conftest import SLOW, is_slow

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("prefix", SLOW)
def test_every_slow_entry_names_a_test(prefix):
    path, _, name = prefix.partition("::")
    source = REPO / path
    assert source.exists(), f"{prefix}: no such file"
    if name:
        function = name.split("[")[0]
        assert re.search(rf"^def {re.escape(function)}\(", source.read_text(), re.M), prefix


def test_listed_tests_and_readme_blocks_that_build_a_model_are_slow():
    def item(nodeid: str, code: str | None = None) -> SimpleNamespace:
        params = {"line": 1, "code": code} if code is not None else None
        return SimpleNamespace(nodeid=nodeid, callspec=params and SimpleNamespace(params=params))

    assert is_slow(item("tests/test_end_to_end.py::test_shipped_geometry_reduced_heads"))
    assert is_slow(item("tests/bench/test_compile_report.py::test_anything[x]"))
    assert not is_slow(item("tests/test_end_to_end.py::test_block_aligned_chunks_reuse_staging"))
    readme = "tests/test_readme.py::test_readme_block_runs_as_written[README.md:9]"
    assert is_slow(item(readme, "from diffusers import WanTransformer3DModel"))
    assert not is_slow(item(readme, "from paged_video import kernels"))

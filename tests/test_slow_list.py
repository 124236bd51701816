"""The quick subset (``-m "not slow"``) and the smoke selection (``-m smoke``): their lists
(tests/conftest.py) name tests that exist, so a renamed test cannot silently join the quick
subset or leave the smoke loop, and the rules mark what they say."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from paged_video.kernels.paged_attention import kv_path
from tests.conftest import SLOW, SMOKE, is_slow

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("prefix", SLOW + SMOKE)
def test_every_slow_and_smoke_entry_names_a_test(prefix):
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


def test_smoke_tests_are_not_slow_and_take_every_key_path_format_and_rule():
    assert not [entry for entry in SMOKE if entry.startswith(SLOW)]
    masked = "tests/kernels/test_paged_attention.py::test_key_paths_causal_limits_and_gaps["
    shapes = [entry.removeprefix(masked).split("-")[:2] for entry in SMOKE if masked in entry]
    paths = {kv_path(int(block_size), int(block_n)) for block_size, block_n in shapes}
    assert paths == {"contiguous", "block_tiles", "two_blocks", "rows"}
    listed = " ".join(SMOKE)
    for word in (
        "block-pairs",
        "warp_specialized",
        "scores_ahead",
        "torch_path",
        "int8]",
        "k8v8",
        "k8v16",
        "keys_major",
        "spans",
        "eviction",
        "test_plan",
        "staging",
        "forks",
        "shard",
        "batch",
        "write_slots",
        "gather_blocks",
        "fused",
        "merge_states",
    ):
        assert word in listed, word

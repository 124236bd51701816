"""bench.yardsticks: its loops are wired to their kernels right (under the interpreter, small)."""

from __future__ import annotations

import pytest
import torch

from paged_video.bench import yardsticks


@pytest.mark.parametrize("loop", ["anchor", "tutorial_ws"])
def test_the_dense_loops_match_the_reference(loop: str) -> None:
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, 2, yardsticks.HEAD_DIM, generator=gen) for n in (40, 128, 128))
    build = yardsticks._anchor if loop == "anchor" else yardsticks._tutorial
    got = build(q, k, v, (32, 64, 4, 1))()
    torch.testing.assert_close(got, yardsticks.reference(q, k, v), atol=1e-4, rtol=1e-4)
    # A wrong launch (keys cut to one tile) is caught by the same comparison.
    cut = build(q, k[:64], v[:64], (32, 64, 4, 1))()
    assert (cut - yardsticks.reference(q, k, v)).abs().max() > yardsticks.LIMIT


def test_keys_must_fill_whole_tiles(capsys) -> None:
    with pytest.raises(SystemExit):
        yardsticks.main(["--keys", "28080"])
    assert "multiple of 128" in capsys.readouterr().err


def test_the_sdpa_yardstick_is_the_sweeps_forced_backend_on_the_same_layout() -> None:
    # SDPA's flash backend runs on a CPU too: the heads-first views give the packed layout back.
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(n, 2, yardsticks.HEAD_DIM, generator=gen) for n in (24, 40, 40))
    got = yardsticks._sdpa(q, k, v, "sdpa-flash")()
    torch.testing.assert_close(got, yardsticks.reference(q, k, v), atol=1e-4, rtol=1e-4)


def test_the_fp8_loop_matches_attention_over_its_codes() -> None:
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, 2, yardsticks.HEAD_DIM, generator=gen) for n in (40, 128, 128))
    codes = [x.to(torch.float8_e4m3fn) for x in (q, k, v)]
    expected = yardsticks.reference(*(c.float() for c in codes))
    got = yardsticks._anchor(*codes, (32, 64, 4, 1))()
    assert got.dtype == torch.bfloat16
    assert (got.float() - expected).abs().max() <= yardsticks.fp8_limit(expected)
    # Keys cut to one tile: far outside the allowance.
    cut = yardsticks._anchor(codes[0], codes[1][:64], codes[2][:64], (32, 64, 4, 1))()
    assert (cut.float() - expected).abs().max() > 4 * yardsticks.fp8_limit(expected)

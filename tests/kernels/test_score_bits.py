"""The 8-bit formats' int32 scores taken to float by their bits (``SCORE_BITS``, the launch
probe's ``+bits``): an integer add of ``SCORE_BIAS``'s bits instead of an int-to-float
conversion, whose pipe may be the exponentials' (``bench.pipe_probe`` measures it on a GPU).

``_biased_scores`` is exact over the whole range 8-bit sums reach; the scores then lose at most
the addend's rounding (under a unit of the int32 sum), so k8v16's loops (P V behind, the plain
loop) give the default launch's output within that, and k8v8's (its scores a tile ahead, P V
behind, the plain loop) the float64 oracle within the format's own error, as its default
launch does. The launch table never picks it (``bench choose``)."""

from __future__ import annotations

import importlib

import pytest
import torch
import triton
import triton.language as tl

from paged_video import kernels
from paged_video.kernels import pool_layout
from paged_video.kernels._attention_jit import SCORE_BIAS, _biased_scores
from paged_video.kernels._runtime import interpreter_active
from tests.helpers import DEVICE, nan_like, record_launches
from tests.kernels.test_k8v8_attention import check, k8v8_pools, masked_case, p_v_behind_case
from tests.kernels.test_k8v16 import k8v16_pools

launcher = importlib.import_module("paged_video.kernels.paged_attention")
k8v8_tests = importlib.import_module("tests.kernels.test_k8v8_attention")
# The scores' error by the addend's rounding, as a share of the output's largest value and of
# the LSE (the default launch's scores are exact: 2e-6).
SCORE_BITS_RTOL = 5e-4
SCORE_BITS_LSE_RTOL = 1e-4


@triton.jit
def _biased_kernel(sums_ptr, out_ptr, n, BLOCK: tl.constexpr, INTERPRETED: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    sums = tl.load(sums_ptr + offs, mask=offs < n, other=0)
    tl.store(out_ptr + offs, _biased_scores(sums, INTERPRETED) - SCORE_BIAS, mask=offs < n)


def test_biased_scores_are_exact_over_every_sum_8_bit_codes_reach() -> None:
    # |sum| <= 256 * 127**2 < 2**22: the ends, zero, +-1, and random sums between.
    ends = [-(2**22), -(2**22) + 1, -256 * 127**2, -1, 0, 1, 256 * 127**2, 2**22 - 1]
    spread = torch.randint(-(2**22), 2**22, (4096,), generator=torch.Generator().manual_seed(0))
    sums = torch.cat([torch.tensor(ends), spread]).to(torch.int32).to(DEVICE)
    out = torch.full(sums.shape, float("nan"), device=DEVICE)
    n = sums.numel()
    _biased_kernel[(triton.cdiv(n, 1024),)](
        sums, out, n, BLOCK=1024, INTERPRETED=interpreter_active()
    )
    assert torch.equal(out.cpu(), sums.cpu().float())


def forced_bits(monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """Every later launch with ``SCORE_BITS`` set, as the probe's ``+bits`` sets it; returns
    the launches' flags."""
    real_choose = launcher.choose_tiles
    monkeypatch.setattr(
        launcher, "choose_tiles", lambda **kw: {**real_choose(**kw), "SCORE_BITS": True}
    )
    return record_launches(monkeypatch, launcher, "_paged_attention_kernel")


def attend(case, pools: tuple, k8v8: bool, **kwargs) -> torch.Tensor:
    args = (case.q, pools[0], pools[1], case.block_table, case.cu_seqlens_q, case.seq_lens_k)
    scales = dict(k_scale=pools[2], v_channel_scale=pools[3]) if k8v8 else dict(k_scale=pools[2])
    return kernels.paged_attention(
        *args, max_seqlen_q=case.max_seqlen_q, out=nan_like(case.q), block_m=16, **scales,
        **kwargs,
    )  # fmt: skip


# (format, case, block_n, the loop the unmasked tiles take)
LOOPS = [
    pytest.param("k8v8", "masked-B1560", 128, id="k8v8-scores-ahead-B1560-N128"),
    pytest.param("k8v8", "behind-B64", 64, id="k8v8-pv-behind-B64-N64"),
    pytest.param("k8v8", "masked-B24", 128, id="k8v8-plain-loop-B24-N128"),
    pytest.param("k8v16", "behind-B64", 64, id="k8v16-pv-behind-B64-N64"),
    pytest.param("k8v16", "masked-B256", 128, id="k8v16-plain-loop-B256-N128"),
]


def loop_case(name: str):
    """A case and its mask keywords: masked tails and runs of unmasked tiles, GQA 2."""
    kind, block = name.split("-B")
    if kind == "behind":
        return p_v_behind_case(int(block), 80), {}
    return masked_case(int(block), 128)


@pytest.mark.parametrize("fmt, case_name, block_n", LOOPS)
def test_score_bits_keep_each_loop_s_accuracy(
    monkeypatch: pytest.MonkeyPatch, fmt: str, case_name: str, block_n: int
) -> None:
    case, kwargs = loop_case(case_name)
    k8v8 = fmt == "k8v8"
    pools = k8v8_pools(case, per_block=False) if k8v8 else k8v16_pools(case)
    if case_name == "behind-B64":
        pools = (pools[0], pools[1], pool_layout.keys_major(pools[2]), *pools[3:])
    default = None if k8v8 else attend(case, pools, k8v8, block_n=block_n, **kwargs).clone()
    flags = forced_bits(monkeypatch)
    if k8v8:
        # Its probabilities are rounded to e4m3: a score moved by a rounding can move a code
        # a step, so it is held where the default launch is, to the float64 oracle within the
        # format's own error; its LSE, of the scores it used, within their addend's rounding.
        monkeypatch.setattr(k8v8_tests, "LSE_RTOL", SCORE_BITS_LSE_RTOL)
        check(case, pools, block_n=block_n, **kwargs)
    else:
        got = attend(case, pools, k8v8, block_n=block_n, **kwargs)
        assert not torch.isnan(got).any()
        size = default.abs().max().item()
        assert (got - default).abs().max().item() <= SCORE_BITS_RTOL * size
    assert [(f["SCORE_BITS"], f["BLOCK_N"]) for f in flags] == [(True, block_n)]


def test_the_default_launch_converts() -> None:
    tiles = launcher.choose_tiles(
        block_size=16, head_dim=128, max_seqlen_q=3, dtype=torch.float32, k8v8=True
    )
    assert tiles["SCORE_BITS"] is False

"""``paged_attention(scores_ahead=True)``: the unmasked 16-bit loop with each tile's scores one
iteration ahead (``_attend_tiles_ahead``).

Its loop runs one iteration more than the tiles: the first takes no softmax step, the last
computes scores it drops, and K and V come from different tiles in one iteration. So it is
checked against the float64 oracle where those edges fall: runs of zero, one and two whole
tiles, every key path (tiles inside one block by pointers and by descriptor, tiles across two
blocks, per-row block ids), block sizes 1 and 7, GQA, head_dim 80, causal chunks, gaps,
NaN-poisoned pools and outputs, index tensors as strided views; and in fp16 (bf16 on a GPU)
at the launcher's own tiles. Its machine code (the scores' MMA issued under the softmax) is
checked by tests/bench/test_compile_report.py.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from paged_video import kernels, reference
from tests.helpers import DEVICE, nan_like, record_launches
from tests.kernels.paged_case import make_paged_case
from tests.kernels.test_paged_attention import LOW_PRECISION_DTYPES, run_and_compare
from tests.kernels.test_strided_index import FP32_ATOL, column, column_major

launcher = importlib.import_module("paged_video.kernels.paged_attention")
# The first iteration's skipped step computes its rescale from a row max of -inf (-inf - -inf)
# before a select drops it; the interpreter's numpy warns about that NaN.
pytestmark = pytest.mark.filterwarnings(
    "ignore:invalid value encountered in subtract:RuntimeWarning"
)


PATHS = [
    pytest.param(64, 32, 128, id="contiguous-B64-N32"),
    pytest.param(1560, 64, 16, id="block_tiles-B1560-N64"),
    pytest.param(31, 16, 64, id="block_tiles-B31-N16"),
    pytest.param(7, 16, 80, id="block_tiles-B7-N16-D80"),
    pytest.param(1, 16, 16, id="rows-B1-N16"),
    pytest.param(24, 64, 32, id="block_tiles-B24-N64"),
    pytest.param(511, 256, 16, id="two_blocks-B511-N256"),
    # Tiles of two whole blocks: by descriptor in the pair loop ("tma"), per-row ids otherwise.
    pytest.param(16, 32, 32, id="rows-pairs-B16-N32"),
]


@pytest.mark.parametrize("variant", ["cp_async", "tma"])
@pytest.mark.parametrize("block_size, block_n, head_dim", PATHS)
def test_scores_ahead_matches_oracle(
    variant: str, block_size: int, block_n: int, head_dim: int
) -> None:
    # GQA; a causal chunk at the end of the keys, per-row limits and a gap: whole tiles before,
    # between and after masked ones. The second sequence has two whole tiles, the third one.
    k_len = 5 * block_n + 9 if block_size <= 64 else block_size + 2 * block_n + 9
    case = make_paged_case(
        q_lens=[21, 3, 5],
        k_lens=[k_len, 2 * block_n, block_n + 3],
        block_size=block_size,
        num_heads=4,
        num_kv_heads=2,
        head_dim=head_dim,
        device=DEVICE,
    )
    gen = torch.Generator().manual_seed(block_size)
    key_limits = torch.randint(k_len // 2, k_len + 1, (29,), generator=gen, dtype=torch.int32)
    key_limits[21:] = k_len  # rows of the short sequences see all their keys
    key_gap = torch.tensor([[[block_n + 3, 2 * block_n + 1]], [[0, 0]], [[0, 0]]])
    run_and_compare(
        case,
        causal=True,
        key_limits=key_limits.to(DEVICE),
        key_gap=key_gap.to(dtype=torch.int32, device=DEVICE),
        block_m=16,
        block_n=block_n,
        variant=variant,
        scores_ahead=True,
    )


@pytest.mark.parametrize("variant", ["cp_async", "tma"])
@pytest.mark.parametrize("block_size, block_n, head_dim", PATHS)
def test_scores_ahead_over_long_runs_across_blocks(
    variant: str, block_size: int, block_n: int, head_dim: int
) -> None:
    # No causal chunk: every row sees whole tiles over several blocks (so a K or V tile read
    # through the other's block ids shows), then a partial tile; a permuted table.
    k_len = 2 * block_size + 2 * block_n + 5 if block_size > block_n else 7 * block_n + 5
    case = make_paged_case(
        q_lens=[6, 2], k_lens=[k_len, block_n], block_size=block_size, head_dim=head_dim,
        device=DEVICE,
    )  # fmt: skip
    run_and_compare(case, block_m=16, block_n=block_n, variant=variant, scores_ahead=True)


@pytest.mark.parametrize("dtype", LOW_PRECISION_DTYPES)
@pytest.mark.parametrize("block_size", [16, 24, 1560], ids=lambda b: f"B{b}")
def test_scores_ahead_low_precision_at_the_launchers_tiles(
    dtype: torch.dtype, block_size: int
) -> None:
    # The launcher's own tiles (on a GPU the table's: 128-key tiles, TMA at block 1560), 16-bit
    # MMAs, head_dim 128, a causal chunk and a multi-block run.
    case = make_paged_case(
        q_lens=[37, 5], k_lens=[2 * block_size + 300, 130], block_size=block_size,
        head_dim=128, dtype=dtype, device=DEVICE,
    )  # fmt: skip
    run_and_compare(case, causal=True, scores_ahead=True)


@pytest.mark.parametrize("k_len", [0, 1, 15, 16, 17, 32, 47, 48, 161])
def test_scores_ahead_runs_of_any_tile_count(k_len: int) -> None:
    # No masks but the end of the keys: 0, 1, 2, 3 and 10 whole tiles of 16 keys, with and
    # without a partial tile after them, over a permuted table of 7-slot blocks.
    case = make_paged_case(q_lens=[9, 4], k_lens=[k_len, 16], block_size=7, device=DEVICE)
    run_and_compare(case, block_m=16, block_n=16, scores_ahead=True)


def test_scores_ahead_reaches_the_kernel(monkeypatch) -> None:
    launches = record_launches(monkeypatch, launcher, "_paged_attention_kernel")
    case = make_paged_case(q_lens=[5], k_lens=[40], block_size=16, device=DEVICE)
    for flag in (None, True, False):
        kernels.paged_attention(*case.args(), max_seqlen_q=5, scores_ahead=flag)
    assert [launch["SCORES_AHEAD"] for launch in launches] == [False, True, False]


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        pytest.param({"scores_ahead": 1}, TypeError, "scores_ahead must be a bool", id="int"),
        pytest.param(
            {"scores_ahead": True, "dequantize": True}, ValueError, "16-bit", id="quantized"
        ),
        pytest.param({"scores_ahead": True, "k8v8": True}, ValueError, "16-bit", id="k8v8"),
        pytest.param({"scores_ahead": True, "variant": "ws"}, ValueError, "not 'ws'", id="ws"),
    ],
)
def test_scores_ahead_refusals(kwargs: dict, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        kernels.choose_tiles(
            block_size=16, head_dim=64, max_seqlen_q=8, dtype=torch.bfloat16, **kwargs
        )


def test_scores_ahead_refusal_changes_nothing() -> None:
    case = make_paged_case(q_lens=[5], k_lens=[40], block_size=16, device=DEVICE)
    out = torch.zeros_like(case.q)
    with pytest.raises(TypeError, match="scores_ahead"):
        kernels.paged_attention(*case.args(), max_seqlen_q=5, out=out, scores_ahead="yes")
    assert not out.any()


def test_scores_ahead_takes_the_tma_loop_where_the_table_chose_ws(monkeypatch) -> None:
    # A warp-specialized row: the caller's scores_ahead runs the TMA loop with it; tiles of two
    # whole blocks (variant "tma" named at block 64) keep their descriptor loads (the pair loop).
    monkeypatch.setattr(launcher, "interpreter_active", lambda: False)
    ws = dict(variant="ws", block_n=64, scores_ahead=False, num_warps=4, num_stages=2)
    monkeypatch.setattr(launcher.launch_table, "lookup", lambda d, p, m: ws)
    shipped = dict(head_dim=128, max_seqlen_q=4680, dtype=torch.bfloat16)
    tiles = kernels.choose_tiles(block_size=256, scores_ahead=True, **shipped)
    assert (tiles["VARIANT"], tiles["TMA"], tiles["SCORES_AHEAD"]) == ("tma", True, True)
    pairs = dict(block_size=64, block_n=128, variant="tma", **shipped)
    assert kernels.choose_tiles(**pairs)["TMA"]
    tiles = kernels.choose_tiles(scores_ahead=True, **pairs)
    assert (tiles["VARIANT"], tiles["TMA"], tiles["SCORES_AHEAD"]) == ("tma", True, True)


@pytest.mark.parametrize(
    "block_size, block_n, variant",
    [
        pytest.param(64, 32, None, id="contiguous-B64-N32"),
        pytest.param(1, 16, None, id="rows-B1-N16"),
        pytest.param(24, 64, None, id="block_tiles-B24-N64"),
        pytest.param(511, 256, None, id="two_blocks-B511-N256"),
        pytest.param(16, 32, "tma", id="rows-pairs-B16-N32"),
    ],
)
@pytest.mark.parametrize("make_view", [column_major, lambda t: column(t, 0)], ids=["cm", "step"])
def test_scores_ahead_reads_strided_index_tensors(
    block_size: int, block_n: int, variant: str | None, make_view
) -> None:
    # The loop reads the table twice an iteration (K's and V's next block ids): a block table
    # as a strided view, with the sequence bounds as strided columns beside wrong values.
    case = make_paged_case(
        q_lens=[5, 9], k_lens=[2 * block_size + 3 * block_n + 5, block_n + 3],
        block_size=block_size, device=DEVICE,
    )  # fmt: skip
    q, k_cache, v_cache, table, cu, lens = case.args()
    want = reference.paged_attention(*case.args(), max_seqlen_q=9)
    got = kernels.paged_attention(
        q, k_cache, v_cache, make_view(table), column(cu, 4), column(lens, 0), max_seqlen_q=9,
        block_m=16, block_n=block_n, variant=variant, scores_ahead=True, out=nan_like(q),
    )  # fmt: skip
    assert not torch.isnan(got).any()
    torch.testing.assert_close(got, want, atol=FP32_ATOL, rtol=0)

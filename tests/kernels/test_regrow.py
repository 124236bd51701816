"""kernels.regrow: a layer's equalization factors regrow where a later write's rows are many
times wider, and the codes stored for that KV head are rescaled, in every layout a pool has.

The rule's oracle is written out here in float64 (``expected_codes``); the write path is held
to it on the rows a first write stored, and the factors to ``reference.quantize.channel_factors``.
"""

from __future__ import annotations

import contextlib
import importlib

import pytest
import torch

from paged_video import kernels
from paged_video.kernels import equalize
from paged_video.kernels.pool_layout import keys_major
from paged_video.kernels.regrow import REGROW_LOG2, REGROW_MIN_ROWS, regrow_codes, regrown_factors
from paged_video.reference.quantize import K_SHARE, V_SHARE, channel_factors
from tests.helpers import DEVICE

regrow_module = importlib.import_module("paged_video.kernels.regrow")
write_module = importlib.import_module("paged_video.kernels.write_slots")
WHERE = ["triton", "torch"]


@contextlib.contextmanager
def backend(name: str):
    """``triton``: the Triton kernels (the interpreter on a CPU); ``torch``: plain PyTorch."""
    with pytest.MonkeyPatch.context() as patch:
        if name == "torch":
            patch.setattr(regrow_module, "use_torch_path", lambda tensor: True)
            patch.setattr(write_module, "use_torch_path", lambda tensor: True)
        yield


def expected_codes(codes: torch.Tensor, old, new, grown) -> torch.Tensor:
    """Each grown head's codes times ``old / new`` in float64, rounded half to even."""
    scaled = codes.to(torch.float64) * (old.double() / new.double())
    rounded = torch.round(scaled).to(codes.dtype)
    return torch.where(grown.to(codes.device)[:, None], rounded, codes)


def random_codes(shape, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-127, 128, shape, generator=gen, dtype=torch.int8)


def grown_factors(heads: int, dim: int, seed: int):
    """``(old, new, grown)``: powers of two, ``new = old * 2**k`` with k in 0..4 per channel,
    grown every other head (the others' codes must stay as they are, whatever ``new`` says)."""
    gen = torch.Generator().manual_seed(seed)
    old = torch.exp2(torch.randint(0, 5, (heads, dim), generator=gen).float())
    grown = torch.arange(heads) % 2 == 0
    steps = torch.randint(0, 5, (heads, dim), generator=gen).float()
    return old.to(DEVICE), (old * torch.exp2(steps)).to(DEVICE), grown.to(DEVICE)


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize(
    "layout",
    [
        pytest.param((None, 1), id="flat"),
        pytest.param(("slot-major", 1), id="slot-major-B1"),
        pytest.param(("slot-major", 7), id="slot-major-B7"),
        pytest.param(("keys-major", 24), id="keys-major-B24"),
        pytest.param(("strided", 1560), id="strided-B1560"),
    ],
)
def test_regrow_codes_in_every_layout(where: str, layout) -> None:
    # Only grown heads change, each code by exactly the rule; bytes outside the view (a
    # strided pool's gaps) are never touched.
    kind, block = layout
    heads, dim = 3, 80
    old, new, grown = grown_factors(heads, dim, seed=block)
    if kind is None:
        codes = random_codes((45, heads, dim), seed=1).to(DEVICE)
        backing = codes
    elif kind == "strided":
        backing = random_codes((2, block, heads + 1, dim), seed=2).to(DEVICE)
        codes = backing[:, :, 1:]  # every slot's first head is another tensor's
    else:
        codes = random_codes((3, block, heads, dim), seed=3).to(DEVICE)
        if kind == "keys-major":
            codes = keys_major(codes)
        backing = codes
    before, backing_before = codes.clone(), backing.clone()
    with backend(where):
        regrow_codes(codes, old, new, grown)
    assert torch.equal(codes, expected_codes(before, old, new, grown))
    assert (codes != before).any(), "the case must rescale some codes"
    if kind == "strided":
        assert torch.equal(backing[:, :, 0], backing_before[:, :, 0])


@pytest.mark.parametrize("where", WHERE)
def test_regrow_rounds_half_to_even(where: str) -> None:
    values = [5, -5, 7, -7, 3, 1, -1, 127, -127, 6, 10, 0]
    codes = torch.tensor(values, dtype=torch.int8).view(-1, 1, 1).expand(-1, 1, 2).contiguous()
    old = torch.ones(1, 2)
    new = torch.tensor([[2.0, 4.0]])
    with backend(where):
        regrow_codes(
            codes := codes.to(DEVICE),
            old.to(DEVICE),
            new.to(DEVICE),
            torch.tensor([True], device=DEVICE),
        )
    halves = [2, -2, 4, -4, 2, 0, 0, 64, -64, 3, 5, 0]
    quarters = [1, -1, 2, -2, 1, 0, 0, 32, -32, 2, 2, 0]
    assert codes[:, 0, 0].tolist() == halves
    assert codes[:, 0, 1].tolist() == quarters


@pytest.mark.parametrize("smooth", [False, True], ids=["plain", "smoothed"])
@pytest.mark.usefixtures("nan_filled_empty")  # outputs poisoned: every head's must be written
def test_the_rule_kernel_matches_the_plain_path(smooth: bool) -> None:
    # The one-launch rule (channel sums, the factors' rule with its median, the threshold)
    # against the plain-PyTorch path, which is choose_factors' rule: rows without a slot (huge
    # padding), NaN and infinite values left out per element, strided rows, head_dim 80; a
    # head that grows (0, a NaN and an infinity in its growing channel), one a channel short of
    # the threshold (1), one frozen above (2), and one whose lower and upper middle channels
    # differ 16x (3: torch.median's is the lower one; from the upper one it would not grow).
    gen = torch.Generator().manual_seed(11)
    heads, dim, tokens = 4, 80, 70
    rows = torch.randn(tokens, heads + 1, dim, generator=gen)[:, 1:]
    rows[:, :, 3] *= 40.0
    rows[:, 3, 41:] *= 16.0  # 40 channels below the middle (3 is above), 39 above
    rows[5] = 1e6
    rows[7, 0, 3] = float("nan")
    rows[9, 0, 3] = float("inf")
    rows[9, 2, :5] = float("inf")
    slots = torch.arange(tokens)
    slots[5] = -1
    mean = 0.1 * torch.randn(heads, dim, generator=gen) if smooth else None
    candidate = equalize.choose_factors(rows, mean, slots >= 0, K_SHARE)
    assert candidate[:3, 3].min() >= 2.0 ** (REGROW_LOG2 + 1)
    frozen = candidate.clone()
    frozen[0, 3] /= 2.0**REGROW_LOG2
    frozen[1, 3] /= 2.0 ** (REGROW_LOG2 - 1)
    frozen[2] *= 2.0
    frozen[3] = 1.0
    on = [t if t is None else t.to(DEVICE) for t in (frozen, rows, mean, slots)]
    with backend("torch"):
        want_new, want_grown = regrown_factors(*on[:3], on[3], K_SHARE)
    new, grown = regrown_factors(*on[:3], on[3], K_SHARE)
    assert want_grown.tolist() == [True, False, False, True]
    assert torch.equal(grown.cpu(), want_grown.cpu()) and torch.equal(new, want_new)


@pytest.mark.parametrize("where", WHERE)
def test_rows_past_the_mapping_have_no_slot_and_strided_mappings_read_right(where: str) -> None:
    # As write_slots reads them: rows beyond slot_mapping's length (NaN here) are not the
    # write's, and a strided mapping (a column whose neighbours are -1) is read as its values:
    # all 64 rows count, so their 100x wider channels regrow both heads.
    gen = torch.Generator().manual_seed(13)
    rows = torch.randn(REGROW_MIN_ROWS + 5, 2, 16, generator=gen)
    rows[:, :, :4] *= 100.0
    rows[REGROW_MIN_ROWS:] = float("nan")
    column = torch.stack([torch.arange(REGROW_MIN_ROWS), torch.full((REGROW_MIN_ROWS,), -1)], 1)
    slots = column[:, 0]  # stride 2: read as ptr + t it would see every other slot as -1
    frozen = torch.ones(2, 16)
    want = torch.maximum(frozen, channel_factors(rows[:REGROW_MIN_ROWS], share=K_SHARE))
    with backend(where):
        new, grown = regrown_factors(
            frozen.to(DEVICE), rows.to(DEVICE), None, slots.to(DEVICE), K_SHARE
        )
    assert grown.tolist() == [True, True] and torch.equal(new.cpu(), want)


@pytest.mark.parametrize("where", WHERE)
def test_regrown_factors_rule(where: str) -> None:
    # A head regrows where one channel's factor is 2**REGROW_LOG2 times the frozen one or more
    # (then to the elementwise maximum), from REGROW_MIN_ROWS rows on; the other heads keep
    # theirs.
    gen = torch.Generator().manual_seed(5)
    heads, dim = 3, 32
    rows = torch.randn(REGROW_MIN_ROWS, heads, dim, generator=gen)
    rows[:, :, 3] *= 40.0
    slots = torch.arange(REGROW_MIN_ROWS)
    candidate = channel_factors(rows, share=K_SHARE)
    assert candidate[:, 3].min() >= 2.0 ** (REGROW_LOG2 + 1)
    frozen = candidate.clone()
    frozen[0, 3] /= 2.0**REGROW_LOG2  # head 0: exactly the threshold,
    frozen[0, 7] *= 2.0  # and a channel frozen above the rows' choice, which it keeps
    frozen[1, 3] /= 2.0 ** (REGROW_LOG2 - 1)  # head 1: one power of two short
    frozen[2, 3] *= 2.0  # head 2: frozen above what the rows choose; others too
    frozen[2, 5] = candidate[2, 5] / 2.0 ** (REGROW_LOG2 - 1)
    with backend(where):
        new, grown = regrown_factors(frozen, rows, None, slots, K_SHARE)
    assert grown.tolist() == [True, False, False]
    assert torch.equal(new[0], torch.maximum(frozen[0], candidate[0]))
    assert new[0, 7] == frozen[0, 7] > candidate[0, 7] and new[0, 3] == candidate[0, 3]
    assert torch.equal(new[1:], frozen[1:])
    # One row short of the minimum: nothing regrows.
    slots[0] = -1
    with backend(where):
        _, grown = regrown_factors(frozen, rows, None, slots, K_SHARE)
    assert not grown.any()


def zeroed_pools(shape: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    """int8 K and V code pools of ``shape`` and their float32 scales, zeroed."""
    codes = [torch.zeros(shape, dtype=torch.int8, device=DEVICE) for _ in range(2)]
    return (*codes, *(torch.zeros(shape[:-1], device=DEVICE) for _ in range(2)))


def _write(where, key, value, pools, slots, state, **extra) -> None:
    k_pool, v_pool, k_scale, v_scale = pools
    with backend(where):
        kernels.write_slots(
            key, value, k_pool, v_pool, slots, k_scale=k_scale, v_scale=v_scale, **state, **extra
        )


def _state(heads: int, dim: int) -> dict[str, torch.Tensor]:
    """A cache layer's mean, factors and flags, unset."""
    return {
        "k_smooth": torch.zeros(heads, dim, device=DEVICE),
        "k_smooth_chosen": torch.tensor(False),
        "k_equalizer": torch.ones(heads, dim, device=DEVICE),
        "v_equalizer": torch.ones(heads, dim, device=DEVICE),
        "equalizers_chosen": torch.tensor(False),
    }


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("block", [7, 24], ids=lambda b: f"B{b}")
def test_a_later_write_regrows_the_heads_whose_rows_grew(where: str, block: int) -> None:
    # First write: 80 rows chose the mean and factors. Second write, from mid-block: K's head 0
    # with 4 channels 100x wider, V's head 1 with one channel 100x wider. Head 0's K factors
    # and head 1's V factors regrow; the first write's codes of those heads are rescaled (the
    # staged copies too), everything else stays bit for bit, and the second write's rows are
    # quantized with the new factors.
    heads, dim, first, later = 2, 80, 80, 70
    gen = torch.Generator().manual_seed(block)
    key = torch.randn(first + later, heads, dim, generator=gen).to(DEVICE)
    value = torch.randn(first + later, heads, dim, generator=gen).to(DEVICE)
    key[first:, 0, :4] *= 100.0
    value[first:, 1, 9] *= 100.0
    num_blocks = -(-(first + later + 3) // block)
    shape = (num_blocks, block, heads, dim)
    pools = zeroed_pools(shape)
    state = _state(heads, dim)
    slots = torch.arange(3, 3 + first + later, device=DEVICE)
    _write(where, key[:first], value[:first], pools, slots[:first], state)
    staged = [pool.flatten(0, 1)[slots[:first]].clone() for pool in pools[:2]]
    k_old, v_old = state["k_equalizer"].clone(), state["v_equalizer"].clone()
    before = [pool.clone() for pool in pools]
    _write(
        where, key[first:], value[first:], pools, slots[first:], state,
        stage_k=staged[0], stage_v=staged[1],
    )  # fmt: skip
    mean = state["k_smooth"]
    k_new = torch.maximum(
        k_old, channel_factors(key[first:].cpu(), smooth=mean.cpu(), share=K_SHARE).to(DEVICE)
    )
    v_new = torch.maximum(v_old, channel_factors(value[first:].cpu(), share=V_SHARE).to(DEVICE))
    assert (
        torch.equal(state["k_equalizer"][0], k_new[0]) and k_new[0, :4].min() > k_old[0, :4].max()
    )
    assert torch.equal(state["k_equalizer"][1], k_old[1])
    assert torch.equal(state["v_equalizer"][1], v_new[1]) and v_new[1, 9] > v_old[1, 9]
    assert torch.equal(state["v_equalizer"][0], v_old[0])
    k_grown, v_grown = torch.tensor([True, False]), torch.tensor([False, True])
    old_rows = slots[:first]
    for index, (factor_old, factor_new, grown) in enumerate(
        ((k_old, state["k_equalizer"], k_grown), (v_old, state["v_equalizer"], v_grown))
    ):
        stored = before[index].flatten(0, 1)[old_rows]
        want = expected_codes(stored, factor_old, factor_new, grown)
        assert torch.equal(pools[index].flatten(0, 1)[old_rows], want)
        assert torch.equal(staged[index], want)
        assert not torch.equal(want, stored)
        # The first write's scales are kept.
        assert torch.equal(
            pools[2 + index].flatten(0, 1)[old_rows], before[2 + index].flatten(0, 1)[old_rows]
        )
    # The later rows read back within half a step of their own scale under the new factors.
    new_rows = slots[first:]
    for index, (rows, factor) in enumerate(
        ((key[first:] - mean, state["k_equalizer"]), (value[first:], state["v_equalizer"]))
    ):
        codes = pools[index].flatten(0, 1)[new_rows].double()
        scale = pools[2 + index].flatten(0, 1)[new_rows].double()
        back = codes * scale[..., None]
        assert ((back - rows.double() / factor.double()).abs() <= 0.5001 * scale[..., None]).all()


@pytest.mark.parametrize("where", WHERE)
def test_nothing_regrows_without_a_set_flag_or_with_few_rows(where: str) -> None:
    # The write that chooses, a write with explicit factors and no flag, a write of fewer than
    # REGROW_MIN_ROWS rows, and a sharded rank's write (regrow_factors=False) keep the factors
    # and the stored codes, however wide the rows.
    heads, dim = 1, 32
    gen = torch.Generator().manual_seed(9)
    base = torch.randn(REGROW_MIN_ROWS, heads, dim, generator=gen).to(DEVICE)
    wide = base.clone()
    wide[:, :, :2] *= 100.0
    shape = (4 * REGROW_MIN_ROWS, heads, dim)
    pools = zeroed_pools(shape)
    state = _state(heads, dim)
    _write(where, base, base, pools, torch.arange(REGROW_MIN_ROWS, device=DEVICE), state)
    chosen_k = state["k_equalizer"].clone()
    first = pools[0][:REGROW_MIN_ROWS].clone()
    start = REGROW_MIN_ROWS
    few = torch.arange(start, start + REGROW_MIN_ROWS - 1, device=DEVICE)
    _write(where, wide[1:], wide[1:], pools, few, state)
    start += REGROW_MIN_ROWS
    rank = torch.arange(start, start + REGROW_MIN_ROWS, device=DEVICE)
    _write(where, wide, wide, pools, rank, state, regrow_factors=False)
    start += REGROW_MIN_ROWS
    explicit = {k: v for k, v in state.items() if k != "equalizers_chosen"}
    explicit["k_smooth_chosen"] = state["k_smooth_chosen"]
    _write(
        where,
        wide,
        wide,
        pools,
        torch.arange(start, start + REGROW_MIN_ROWS, device=DEVICE),
        explicit,
    )
    assert torch.equal(state["k_equalizer"], chosen_k)
    assert torch.equal(pools[0][:REGROW_MIN_ROWS], first)
    # The same rows with the flag set and enough of them do regrow (the case can fail).
    _write(where, wide, wide, pools, rank, state)
    assert not torch.equal(state["k_equalizer"], chosen_k)
    assert not torch.equal(pools[0][:REGROW_MIN_ROWS], first)


def test_bad_staged_copies_are_refused_before_anything_changes() -> None:
    heads, dim = 2, 16
    key = torch.randn(REGROW_MIN_ROWS, heads, dim).to(DEVICE)
    pools = zeroed_pools((REGROW_MIN_ROWS, heads, dim))
    state = _state(heads, dim)
    slots = torch.arange(REGROW_MIN_ROWS, device=DEVICE)
    snapshot = [t.clone() for t in (*pools, *state.values())]
    for bad, error, word in (
        ({"stage_k": torch.zeros(4, heads, dim + 1, dtype=torch.int8)}, ValueError, "stage_k"),
        ({"stage_v": torch.zeros(4, heads, dim)}, ValueError, "stage_v"),
        ({"stage_k": torch.zeros(heads, dim, dtype=torch.int8)}, ValueError, "stage_k"),
        ({"regrow_factors": 1}, TypeError, "regrow_factors"),
    ):
        with pytest.raises(error, match=word):
            _write("triton", key, key, pools, slots, state, **bad)
        after = [*pools, *state.values()]
        assert all(torch.equal(a, b) for a, b in zip(after, snapshot, strict=True))

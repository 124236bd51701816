"""Property test of regrowing equalization factors (``kernels.regrow``) through ``write_slots``:
a layer written by a random sequence of writes (ragged sizes around ``REGROW_MIN_ROWS``,
chunks starting mid-block, permuted slots, channels of a head growing 1-100x from one write to
the next, K smoothed or not), checked after every write against the rule's float64 oracle
(``reference.regrow``): the factors, which heads grew, every code stored before the write
restated exactly, the write's own rows quantized under the new factors, the scales kept.
Pools are poisoned outside what is written; slots never written keep their NaN scales."""

from __future__ import annotations

import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

from paged_video import kernels
from paged_video.reference.quantize import K_SHARE, V_SHARE, channel_factors, nearest_code_error
from paged_video.reference.regrow import grow, regrow_codes
from tests.helpers import DEVICE
from tests.kernels.test_regrow import WHERE, backend
from tests.kernels.test_write_slots_quantized import POISON_CODE

# Under a second an example under the interpreter, 2 parametrizations: dev 5, ci 30 examples.
EXAMPLES = max(1, settings().max_examples // 2)


@st.composite
def write_sequences(draw):
    heads = draw(st.sampled_from([1, 2]))
    dim = draw(st.sampled_from([16, 80]))
    block = draw(st.sampled_from([1, 7, 24]))
    sizes = draw(st.lists(st.sampled_from([8, 63, 64, 100]), min_size=2, max_size=4))
    # Per later write and head: the channels that widen and by how much (1: none).
    growth = [
        [(draw(st.sampled_from([1.0, 3.0, 20.0, 100.0])), draw(st.integers(0, dim - 4)))
         for _ in range(heads)]
        for _ in sizes[1:]
    ]  # fmt: skip
    return {
        "heads": heads,
        "dim": dim,
        "block": block,
        "sizes": sizes,
        "growth": growth,
        "start": draw(st.integers(0, block - 1)),
        "permuted": draw(st.booleans()),
        "smooth": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**16)),
    }


def _rows(case: dict, gen: torch.Generator) -> tuple[list, list]:
    """Each write's K and V rows: channels widened cumulatively, as K that keeps growing."""
    heads, dim = case["heads"], case["dim"]
    gain = torch.ones(heads, dim)
    keys, values = [], []
    for index, size in enumerate(case["sizes"]):
        if index:
            for head, (factor, first) in enumerate(case["growth"][index - 1]):
                gain[head, first : first + 4] *= factor
        offsets = 3.0 if case["smooth"] else 0.0
        keys.append(torch.randn(size, heads, dim, generator=gen) * gain + offsets)
        values.append(torch.randn(size, heads, dim, generator=gen) * gain)
    return keys, values


@pytest.mark.parametrize("where", WHERE)
@settings(max_examples=EXAMPLES)
@given(case=write_sequences())
def test_every_write_regrows_as_the_oracle_says(where: str, case: dict) -> None:
    gen = torch.Generator().manual_seed(case["seed"])
    heads, dim, block = case["heads"], case["dim"], case["block"]
    keys, values = _rows(case, gen)
    total = sum(case["sizes"])
    num_blocks = -(-(case["start"] + total) // block) + 1
    slots_all = torch.arange(case["start"], case["start"] + total)
    if case["permuted"]:
        slots_all = slots_all[torch.randperm(total, generator=gen)]
    codes = torch.full((num_blocks, block, heads, dim), POISON_CODE[torch.int8], dtype=torch.uint8)
    pools = [codes.view(torch.int8).to(DEVICE), codes.view(torch.int8).clone().to(DEVICE)]
    scales = [torch.full((num_blocks, block, heads), float("nan"), device=DEVICE) for _ in "kv"]
    state = {
        "k_equalizer": torch.ones(heads, dim, device=DEVICE),
        "v_equalizer": torch.ones(heads, dim, device=DEVICE),
        "equalizers_chosen": torch.tensor(False),
    }
    if case["smooth"]:
        state |= {"k_smooth": torch.zeros(heads, dim, device=DEVICE)}
        state |= {"k_smooth_chosen": torch.tensor(False)}
    written = torch.zeros(num_blocks * block, dtype=torch.bool)
    done = 0
    for index, (k, v) in enumerate(zip(keys, values, strict=True)):
        slots = slots_all[done : done + k.shape[0]]
        done += k.shape[0]
        before = [p.flatten(0, 1).clone() for p in (*pools, *scales)]
        old = [state["k_equalizer"].clone(), state["v_equalizer"].clone()]
        with backend(where):
            kernels.write_slots(
                k.to(DEVICE), v.to(DEVICE), *pools, slots.to(DEVICE),
                k_scale=scales[0], v_scale=scales[1], **state,
            )  # fmt: skip
        mean = state["k_smooth"].cpu() if case["smooth"] else None
        new = [state["k_equalizer"].cpu(), state["v_equalizer"].cpu()]
        for j, (rows, smooth, share) in enumerate(((k, mean, K_SHARE), (v, None, V_SHARE))):
            if index == 0:
                want = channel_factors(rows, smooth=smooth, share=share)
                grown = torch.zeros(heads, dtype=torch.bool)
            else:
                candidate = channel_factors(rows, smooth=smooth, share=share)
                want, grown = grow(old[j].cpu(), candidate, rows=rows.shape[0])
            assert torch.equal(new[j], want), (index, j)
            if grown.any():
                event(f"a write regrew {'KV'[j]}")
            # Every code stored before, restated exactly; its scale kept.
            stored = written.nonzero().squeeze(1)
            pool = pools[j].flatten(0, 1).cpu()
            restated = regrow_codes(before[j][stored].cpu(), old[j].cpu(), new[j])
            assert torch.equal(pool[stored], restated), (index, j)
            scale = scales[j].flatten(0, 1).cpu()
            assert torch.equal(scale[stored], before[2 + j][stored].cpu()), (index, j)
            # The write's rows, under the new factors: nearest codes of amax / 127 scales.
            own = (rows - (smooth if smooth is not None else 0.0)) / new[j]
            error = nearest_code_error(pool[slots], scale[slots], own, torch.int8)
            assert error.max() <= 1 + 1e-3, (index, j, error.max().item())
        written[slots] = True
    # Slots never written keep their NaN scales (a regrowth rescales every slot's codes, these
    # included: nothing reads them before a write replaces them).
    untouched = (~written).nonzero().squeeze(1)
    for scale in scales:
        assert scale.flatten(0, 1)[untouched].isnan().all()

"""Property test of the 8-bit formats' 64-key loops with each tile's ``P V`` under the next
softmax (``_attend_pv_behind``): tiles inside one block (blocks 64, 128; 96's piece of 64) and
tiles gathered from several blocks (the rows path: blocks 1, 16, 32) or block pieces (24 = 16 +
8, 48 = 32 + 16, 96 = 64 + 32, 7 = 4 + 2 + 1), against the float64 oracle through each
format's ``check`` (pools NaN-poisoned outside what is written, outputs before the launch).
Under the interpreter the default tile is 512 keys, so only ``block_n=64`` reaches the loop."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

from paged_video.kernels import _attention_jit, pool_layout
from paged_video.kernels.paged_attention import block_pieces
from tests.helpers import DEVICE, ON_GPU
from tests.kernels import test_k8v8_attention as k8v8
from tests.kernels import test_k8v16 as k8v16
from tests.kernels.paged_case import make_paged_case
from tests.kernels.test_strided_index import column

BLOCK_N = 64
BLOCK_SIZES = [1, 7, 16, 24, 32, 48, 64, 96, 128]
# Under a second an example under the interpreter, 18 parametrizations: dev 1, ci 2 examples.
EXAMPLES = max(1, settings().max_examples // 30)


def tile_keys(block_size: int, piece: str) -> int:
    """Keys holding one 64-key tile of the block's ``"largest"`` or ``"smallest"`` piece
    (``block_pieces``): the keys of ``t`` such tiles give that piece ``t`` unmasked tiles."""
    sizes = [size for _, size, _ in block_pieces(block_size, BLOCK_N)]
    return block_size * BLOCK_N // (max(sizes) if piece == "largest" else min(sizes))


@st.composite
def cases(draw, block_size: int):
    span = tile_keys(block_size, "largest")
    sequences = draw(st.integers(1, 3))
    # Per sequence: 0, 1, 2 or more tiles of the largest piece, and a tail that ends mid-block.
    tiles = draw(st.lists(st.sampled_from([0, 1, 2, 3, 5]), min_size=sequences, max_size=sequences))
    tails = draw(st.lists(st.integers(0, span + 5), min_size=sequences, max_size=sequences))
    k_lens = [t * span + tail for t, tail in zip(tiles, tails, strict=True)]
    # The first sequence has queries and 1 to 3 tiles of the smallest piece (more of the
    # others): the k8v8 check needs roundings to measure, and every piece's loop tiles to run
    # (but where masks end them), a tile after another's P V (a V a tile off) from 2 on.
    smallest = tile_keys(block_size, "smallest")
    k_lens[0] = max(k_lens[0], draw(st.integers(1, 3)) * smallest + tails[0])
    q_lens = draw(st.lists(st.integers(0, 8), min_size=sequences, max_size=sequences))
    q_lens[0] = max(q_lens[0], 1)
    num_kv_heads = draw(st.sampled_from([1, 2]))
    group = draw(st.sampled_from([1, 2, 3]))
    head_dim = draw(st.sampled_from([80, 128]))
    table_order = draw(st.sampled_from(["permuted", "repeated"]))
    case = make_paged_case(
        q_lens=q_lens, k_lens=k_lens, block_size=block_size, num_heads=num_kv_heads * group,
        num_kv_heads=num_kv_heads, head_dim=head_dim, table_order=table_order, device=DEVICE,
        seed=draw(st.integers(0, 2**16)),
    )  # fmt: skip
    if draw(st.booleans()):
        # The loop reads its ids through the table's strides.
        case = dataclasses.replace(case, block_table=column(case.block_table, 0))
    masks: dict = {"causal": draw(st.booleans())}
    if draw(st.booleans()):
        # Near the end (a masked tail) or anywhere (0 included): the lowest limit of a
        # program's rows ends its unmasked tiles.
        lowest = [draw(st.sampled_from([0, max(0, k - 70)])) for k in k_lens]
        limits = [
            draw(st.lists(st.integers(low, k), min_size=q, max_size=q))
            for q, k, low in zip(q_lens, k_lens, lowest, strict=True)
        ]
        limits[0][-1] = k_lens[0]  # a row that sees its sequence's keys (but the gap)
        rows = [limit for row in limits for limit in row]
        masks["key_limits"] = torch.tensor(rows, dtype=torch.int32, device=DEVICE)
    if draw(st.booleans()):
        lo = draw(st.integers(0, max(k_lens)))
        width = draw(st.integers(0, 70))
        gap = [[lo, lo + width]] * sequences
        masks["key_gap"] = torch.tensor(gap, dtype=torch.int32, device=DEVICE)[:, None, :]
    # k8v8's gathered tiles take the loop from a keys-major V only.
    return case, masks, draw(st.sampled_from([True, True, True, False]))


def pv_behind_pieces(kv_format: str, block_size: int, keys_major: bool) -> set[int]:
    """The sizes of the pieces whose unmasked tiles take ``_attend_pv_behind`` at 64-key tiles:
    tiles inside a piece, or gathered from pieces dividing the tile (k8v8's from a keys-major V
    in runs of 8 keys or more)."""
    sizes = {size for _, size, masked_only in block_pieces(block_size, BLOCK_N) if not masked_only}
    inside = {size for size in sizes if size % BLOCK_N == 0}
    gathered = {size for size in sizes if BLOCK_N % size == 0}
    if kv_format == "k8v8":
        gathered = {size for size in gathered if keys_major and size % 8 == 0}
    return inside | gathered


def spy_pv_behind(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """``(piece size, unmasked tiles)`` of each ``_attend_pv_behind`` call (interpreter only:
    the kernel's device functions are looked up in the module at each call)."""
    calls: list[tuple[int, int]] = []
    real = _attention_jit._attend_pv_behind

    def spy(*args):
        calls.append((args[-1], int(args[6].handle.data.item())))
        return real(*args)

    monkeypatch.setattr(_attention_jit, "_attend_pv_behind", spy)
    return calls


@pytest.mark.parametrize("block_size", BLOCK_SIZES, ids=lambda b: f"B{b}")
@pytest.mark.parametrize("kv_format", ["k8v8", "k8v16"])
@settings(max_examples=EXAMPLES)
@given(data=st.data())
def test_property_p_v_under_the_next_softmax(kv_format: str, block_size: int, data) -> None:
    case, masks, keys_major = data.draw(cases(block_size))
    if kv_format == "k8v8":
        k_codes, v_codes, k_scale, scales = k8v8.k8v8_pools(
            case, per_block=False, keys_major=keys_major
        )
        if keys_major:
            k_scale = pool_layout.keys_major(k_scale)
        with pytest.MonkeyPatch.context() as patch:
            calls = [] if ON_GPU else spy_pv_behind(patch)
            k8v8.check(case, (k_codes, v_codes, k_scale, scales), block_n=BLOCK_N, **masks)
    else:
        k_codes, v_cache, k_scale = k8v16.k8v16_pools(case)
        if keys_major:
            k_scale = pool_layout.keys_major(k_scale)
        with pytest.MonkeyPatch.context() as patch:
            calls = [] if ON_GPU else spy_pv_behind(patch)
            k8v16.check(case, (k_codes, v_cache, k_scale), block_m=16, block_n=BLOCK_N, **masks)
    if not ON_GPU:
        # Every piece that the loop takes (and only those) went through it.
        assert {size for size, _ in calls} == pv_behind_pieces(kv_format, block_size, keys_major)
    for size, tiles in calls:
        event(f"B{block_size} piece {size}: {min(tiles, 3)}{'+' if tiles >= 3 else ''} tiles")

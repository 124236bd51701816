"""The shard ranks' partial attentions, merged by log-sum-exp, equal the single process's.

All in one process, with the real kernels (Triton's interpreter on a CPU): a single-process
``PagedKVCache`` and ``N`` ``ShardedKVCache`` ranks run the same forwards over NaN-poisoned
pools; each rank writes the K/V of its own blocks and attends every query over its own keys
(``return_lse``), and ``merge_stacked_attention_states`` of the ranks' partials must equal the
single process's ``ForwardCall.attend`` (float32: the merge reorders the softmax's sums, a few
roundings of the values averaged: ``assert_merge_is_one_process``). Blocks of 7 tokens over
frames of 5 (chunks start mid-block), GQA, head_dim 80, action tokens, two CFG rows in one call,
the window sliding; with 3 ranks some rows leave a rank no key (its LSE is -inf and the merge
skips it). Over int8 pools (equalized by default) every rank quantizes with the K mean and the
channel equalization factors of every key of the first forward, as one process does, so the
codes are the same and the merged attention still equals the single process's. There K and V
have a few channels whose width varies from token to token (up to 2**6), so factors chosen from
one rank's tokens would differ from one process's.
"""

from __future__ import annotations

import pytest
import torch

from paged_video.kernels.fused import write_attend
from paged_video.kernels.merge_states import merge_stacked_attention_states
from paged_video.paging import PagedKVCache, PagingConfig
from paged_video.paging.forward import ForwardCall
from paged_video.paging.shard import ShardedForwardCall, ShardedKVCache
from tests.paging.twin import plain_torch_kernels, poison

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 80
# (chunks, commit, action tokens, rows): two rows attend in one call with both branches.
STEPS = [(1, True, 0, 2), (2, False, 3, 2), (2, True, 3, 1), (2, True, 2, 1)]


def widths(tokens: int, generator: torch.Generator) -> torch.Tensor:
    """Per token, the first 8 channels of each KV head 2**U(0, 6) times wider."""
    return widths_of(tokens, HEAD_DIM, generator)


def widths_of(tokens: int, head_dim: int, generator: torch.Generator) -> torch.Tensor:
    """``widths`` for ``head_dim`` channels."""
    gains = torch.ones(tokens, KV_HEADS, head_dim)
    gains[..., :8] = torch.exp2(6 * torch.rand(tokens, KV_HEADS, 8, generator=generator))
    return gains


@pytest.mark.parametrize(
    ("degree", "exact_window", "staged", "kv_dtype"),
    [(2, True, False, None), (3, False, True, torch.int8)],
)
def test_merged_partials_equal_one_process(degree, exact_window, staged, kv_dtype):
    config = PagingConfig(
        block_size=7,
        chunk_size=5,
        sink_chunks=1,
        window_chunks=3,
        max_forward_chunks=2,
        max_action_tokens=3,
        exact_window=exact_window,
        reuse_history_staging=staged,
        kv_dtype=kv_dtype,
    )
    geometry = dict(
        num_layers=1,
        num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        branches=("positive", "negative"),
        dtype=torch.float32,
    )
    single = PagedKVCache(config, **geometry)
    shards = [
        ShardedKVCache(config, shard_degree=degree, shard_index=i, **geometry)
        for i in range(degree)
    ]
    caches = [single, *shards]
    for cache in caches:
        poison(cache)
    sessions = [cache.open_session() for cache in caches]
    generator = torch.Generator().manual_seed(degree)
    empty_rows = 0
    widest = torch.zeros(KV_HEADS, HEAD_DIM)  # of every V written so far
    for chunks, commit, actions, rows in STEPS:
        branches = ("positive", "negative")[:rows]
        n = chunks * config.chunk_size * rows
        q = torch.randn(n, HEADS, HEAD_DIM, generator=generator)
        k, v = torch.randn(2, n, KV_HEADS, HEAD_DIM, generator=generator)
        if kv_dtype is not None:
            k, v = k * widths(n, generator), v * widths(n, generator)
        ak, av = torch.randn(2, actions * rows, KV_HEADS, HEAD_DIM, generator=generator)
        calls = []
        for cache, session in zip(caches, sessions, strict=True):
            plans = [
                cache.plan(session, b, n // rows, commit=commit, action_tokens=actions)
                for b in branches
            ]
            kind = ShardedForwardCall if isinstance(cache, ShardedKVCache) else ForwardCall
            calls.append(kind(cache, plans, softmax_scale=HEAD_DIM**-0.5))
        want = calls[0].attend(0, q, k, v, ak, av)
        outs, lses = [], []
        for call in calls[1:]:
            out, lse = call.attend(0, q, k, v, ak, av)  # this rank's partial attention
            outs.append(out)
            lses.append(lse)
            empty_rows += int((call.local_inputs.seq_lens_k == 0).sum())
        merged, _ = merge_stacked_attention_states(torch.stack(outs), torch.stack(lses))
        assert not merged.isnan().any()
        widest = torch.maximum(widest, torch.cat([v, av]).abs().amax(dim=0))
        assert_merge_is_one_process(merged, want, widest)
        for call in calls:
            call.commit()
    if degree == 3:
        assert empty_rows > 0  # the merge met ranks that saw no key
    if kv_dtype is not None:
        # The ranks froze the single process's mean and factors, and the factors do something.
        for cache in shards:
            assert cache.equalizers_chosen.all() and cache.k_means_chosen.all()
            for name in ("k_means", "k_equalizers", "v_equalizers"):
                assert torch.equal(getattr(cache, name), getattr(single, name)), name
        assert (single.k_equalizers > 1).any() and (single.v_equalizers > 1).any()


@pytest.fixture
def plain():
    """The kernels' plain-PyTorch path (the rule that chooses is the same on every path)."""
    with plain_torch_kernels():
        yield


def assert_merge_is_one_process(merged: torch.Tensor, want: torch.Tensor, widest: torch.Tensor):
    """The ranks' merged partials equal one process's output to float32 rounding. The merge
    reorders the softmax's sums, so an output moves by a few roundings of the values it
    averages, not of its own size: with V's channels up to 2**6 wider, a few float32 ulps of
    the channel's widest V written (``widest (KV heads, D)``; 16 allowed) beside 2e-5 of the
    output (on one CI machine the sums moved an output of 6.3 by 1.6e-4, 5 ulps of its
    channel's widest V, where a fixed 2e-5 failed)."""
    group = merged.shape[1] // widest.shape[0]
    ulps = 16 * torch.finfo(torch.float32).eps * widest.repeat_interleave(group, dim=0)
    allowed = torch.maximum(ulps, torch.tensor(2e-5)) + 2e-5 * want.abs()
    excess = (merged - want).abs() - allowed
    assert (excess <= 0).all(), f"{int((excess > 0).sum())} outputs over, worst by {excess.max()}"


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s bytes as integers: NaN poison compares equal to itself."""
    return tensor.contiguous().view(torch.uint8)


@pytest.mark.parametrize(
    ("degree", "pools", "staged", "grow"),
    [
        (2, {"kv_dtype": torch.int8}, False, False),
        (4, {"kv_dtype": torch.int8}, True, False),
        (2, {"kv_format": "k8v8"}, True, False),
        (4, {"kv_format": "k8v8"}, False, False),
        (2, {"kv_format": "k8v16"}, False, False),
        (4, {"kv_format": "k8v16"}, True, False),
        (2, {"kv_format": "k8v8"}, True, True),
        (4, {"kv_dtype": torch.int8}, False, True),
    ],
    ids=[
        "int8-2",
        "int8-4-staged",
        "k8v8-2-staged",
        "k8v8-4",
        "k8v16-2",
        "k8v16-4-staged",
        "k8v8-2-staged-grows",
        "int8-4-grows",
    ],
)
@pytest.mark.usefixtures("plain")
def test_ranks_store_the_single_process_codes(degree, pools, staged, grow):
    # What a model's processor does (``models.parallel``): the fused op with
    # ``call.layer(i)``'s inputs, every token's q/k/v on every rank. Each rank's first write
    # of a layer must freeze the single process's K mean and equalization factors (and k8v8's
    # V channel scales; k8v16 stores V as it is) chosen from every video token, not the rank's
    # own, so every block a rank stores holds the single process's codes and scales, bit for
    # bit; a rank that chose from its own tokens differs.
    # The first forward has two CFG rows (the later ones one: staged where the cache stages),
    # and chunks of 4 tokens over blocks of 3 start mid-block. ``grow``: chunks of 40 tokens
    # (writes of 64 rows or more) whose keys have, from the second forward on, 4 channels of
    # KV head 0 100x wider, so the K factors regrow (``kernels.regrow``): from every video
    # token's rows on each rank too, as one process's write.
    config = PagingConfig(
        block_size=3,
        chunk_size=40 if grow else 4,
        sink_chunks=1,
        window_chunks=2,
        max_forward_chunks=2,
        **pools,
        smooth_keys=True,
        equalize_channels=True,
        reuse_history_staging=staged,
    )
    geometry = dict(
        num_layers=2, num_kv_heads=KV_HEADS, head_dim=16, branches=("positive", "negative")
    )
    single = PagedKVCache(config, dtype=torch.float32, **geometry)
    shards = [
        ShardedKVCache(config, shard_degree=degree, shard_index=i, dtype=torch.float32, **geometry)
        for i in range(degree)
    ]
    caches = [single, *shards]
    for cache in caches:
        poison(cache)
    sessions = [cache.open_session() for cache in caches]
    generator = torch.Generator().manual_seed(7)
    offsets = 8 * torch.randn(KV_HEADS, 16, generator=generator)  # what smoothing removes
    growth = torch.ones(KV_HEADS, 16)
    first_choice = None
    widest = torch.zeros(2, KV_HEADS, 16)  # per layer, of every V written so far
    for step, (chunks, commit, rows) in enumerate(
        [(2, False, 2), (2, True, 2), (1, True, 1), (2, True, 1)]
    ):
        if grow and step == 1:
            growth[0, :4] = 100.0
            first_choice = single.k_equalizers.clone()
        branches = ("positive", "negative")[:rows]
        n = chunks * config.chunk_size * rows
        calls = []
        for cache, session in zip(caches, sessions, strict=True):
            plans = [cache.plan(session, b, n // rows, commit=commit) for b in branches]
            kind = ShardedForwardCall if isinstance(cache, ShardedKVCache) else ForwardCall
            calls.append(kind(cache, plans, softmax_scale=0.25))
        for layer in range(2):
            q = torch.randn(n, HEADS, 16, generator=generator)
            k, v = torch.randn(2, n, KV_HEADS, 16, generator=generator)
            k = k * widths_of(n, 16, generator) * growth + offsets
            v = v * widths_of(n, 16, generator)
            none = k[:0]
            want = write_attend(q, k, v, none, none, single.pool_tensors, calls[0].layer(layer))
            outs, lses = zip(
                *(
                    write_attend(q, k, v, none, none, call.cache.pool_tensors, call.layer(layer))
                    for call in calls[1:]
                ),
                strict=True,
            )
            merged, _ = merge_stacked_attention_states(torch.stack(outs), torch.stack(lses))
            if single.config.k8v8:
                # Each rank rounds its probabilities to e4m3 against its own row maximum: the
                # merge is near the single process's, not float32-equal (measured 0.11% rel L1).
                rel = ((merged - want).abs().sum() / want.abs().sum()).item()
                assert rel < 5e-3, rel
            else:
                widest[layer] = torch.maximum(widest[layer], v.abs().amax(dim=0))
                assert_merge_is_one_process(merged, want, widest[layer])
        for call in calls:
            call.commit()
    # k8v8: V channel scales in place of V's factors and scales; k8v16: V stored as it is.
    k8v8, k8v16 = single.config.k8v8, single.config.k8v16
    assert (single.k_equalizers > 1).any() and (k8v8 or k8v16 or (single.v_equalizers > 1).any())
    chosen = ("k_means", "k_equalizers", "v_channel_scales" if k8v8 else "v_equalizers")
    stored_names = ("k_pools", "v_pools", "k_scales") + (() if k8v8 or k8v16 else ("v_scales",))
    stored = 0
    for cache in shards:
        for name in chosen:  # (the frozen V channel scales: one block of each, block stride 0)
            mine, theirs = getattr(cache, name), getattr(single, name)
            if name == "v_channel_scales":
                mine, theirs = mine[:, 0], theirs[:, 0]
            assert torch.equal(mine, theirs), name
        for block, physical in cache._physical.items():
            for name in stored_names:
                mine, theirs = getattr(cache, name)[:, physical], getattr(single, name)[:, block]
                assert torch.equal(bits(mine), bits(theirs)), (name, block)
            stored += 1
    held = {b for s in sessions[0].sequences.values() for b in s.block_table if b}
    assert stored == len(held) > degree
    if grow:
        assert (single.k_equalizers[:, 0, :4] > first_choice[:, 0, :4]).all()

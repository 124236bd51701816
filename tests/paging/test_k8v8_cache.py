"""PagingConfig(kv_format=...): the one switch, and a k8v8 cache through ForwardCall (the fused
op) against the same forwards over a float cache and over a raw driver of the same format."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from paged_video.kernels import paged_attention, write_slots
from paged_video.kernels.value_channels import V_HEADROOM
from paged_video.paging import PagedKVCache, PagingConfig
from paged_video.paging.forward import ForwardCall
from tests.helpers import DEVICE
from tests.paging.test_quantized import CONFIG, DIM, HEADS, KV_HEADS, LAYERS, storage_of


@pytest.mark.parametrize(
    "fields, error, match",
    [
        ({"kv_format": "fp8"}, ValueError, "kv_format must be None or one of bf16, k8v8"),
        ({"kv_format": "k8v8", "kv_dtype": torch.int8}, ValueError, "leave kv_dtype unset"),
        ({"kv_format": "k8v8", "int8_mma": True}, ValueError, "int8_mma was deleted"),
        ({"kv_format": "k8v8", "fp8_mma": True}, ValueError, "fp8_mma was deleted"),
        ({"kv_format": "bf16", "keys_major": True}, ValueError, "leave keys_major unset"),
        ({"kv_format": "bf16", "equalize_channels": True}, ValueError, "quantized kv_format"),
    ],
)
def test_kv_format_refuses_what_it_implies(fields: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        dataclasses.replace(CONFIG, **fields)


def k8v8_cache(**kwargs) -> PagedKVCache:
    cache = PagedKVCache(
        dataclasses.replace(CONFIG, kv_format="k8v8"),
        num_layers=LAYERS,
        num_kv_heads=KV_HEADS,
        head_dim=DIM,
        dtype=torch.float32,
        **kwargs,
    )
    storage_of(cache.k_pools, torch.int8).fill_(-128)
    storage_of(cache.v_pools, torch.int8).fill_(0x7F)  # e4m3 NaN
    storage_of(cache.k_scales, torch.float32).fill_(float("nan"))
    return cache


def test_k8v8_cache_tensors() -> None:
    cache = k8v8_cache()
    assert cache.k_pools.dtype == torch.int8 and cache.v_pools.dtype == torch.float8_e4m3fn
    assert cache.v_pools.stride(2) == 1 and cache.k_scales.stride(2) == 1  # keys-major
    assert cache.v_scales.numel() == 0 and cache.v_channel_scales.stride(1) == 0
    assert cache.v_channel_scales.shape == (LAYERS, cache.num_blocks, KV_HEADS, DIM)
    assert cache.v_scales_chosen.device.type == "cpu" and not cache.v_scales_chosen.any()
    layer = cache.layer(0)
    assert layer.k_flat is None and layer.v_scale is None
    assert set(layer.attention_kwargs()) == {"k_scale", "v_channel_scale", "k_equalizer"}
    # The frozen channel scales count once per layer (block stride 0).
    channels = cache.v_channel_scales.untyped_storage().nbytes()
    assert channels == LAYERS * KV_HEADS * DIM * 4


def test_forward_calls_over_k8v8_near_the_float_cache_and_equal_to_a_raw_driver() -> None:
    # Forwards with action tokens while the window slides: the fused op over a k8v8 cache, a
    # raw driver (write_slots and paged_attention with the layer's keywords) over another, and
    # the fused op over a float cache. The two k8v8 caches store and attend alike; the float
    # cache within the format's error.
    fused, raw = k8v8_cache(), k8v8_cache()
    exact = PagedKVCache(
        CONFIG, num_layers=LAYERS, num_kv_heads=KV_HEADS, head_dim=DIM, dtype=torch.float32
    )
    caches = (fused, raw, exact)
    sessions = [cache.open_session() for cache in caches]
    gen = torch.Generator().manual_seed(7)
    n, actions = CONFIG.chunk_size, 2
    first_values = []
    for step in range(4):
        plans = [
            cache.plan(s, "main", n, action_tokens=actions)
            for cache, s in zip(caches, sessions, strict=True)
        ]
        calls = [
            ForwardCall(cache, plan, softmax_scale=0.3)
            for cache, plan in zip(caches, plans, strict=True)
        ]
        raw_inputs = plans[1].prepare()
        for layer in range(LAYERS):
            q = torch.randn(n, HEADS, DIM, generator=gen)
            kv = [
                torch.randn(t, KV_HEADS, DIM, generator=gen) + 3 for t in (n, n, actions, actions)
            ]
            if step == 0 and layer == 0:
                first_values.append(kv[1])
            got = calls[0].attend(layer, q, *kv)
            want = calls[2].attend(layer, q, *kv)
            cache_layer = raw.layer(layer)
            for k, v, slots in ((kv[0], kv[1], raw_inputs.video_slots),
                                (kv[2], kv[3], raw_inputs.action_slots)):  # fmt: skip
                kwargs = cache_layer.write_kwargs()
                if slots is raw_inputs.action_slots:
                    kwargs.pop("v_scale_chosen"), kwargs.pop("k_smooth_chosen")
                    kwargs.pop("equalizers_chosen")
                write_slots(k, v, *cache_layer.write_pools, slots, **kwargs)
            raw_out = paged_attention(
                q, cache_layer.k, cache_layer.v, softmax_scale=0.3,
                **(raw_inputs.attention_kwargs() | cache_layer.attention_kwargs()),
            )  # fmt: skip
            assert not got.isnan().any()
            torch.testing.assert_close(raw_out, got, rtol=0, atol=0)
            rel = ((got - want).abs().sum() / want.abs().sum()).item()
            assert rel < 0.06, f"step {step} layer {layer}: rel L1 {rel:.3f}"
        for call in calls:
            call.commit()
    assert fused.v_scales_chosen.all() and int(fused.v_saturated.sum()) == 0
    # Layer 0's frozen scales: the first write's V amax per channel times 256 / 448.
    amax = first_values[0].abs().amax(dim=0)
    torch.testing.assert_close(fused.v_channel_scales[0, 0], amax * V_HEADROOM / 448)
    for name in ("k_pools", "v_pools", "k_scales", "v_channel_scales"):
        a, b = (getattr(cache, name) for cache in (fused, raw))
        bits = torch.uint8 if a.element_size() == 1 else torch.int32  # (NaN poison included)
        assert torch.equal(a.view(bits), b.view(bits)), name


def test_forward_calls_over_k8v16_near_the_float_cache() -> None:
    # kv_format="k8v16": int8 K codes, V in the cache's dtype; the fused op while the window
    # slides, against the same forwards over a float cache (K's and the query rows' roundings
    # only).
    config = dataclasses.replace(CONFIG, kv_format="k8v16")
    geometry = dict(num_layers=LAYERS, num_kv_heads=KV_HEADS, head_dim=DIM, dtype=torch.float32)
    k8v16, exact = PagedKVCache(config, **geometry), PagedKVCache(CONFIG, **geometry)
    assert k8v16.k_pools.dtype == torch.int8 and k8v16.v_pools.dtype == torch.float32
    assert k8v16.v_scales.numel() == 0 and k8v16.layer(0).v_scale is None
    sessions = [cache.open_session() for cache in (k8v16, exact)]
    gen = torch.Generator().manual_seed(9)
    n, actions = CONFIG.chunk_size, 2
    for _ in range(4):
        calls = [
            ForwardCall(cache, cache.plan(s, "main", n, action_tokens=actions), softmax_scale=0.3)
            for cache, s in zip((k8v16, exact), sessions, strict=True)
        ]
        for layer in range(LAYERS):
            q = torch.randn(n, HEADS, DIM, generator=gen)
            sizes = (n, n, actions, actions)
            kv = [torch.randn(t, KV_HEADS, DIM, generator=gen) + 3 for t in sizes]
            got, want = (call.attend(layer, q, *kv) for call in calls)
            assert not got.isnan().any()
            rel = ((got - want).abs().sum() / want.abs().sum()).item()
            assert 0 < rel < 0.02, rel
        for call in calls:
            call.commit()
    assert k8v16.k_means_chosen.all()


def test_staging_refuses_per_block_channel_scales_and_changes_nothing() -> None:
    # Staging reads the layer's frozen scales for every staged block; per-block ones (a driver
    # of its own passing them in place of the cache's) would need the blocks' scales staged.
    cache = PagedKVCache(
        dataclasses.replace(CONFIG, kv_format="k8v8", reuse_history_staging=True),
        num_layers=LAYERS, num_kv_heads=KV_HEADS, head_dim=DIM, dtype=torch.float32,
    )  # fmt: skip
    session = cache.open_session()
    n = CONFIG.chunk_size
    call = ForwardCall(cache, cache.plan(session, "main", n), softmax_scale=0.3)
    q, k, v = (torch.randn(n, h, DIM) for h in (HEADS, KV_HEADS, KV_HEADS))
    call.attend(0, q, k, v)
    assert call.stage_from == 0, "the staged path did not run"
    cache.v_channel_scales = cache.v_channel_scales.contiguous()  # per block, same values
    before = [t.clone() for t in (cache.k_pools, cache.stage_k, cache.stage_k_scales)]
    with pytest.raises(ValueError, match="frozen v_channel_scales"):
        ForwardCall(cache, cache.plan(session, "main", n), softmax_scale=0.3).attend(0, q, k, v)
    after = (cache.k_pools, cache.stage_k, cache.stage_k_scales)
    bits = [(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(before, after, strict=True)]
    assert all(torch.equal(a, b) for a, b in bits)


@pytest.mark.parametrize("kv_format", ["k8v8", "k8v16"])
def test_keys_that_grow_after_the_first_write_regrow_the_factors(kv_format: str) -> None:
    # From the second frame on, 4 K channels are 100x wider (bench accuracy's k-grows, with q's
    # channels 10x narrower): the first write's factors leave the other channels a code or two
    # (26-33% rel L1 against the float cache with the regrowth switched off), the regrown ones
    # (kernels.regrow) keep the format's own error (3.4-5.0%).
    config = PagingConfig(
        block_size=24, chunk_size=96, sink_chunks=1, window_chunks=2, kv_format=kv_format
    )
    # On a GPU the pools are CUDA tensors and the kernels compiled (bench/gpu_tests.txt).
    geometry = dict(num_layers=1, num_kv_heads=1, head_dim=64, dtype=torch.float32, device=DEVICE)
    caches = (
        PagedKVCache(config, **geometry),
        PagedKVCache(dataclasses.replace(config, kv_format="bf16"), **geometry),
    )
    sessions = [cache.open_session() for cache in caches]
    gen = torch.Generator().manual_seed(3)
    gain = torch.ones(1, 64)
    for frame in range(3):
        if frame == 1:
            gain[:, :4] = 100.0
        calls = [
            ForwardCall(cache, cache.plan(s, "main", 96), softmax_scale=64**-0.5)
            for cache, s in zip(caches, sessions, strict=True)
        ]
        q = (torch.randn(96, 2, 64, generator=gen) / gain.sqrt()).to(DEVICE)
        k = (torch.randn(96, 1, 64, generator=gen) * gain).to(DEVICE)
        v = torch.randn(96, 1, 64, generator=gen).to(DEVICE)
        got, want = (call.attend(0, q, k, v) for call in calls)
        rel = ((got - want).abs().sum() / want.abs().sum()).item()
        assert rel < 0.06, (frame, rel)
        for call in calls:
            call.commit()
    assert (caches[0].k_equalizers[0, 0, :4] == 8).all()


def test_v_its_frozen_scales_cannot_hold_is_an_error_when_checked() -> None:
    # Forwards through the fused op: the first chooses layer 0's frozen V channel scales; a
    # later one writing V 1000x wider (past the headroom of 256) saturates, and one writing a
    # row 1e-7 of the first's loses it (every code rounds to zero). The cache counts them on
    # the device at the write and raises where a caller checks, naming the layers.
    cache = k8v8_cache()
    session = cache.open_session()
    gen = torch.Generator().manual_seed(3)
    n = CONFIG.chunk_size

    def forward(v_gain: dict[int, float]) -> None:
        call = ForwardCall(cache, cache.plan(session, "main", n), softmax_scale=0.3)
        for layer in range(LAYERS):
            q = torch.randn(n, HEADS, DIM, generator=gen)
            k = torch.randn(n, KV_HEADS, DIM, generator=gen)
            v = torch.randn(n, KV_HEADS, DIM, generator=gen) * v_gain.get(layer, 1.0)
            call.attend(layer, q, k, v)
        call.commit()

    forward({})
    forward({})
    cache.check_v_saturation()  # V as wide as the first write's: held
    forward({0: 1000.0})
    with pytest.raises(ValueError, match=r"k8v8 stored \d+ V elements .*\{0: \d+\}.*k8v16"):
        cache.check_v_saturation()
    saturated = int(cache.v_saturated[0])
    assert saturated > 0 and int(cache.v_saturated[1:].sum()) == 0
    forward({LAYERS - 1: 1e-7})
    lost = n * KV_HEADS * DIM  # every element of the rows written
    with pytest.raises(ValueError, match=rf"\{{0: {saturated}, {LAYERS - 1}: {lost}\}}"):
        cache.check_v_saturation()
    float_cache = PagedKVCache(
        CONFIG, num_layers=LAYERS, num_kv_heads=KV_HEADS, head_dim=DIM, dtype=torch.float32
    )
    float_cache.check_v_saturation()  # nothing to check

"""Quantized caches (``PagingConfig(kv_dtype=...)``) driven through plans and ``ForwardCall``.

Every forward's attention is checked against float64 dense attention over the dequantized
codes and scales of exactly the tokens the window oracle says it reads, each taken from the
pools right after the forward that wrote it: so a token whose codes or scales were rewritten
later (by eviction, compaction or another forward) fails, and so does one read from a wrong
slot. Surviving tokens are also checked bit for bit after every commit. Pools start poisoned
(NaN codes or int8's never-written -128, NaN scales).
"""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch
from torch import Tensor

from paged_video import kernels, reference
from paged_video.kernels import paged_attention, write_slots
from paged_video.paging import PagedKVCache, PagingConfig, Session
from paged_video.paging.forward import ForwardCall
from paged_video.reference.quantize import K_SHARE, channel_factors, dequantize, nearest_code_error
from tests.paging.rollout import geometry_of
from tests.paging.twin import plain_torch_kernels

attention_module = importlib.import_module("paged_video.kernels.paged_attention")

# The pools with a scale per slot (the e4m3 one was deleted, issue 45).
FORMATS = [pytest.param(torch.int8, id="int8")]
POISON = {torch.int8: -128}
ATOL = 2e-5
LAYERS, HEADS, KV_HEADS, DIM = 2, 2, 1, 8
# Chunks of 6 over blocks of 4 (the sink ends mid-block), a window of two chunks: evictions and
# compactions (unit lcm(6, 4) = 12 tokens) start on the third commit.
CONFIG = PagingConfig(
    block_size=4, chunk_size=6, sink_chunks=1, window_chunks=2, max_action_tokens=3
)


@pytest.fixture
def plain():
    with plain_torch_kernels():
        yield


def poisoned_cache(config: PagingConfig, **kwargs) -> PagedKVCache:
    cache = PagedKVCache(
        config,
        num_layers=LAYERS,
        num_kv_heads=KV_HEADS,
        head_dim=DIM,
        dtype=torch.float32,
        **kwargs,
    )
    # Whole storages: a keys-major pool's rows' padding too, which no kernel may read.
    for codes in (cache.k_pools, cache.v_pools, cache.stage_k, cache.stage_v):
        storage_of(codes, torch.int8).fill_(POISON[cache.k_pools.dtype])
    for scales in (cache.k_scales, cache.v_scales, cache.stage_k_scales, cache.stage_v_scales):
        storage_of(scales, torch.float32).fill_(float("nan"))
    return cache


def storage_of(tensor: Tensor, dtype: torch.dtype) -> Tensor:
    """All of ``tensor``'s storage as a flat tensor of ``dtype`` (padding included)."""
    return torch.empty(0, dtype=dtype, device=tensor.device).set_(tensor.untyped_storage())


class QuantizedRollout:
    """Forwards of one cache, each checked against the oracle over the dequantized pools."""

    def __init__(self, config: PagingConfig, **kwargs) -> None:
        self.cache = poisoned_cache(config, **kwargs)
        self.config, self.geometry = config, geometry_of(config)
        self.gen = torch.Generator().manual_seed(0)
        # (session, branch, layer, model position) -> codes and scales as written, K and V.
        self.stored: dict[tuple, tuple[Tensor, ...]] = {}
        self.offsets = torch.linspace(-30, 30, DIM)  # K channel outliers, what smoothing removes
        # V channels 25x wider, token by token: what channel equalization evens out (int8).
        self.gains = torch.ones(DIM)
        self.gains[[2, 5]] = 25.0

    def _random(self, tokens: int, heads: int, offset: bool = False, gain: bool = False) -> Tensor:
        x = torch.randn(tokens, heads, DIM, generator=self.gen)
        x = x * self.gains if gain else x
        return x + self.offsets if offset else x

    def _read(self, layer: int, slots: Tensor) -> tuple[Tensor, ...]:
        cache = self.cache
        flat = [t[layer].flatten(0, 1)[slots].clone() for t in (cache.k_pools, cache.v_pools)]
        scales = [t[layer].flatten(0, 1)[slots].clone() for t in (cache.k_scales, cache.v_scales)]
        return flat[0], scales[0], flat[1], scales[1]

    def forward(
        self, rows: list[tuple[Session, str]], *, commit: bool, actions: int = 0
    ) -> ForwardCall:
        n = self.config.chunk_size
        plans = [
            self.cache.plan(session, branch, n, commit=commit, action_tokens=actions)
            for session, branch in rows
        ]
        call = ForwardCall(self.cache, plans, softmax_scale=DIM**-0.5)
        inputs = call.inputs
        for layer in range(LAYERS):
            q = self._random(n * len(rows), HEADS)
            k, v = (
                self._random(n * len(rows), KV_HEADS, True),
                self._random(n * len(rows), KV_HEADS, gain=True),
            )
            ak = self._random(actions * len(rows), KV_HEADS, True)
            av = self._random(actions * len(rows), KV_HEADS, gain=True)
            out = call.attend(layer, q, k, v, ak, av)
            assert not torch.isnan(out).any(), "attention read a poisoned slot"
            video = self._read(layer, inputs.video_slots)
            action = self._read(layer, inputs.action_slots)
            mean = self.cache.k_means[layer] if self.config.smooth_keys else 0.0
            k_factor, v_factor = self.factors(layer)
            dtype = self.cache.k_pools.dtype
            stored_k, stored_v = (k - mean) / k_factor, v / v_factor
            assert nearest_code_error(video[0], video[1], stored_k, dtype).max() <= 1 + 1e-3
            assert nearest_code_error(video[2], video[3], stored_v, dtype).max() <= 1 + 1e-3
            for r, plan in enumerate(plans):
                rq, ra = slice(r * n, (r + 1) * n), slice(r * actions, (r + 1) * actions)
                own = [t[rq] for t in video]
                self._check_row(plan, layer, q[rq], out[rq], own, [t[ra] for t in action])
                if commit:
                    for t in range(n):
                        key = (plan.session.id, plan.branch, layer, plan.history + t)
                        self.stored[key] = tuple(x[t] for x in own)
        call.commit()
        self.check_survivors()
        return call

    def factors(self, layer: int) -> tuple[Tensor | float, Tensor | float]:
        """The layer's K and V equalization factors (1 without equalization)."""
        cache = self.cache
        if not cache.equalizers_chosen.numel():
            return 1.0, 1.0
        return cache.k_equalizers[layer], cache.v_equalizers[layer]

    def _check_row(self, plan, layer, q, out, own, action) -> None:
        sid, branch = plan.session.id, plan.branch
        reads = (
            reference.kept_positions if self.config.exact_window else reference.block_read_positions
        )
        past = [p for p in reads(self.geometry, plan.history, plan.num_tokens) if p < plan.history]
        rows = [self.stored[sid, branch, layer, p] for p in past]
        k_codes, k_scale, v_codes, v_scale = (
            torch.stack([row[i] for row in rows] + list(x) + list(a))
            for i, (x, a) in enumerate(zip(own, action, strict=True))
        )
        k_factor, v_factor = self.factors(layer)
        keys = dequantize(k_codes, k_scale) * k_factor
        values = dequantize(v_codes, v_scale) * v_factor
        want = reference.dense_attention(q, keys, values, softmax_scale=DIM**-0.5)
        error = (out.double() - want).abs().max().item()
        limit = ATOL * max(1.0, want.abs().max().item())
        assert error <= limit, f"layer {layer}, history {plan.history}: max error {error:.2e}"

    def check_survivors(self) -> None:
        """Every resident committed token still holds its codes and scales, bit for bit."""
        config, cache = self.config, self.cache
        b, s = config.block_size, config.sink_tokens
        for session in cache.sessions.values():
            for branch, seq in session.sequences.items():
                table = list.copy(seq.block_table)
                for p in reference.resident_positions(self.geometry, seq.absolute):
                    storage = p if p < s else p - seq.compacted
                    slot = torch.tensor([table[storage // b] * b + storage % b])
                    for layer in range(LAYERS):
                        now = [t[0] for t in self._read(layer, slot)]
                        was = self.stored[session.id, branch, layer, p]
                        for x, y in zip(now, was, strict=True):
                            assert torch.equal(x.view(torch.uint8), y.view(torch.uint8))


@pytest.mark.parametrize(
    "staged, block_size, keys_major",
    [
        pytest.param(False, 4, False, id="paged"),
        pytest.param(True, 4, False, id="staged"),
        # Chunks on block edges: committing forwards keep the staged history (and its scales).
        pytest.param(True, 3, False, id="staged-kept"),
        # Pools and scales keys-major (written by block and offset, staged slot-major).
        pytest.param(False, 4, True, id="keys-major"),
        pytest.param(True, 3, True, id="keys-major-staged-kept"),
    ],
)
@pytest.mark.parametrize("dtype", FORMATS)
def test_forwards_match_the_oracle_over_dequantized_pools(
    dtype: torch.dtype, staged: bool, block_size: int, keys_major: bool
) -> None:
    config = dataclasses.replace(
        CONFIG,
        block_size=block_size,
        kv_dtype=dtype,
        reuse_history_staging=staged,
        keys_major=keys_major,
    )
    rollout = QuantizedRollout(config)
    cache = rollout.cache
    session = cache.open_session()
    rows = [(session, "main")]
    kept = []
    for tick in range(7):
        if tick % 2 == 0:
            rollout.forward(rows, commit=False, actions=tick % 3)
        kept.append(rollout.forward(rows, commit=True).stage_from > 0)
        if tick == 0:  # chosen by the first forward, a scratch one
            means = cache.k_means.clone()
            factors = (cache.k_equalizers.clone(), cache.v_equalizers.clone())
    assert any(kept) == (block_size == 3)
    # The window slid and compacted, and no survivor's codes or scales were rewritten.
    assert session.sequences["main"].compacted > 0
    assert cache.k_means_chosen.all() and torch.equal(cache.k_means, means)
    # int8 equalizes by default: chosen by the first forward too, and frozen.
    assert cache.equalizers_chosen.numel() == (LAYERS if dtype == torch.int8 else 0)
    assert cache.equalizers_chosen.all()
    if dtype == torch.int8:
        assert bool((cache.v_equalizers[:, :, [2, 5]] >= 8).all())
    assert torch.equal(cache.k_equalizers, factors[0])
    assert torch.equal(cache.v_equalizers, factors[1])


@pytest.mark.parametrize("dtype", FORMATS)
def test_batched_branches_share_one_mean_and_keep_their_codes(dtype: torch.dtype) -> None:
    config = dataclasses.replace(CONFIG, kv_dtype=dtype, exact_window=True)
    rollout = QuantizedRollout(config, branches=("pos", "neg"))
    session = rollout.cache.open_session()
    rows = [(session, "pos"), (session, "neg")]
    rollout.forward(rows, commit=True, actions=2)
    means = rollout.cache.k_means.clone()
    # The first call's video keys, both rows: their mean is near the channel offsets.
    assert (means - rollout.offsets).abs().max() < 1.0
    for _ in range(3):
        rollout.forward(rows, commit=False)
        rollout.forward(rows, commit=True)
    assert torch.equal(rollout.cache.k_means, means)


def test_unsmoothed_cache_has_no_means() -> None:
    config = dataclasses.replace(CONFIG, kv_dtype=torch.int8, smooth_keys=False)
    rollout = QuantizedRollout(config)
    assert rollout.cache.k_means.numel() == 0 and rollout.cache.k_means_chosen.numel() == 0
    assert rollout.cache.layer(0).k_mean is None
    factors = {"k_equalizer", "v_equalizer"}  # int8: equalized by default
    write = rollout.cache.layer(0).write_kwargs()
    assert write.keys() == {"k_scale", "v_scale", "equalizers_chosen"} | factors
    session = rollout.cache.open_session()
    for _ in range(3):
        rollout.forward([(session, "main")], commit=True)


@pytest.mark.parametrize("staged", [False, True], ids=["paged", "staged"])
@pytest.mark.parametrize("dtype", [*FORMATS, pytest.param(None, id="float")])
def test_cache_tensors(dtype: torch.dtype | None, staged: bool) -> None:
    config = dataclasses.replace(CONFIG, kv_dtype=dtype, reuse_history_staging=staged)
    cache = PagedKVCache(config, num_layers=3, num_kv_heads=2, head_dim=8, dtype=torch.float32)
    pool = (3, cache.num_blocks, 4, 2, 8)
    stage = (3, cache.max_seqlen_k if staged else 0, 2, 8)
    assert cache.k_pools.shape == cache.v_pools.shape == pool
    assert cache.stage_k.shape == cache.stage_v.shape == stage
    tensors = cache.pool_tensors
    assert [t.data_ptr() for t in tensors[:4]] == [
        t.data_ptr() for t in (cache.k_pools, cache.v_pools, cache.stage_k, cache.stage_v)
    ]
    layer = cache.layer(1)
    if dtype is None:
        assert cache.k_pools.dtype == cache.stage_k.dtype == torch.float32
        assert all(t.numel() == 0 for t in tensors[4:])
        assert layer.k_scale is layer.v_scale is layer.k_mean is layer.k_mean_chosen is None
        assert layer.k_equalizer is layer.v_equalizer is layer.equalizers_chosen is None
        assert layer.write_kwargs() == {} == layer.attention_kwargs()
        return
    views = ("k_scale", "k_scales"), ("v_scale", "v_scales"), ("k_mean", "k_means")
    for name, whole in (*views, ("k_mean_chosen", "k_means_chosen")):
        view, stacked = getattr(layer, name), getattr(cache, whole)
        assert view.data_ptr() == stacked[1].data_ptr() and view.shape == stacked.shape[1:]
    write, attend = layer.write_kwargs(), layer.attention_kwargs()
    factors = {"k_equalizer", "v_equalizer"} if dtype == torch.int8 else set()
    flags = {"equalizers_chosen"} if factors else set()
    assert write.keys() == {"k_scale", "v_scale", "k_smooth", "k_smooth_chosen"} | factors | flags
    assert write["k_scale"].shape == (cache.num_blocks * 4, 2) and write["k_smooth"] is not None
    assert attend.keys() == {"k_scale", "v_scale"} | factors
    assert attend["k_scale"] is layer.k_scale and attend["v_scale"] is layer.v_scale
    for name in factors:
        assert write[name] is attend[name] is getattr(layer, name)
    if flags:
        assert write["equalizers_chosen"] is layer.equalizers_chosen
    assert cache.k_pools.dtype == cache.v_pools.dtype == cache.stage_k.dtype == dtype
    for name, shape, scale_dtype in (
        ("k_scales", pool[:-1], torch.float32),
        ("v_scales", pool[:-1], torch.float32),
        ("stage_k_scales", stage[:-1], torch.float32),
        ("stage_v_scales", stage[:-1], torch.float32),
        ("k_means", (3, 2, 8), torch.float32),
        ("k_means_chosen", (3,), torch.bool),
    ):
        tensor = getattr(tensors, name)
        assert tensor is getattr(cache, name)
        assert tensor.shape == shape and tensor.dtype == scale_dtype, name
        assert tensor.device == cache.device
    assert not cache.k_means_chosen.any() and not cache.k_means.any()
    # Channel equalization: int8 by default, factors of 1 until a layer's first write.
    equalized = dtype == torch.int8
    for name, shape, factor_dtype in (
        ("k_equalizers", (3, 2, 8), torch.float32),
        ("v_equalizers", (3, 2, 8), torch.float32),
        ("equalizers_chosen", (3,), torch.bool),
    ):
        tensor = getattr(tensors, name)
        assert tensor is getattr(cache, name) and tensor.dtype == factor_dtype
        assert tensor.shape == (shape if equalized else (0,)), name
    assert cache.equalizers_chosen.device.type == "cpu"
    if equalized:
        assert bool((cache.k_equalizers == 1).all() and (cache.v_equalizers == 1).all())
        assert not cache.equalizers_chosen.any()
        for name, whole in (
            ("k_equalizer", "k_equalizers"),
            ("v_equalizer", "v_equalizers"),
            ("equalizers_chosen", "equalizers_chosen"),
        ):
            view, stacked = getattr(layer, name), getattr(cache, whole)
            assert view.data_ptr() == stacked[1].data_ptr() and view.shape == stacked.shape[1:]
    else:
        assert layer.k_equalizer is layer.v_equalizer is layer.equalizers_chosen is None
    if staged:
        assert cache.staging.k_scales is cache.stage_k_scales


MODES = [pytest.param({"kv_dtype": torch.int8}, id="int8")]


@pytest.mark.parametrize("block_size", [1, 4, 24])
@pytest.mark.parametrize("mode", MODES)
def test_keys_major_cache_pools(mode: dict, block_size: int) -> None:
    # The scales keys-major, rows padded to 16 keys; K's and V's codes slot-major
    # (Q K^T reduces over channels). No flat views (a flatten would copy), so drivers write the
    # 4-D pools with 3-D scales; staging stays slot-major. The pools are the ones the TMA loop
    # reads.
    config = dataclasses.replace(
        CONFIG, block_size=block_size, keys_major=True, reuse_history_staging=True, **mode
    )
    sizes = dict(num_layers=3, num_kv_heads=2, head_dim=16)
    cache = PagedKVCache(config, **sizes)
    slot_major = PagedKVCache(dataclasses.replace(config, keys_major=False), **sizes)
    row = 1 if block_size == 1 else -(-block_size // 16) * 16  # keys per padded row
    keys_major = {"k_scales", "v_scales"}
    padding = 0
    for name in ("k_pools", "v_pools", "k_scales", "v_scales"):
        pools, plain = getattr(cache, name), getattr(slot_major, name)
        assert pools.shape == plain.shape and pools.dtype == plain.dtype, name
        wanted = name in keys_major
        assert kernels.pool_layout.keys_aligned(pools[1]) == (wanted and block_size > 1), name
        assert pools.is_contiguous() == (not wanted or block_size in (1, 16)), name
        stored = plain.untyped_storage().nbytes()
        assert pools.untyped_storage().nbytes() == (
            stored * row // block_size if wanted else stored
        )
        padding += stored * (row - block_size) // block_size if wanted else 0
    assert cache.pool_bytes - slot_major.pool_bytes == padding
    assert (padding > 0) == (block_size > 1)
    assert cache.block_bytes == slot_major.block_bytes + padding // cache.num_blocks
    assert cache.stage_k.is_contiguous() and cache.stage_k_scales.is_contiguous()
    layer = cache.layer(1)
    assert layer.k_flat is None and layer.v_flat is None
    assert [t.data_ptr() for t in layer.write_pools] == [layer.k.data_ptr(), layer.v.data_ptr()]
    write = layer.write_kwargs()
    assert write["k_scale"] is layer.k_scale and write["v_scale"] is layer.v_scale
    flat = slot_major.layer(1)
    assert [t.data_ptr() for t in flat.write_pools] == [
        flat.k_flat.data_ptr(),
        flat.v_flat.data_ptr(),
    ]
    assert flat.write_pools[0].shape == (slot_major.num_blocks * block_size, 2, 16)
    # The launcher's TMA loop reads these pools (descriptors over K and V, the scales).
    for pools, want in ((layer, block_size > 1), (flat, False)):
        scales = (pools.k_scale, pools.v_scale)
        assert attention_module._descriptor_layout(pools.k, pools.v, 16, 16, scales) == want


def test_keys_major_needs_quantized_pools() -> None:
    config = dataclasses.replace(CONFIG, keys_major=True)
    with pytest.raises(ValueError, match="keys_major needs quantized pools"):
        PagedKVCache(config, num_layers=1, num_kv_heads=1, head_dim=8)
    with pytest.raises(TypeError, match="keys_major"):
        dataclasses.replace(CONFIG, keys_major=1)
    # The cache's dtype may name the format.
    cache = PagedKVCache(config, num_layers=1, num_kv_heads=1, head_dim=8, dtype=torch.int8)
    assert kernels.pool_layout.is_keys_major(cache.k_scales[0])


@pytest.mark.parametrize("dtype", FORMATS)
def test_pool_bytes_of_quantized_pools_are_at_most_54_percent_of_bf16(dtype: torch.dtype) -> None:
    layers, heads, head_dim = 2, 3, 128
    config = PagingConfig(block_size=16, chunk_size=24, sink_chunks=1, window_chunks=3)
    sizes = dict(num_layers=layers, num_kv_heads=heads, head_dim=head_dim)
    bf16 = PagedKVCache(config, **sizes, dtype=torch.bfloat16)
    quantized = PagedKVCache(dataclasses.replace(config, kv_dtype=dtype), **sizes)
    slots = layers * bf16.num_blocks * config.block_size
    assert quantized.num_blocks == bf16.num_blocks and slots == 384
    # Per (slot, KV head): bf16 K and V are 2 x 128 x 2 = 512 bytes; codes 2 x 128 x 1 and
    # float32 scales 2 x 4 are 264, so 264 / 512 = 51.6%. Plus the K means and (int8: channel
    # equalization) the K and V factors: 4 bytes each per (layer, KV head, channel), once:
    # (384 * 264 + 3 * 2 * 128 * 4) / (384 * 512) = 0.5312 for int8.
    per_layer = 1 + 2 * (dtype == torch.int8)
    assert bf16.pool_bytes == slots * heads * 2 * head_dim * 2
    assert (
        quantized.pool_bytes
        == slots * heads * 2 * (head_dim + 4) + per_layer * layers * heads * head_dim * 4
    )
    ratio = quantized.pool_bytes / bf16.pool_bytes
    assert ratio == (slots * 264 + per_layer * layers * 128 * 4) / (slots * 512)
    assert ratio <= 0.54


def test_cache_dtype_may_name_the_quantized_format() -> None:
    cache = PagedKVCache(CONFIG, num_layers=1, num_kv_heads=1, head_dim=4, dtype=torch.int8)
    assert cache.k_pools.dtype == torch.int8 and cache.k_scales.shape == cache.k_pools.shape[:-1]
    # The deleted e4m3 pool (issue 45) names what replaced it.
    with pytest.raises(ValueError, match=r'dtype=torch\.float8_e4m3fn .*"k8v16".*"k8v8"'):
        PagedKVCache(CONFIG, num_layers=1, num_kv_heads=1, head_dim=4, dtype=torch.float8_e4m3fn)
    with pytest.raises(TypeError, match="dtype must be a floating-point"):
        PagedKVCache(CONFIG, num_layers=1, num_kv_heads=1, head_dim=4, dtype=torch.int16)


def test_quantized_pools_too_large_to_allocate_name_the_scales() -> None:
    config = dataclasses.replace(CONFIG, kv_dtype=torch.int8)
    with pytest.raises(ValueError, match=r"cannot allocate the pools .* float32 scales"):
        PagedKVCache(config, num_layers=2**40, num_kv_heads=1, head_dim=4)


@pytest.mark.usefixtures("plain")
@pytest.mark.parametrize("keys_major", [False, True], ids=["slot-major", "keys-major"])
def test_raw_driver_then_forward_call_on_a_smoothed_equalized_int8_cache(keys_major) -> None:
    # The README's raw driver (plan.prepare, write_slots, paged_attention with the layer's
    # write_kwargs and attention_kwargs) over an int8 cache with smoothing and channel
    # equalization on (the defaults), then a ForwardCall: the raw driver's first write chooses
    # each layer's K mean, then its factors (from K minus that mean), and records them, so the
    # fused op keeps them and history and new keys are shifted and divided alike.
    c, heads, dim = 8, 2, 8
    config = PagingConfig(
        block_size=4,
        chunk_size=c,
        sink_chunks=2,
        window_chunks=3,
        kv_dtype=torch.int8,
        keys_major=keys_major,
    )
    cache = PagedKVCache(config, num_layers=LAYERS, num_kv_heads=heads, head_dim=dim)
    session = cache.open_session()
    gen = torch.Generator().manual_seed(3)
    offsets = torch.linspace(-30, 30, dim)  # what smoothing removes
    # Two channels 16x and 64x wider than the rest, in K and in V: what equalization evens out.
    widths = torch.tensor([1.0] * (dim - 2) + [16.0, 64.0])

    def qkv() -> list[Tensor]:
        q, k, v = (torch.randn(c, heads, dim, generator=gen) for _ in range(3))
        # q shrinks by K's RMS width: the logits keep unit spread, as a trained model's do.
        return [q / widths.square().mean().sqrt(), k * widths + offsets, v * widths]

    history: list[list[Tensor]] = [[] for _ in range(LAYERS)]  # per layer: committed K, V

    def check(layer: int, q: Tensor, k: Tensor, v: Tensor, out: Tensor) -> None:
        keys = torch.cat([*history[layer][0::2], k])  # the window keeps every token here
        values = torch.cat([*history[layer][1::2], v])
        want = reference.dense_attention(q, keys, values, softmax_scale=dim**-0.5)
        error = ((out.double() - want).abs() / widths).max().item()  # per channel's width
        assert error < 0.03, f"layer {layer}: max error {error:.3f} against exact attention"

    for commit in (False, True, True):  # a probe, then two committed frames
        plan = cache.plan(session, "main", c, commit=commit)
        inputs = plan.prepare()
        for i in range(LAYERS):
            q, k, v = qkv()
            layer = cache.layer(i)
            write_slots(k, v, *layer.write_pools, inputs.video_slots, **layer.write_kwargs())
            kwargs = inputs.attention_kwargs() | layer.attention_kwargs()
            check(
                i, q, k, v, paged_attention(q, layer.k, layer.v, softmax_scale=dim**-0.5, **kwargs)
            )
            if i == 0 and not commit:
                first_keys, first_values = k, v
            if commit:
                history[i] += [k, v]
        plan.commit()
    assert cache.k_means_chosen.all() and cache.equalizers_chosen.all()
    assert cache.v_scales_chosen.all()
    mean = first_keys.mean(dim=0)
    torch.testing.assert_close(cache.k_means[0], mean)
    # The factors of the first write (K's after the mean): the wide channels' exceed 1 (K takes
    # half of a channel's excess width in log2, V all of it).
    want_k = channel_factors(first_keys, smooth=mean, share=K_SHARE)
    want_v = channel_factors(first_values)
    assert torch.equal(cache.k_equalizers[0], want_k) and torch.equal(cache.v_equalizers[0], want_v)
    assert want_k[:, -2:].min() > 1 and want_v[:, -2:].min() >= 8
    call = ForwardCall(cache, cache.plan(session, "main", c), softmax_scale=dim**-0.5)
    for i in range(LAYERS):
        q, k, v = qkv()
        check(i, q, k, v, call.attend(i, q, k, v))


CACHE_STATE = (
    "k_pools",
    "v_pools",
    "k_scales",
    "v_scales",
    "k_means",
    "k_means_chosen",
    "k_equalizers",
    "v_equalizers",
    "equalizers_chosen",
    "stage_tags",
)
# k8v8's V channel scales, chosen on a layer's first write as the mean (empty for other pools).
K8V8_STATE = ("v_channel_scales", "v_scales_chosen")


@pytest.mark.usefixtures("plain")
@pytest.mark.parametrize(
    ("pool", "left_out", "what"),
    [
        ({"kv_dtype": torch.int8}, "k_smooth_chosen", r"K mean \(k_means_chosen\)"),
        (
            {"kv_dtype": torch.int8},
            "equalizers_chosen",
            r"equalization factors \(equalizers_chosen\)",
        ),
        ({"kv_format": "k8v8"}, "v_scale_chosen", r"V channel scales \(v_scales_chosen\)"),
    ],
    ids=["mean", "factors", "k8v8-v-scales"],
)
def test_tokens_committed_under_an_unchosen_state_are_refused_never_attended(pool, left_out, what):
    # A raw driver writes layer 1 with its mean and factors but leaves a flag out of
    # write_kwargs() (layer 0 as it should): layer 1's codes are written under a state nobody
    # chose (a zero mean, unit factors). A later forward would choose from its own keys and
    # attend the old codes under it (max error 1.46 against exact attention); the cache knows
    # it holds committed tokens and no chosen state, so the forward is refused, naming the
    # layer and the fix, and changes nothing.
    c, heads, dim = 8, 2, 8
    config = PagingConfig(block_size=4, chunk_size=c, window_chunks=2, **pool)
    cache = PagedKVCache(config, num_layers=LAYERS, num_kv_heads=heads, head_dim=dim)
    session = cache.open_session()
    gen = torch.Generator().manual_seed(4)
    plan = cache.plan(session, "main", c, commit=True)
    inputs = plan.prepare()
    for i in range(LAYERS):
        k, v = torch.randn(2, c, heads, dim, generator=gen) + torch.linspace(-30, 30, dim)
        layer = cache.layer(i)
        write = {n: t for n, t in layer.write_kwargs().items() if i == 0 or n != left_out}
        write_slots(k, v, *layer.write_pools, inputs.video_slots, **write)
    plan.commit()
    before = {name: getattr(cache, name).contiguous().clone() for name in CACHE_STATE + K8V8_STATE}
    free = cache.pool.num_free
    match = rf"^layer 1 holds committed tokens but no chosen {what}: .* layer\.write_kwargs\(\)"
    later = cache.plan(session, "main", c, commit=True)
    with pytest.raises(ValueError, match=match) as refused:
        ForwardCall(cache, later, softmax_scale=dim**-0.5)
    assert "\n" not in str(refused.value)
    with pytest.raises(ValueError, match=match):
        later.prepare()  # a raw driver's next forward
    for name, then in before.items():
        now = getattr(cache, name).contiguous()  # k8v8's frozen scales: a block-stride-0 view
        assert torch.equal(now.view(torch.uint8), then.view(torch.uint8)), name
    assert cache.pool.num_free == free and later.state.value == "new"
    assert session.sequences["main"].pending is None
    # Once no session holds such tokens, the next first write chooses, as in a fresh cache.
    cache.close_session(session)
    fresh = cache.open_session()
    call = ForwardCall(cache, cache.plan(fresh, "main", c, commit=True), softmax_scale=dim**-0.5)
    for i in range(LAYERS):
        q, k, v = torch.randn(3, c, heads, dim, generator=gen)
        call.attend(i, q, k, v)
    call.commit()
    assert cache.k_means_chosen.all() and cache.equalizers_chosen.all()


@pytest.mark.parametrize(
    "mode",
    [
        pytest.param({"kv_dtype": torch.int8}, id="int8"),
    ],
)
def test_keys_major_cache_attends_as_the_slot_major_one(mode: dict) -> None:
    # The same forwards over both layouts (the MMA modes included, whose keys-major loops read
    # V and the scales differently): the same codes and scales, the same outputs.
    caches = [
        poisoned_cache(dataclasses.replace(CONFIG, keys_major=keys_major, **mode))
        for keys_major in (False, True)
    ]
    sessions = [cache.open_session() for cache in caches]
    gen = torch.Generator().manual_seed(5)
    n, actions = CONFIG.chunk_size, 2
    for _ in range(4):  # the window slides from the third commit on
        calls = [
            ForwardCall(cache, cache.plan(s, "main", n, action_tokens=actions), softmax_scale=0.3)
            for cache, s in zip(caches, sessions, strict=True)
        ]
        for layer in range(LAYERS):
            q = torch.randn(n, HEADS, DIM, generator=gen)
            kv = [
                torch.randn(t, KV_HEADS, DIM, generator=gen) + 3 for t in (n, n, actions, actions)
            ]
            outs = [call.attend(layer, q, *kv) for call in calls]
            assert not outs[0].isnan().any()
            torch.testing.assert_close(outs[1], outs[0], rtol=1e-6, atol=1e-6)
        for call in calls:
            call.commit()
    for name in ("k_pools", "v_pools", "k_scales", "v_scales"):
        slot_major, keys_major = (getattr(cache, name) for cache in caches)
        assert torch.equal(
            keys_major.view(torch.uint8 if slot_major.element_size() == 1 else torch.int32),
            slot_major.view(torch.uint8 if slot_major.element_size() == 1 else torch.int32),
        ), name


def test_int8_format_is_the_keys_major_int8_pool() -> None:
    # kv_format="int8" spells the int8 dequantizing pool in the layout the format implies
    # (keys-major scales): the same pools, codes, scales and outputs as those fields given.
    configs = [
        dataclasses.replace(CONFIG, kv_format="int8"),
        dataclasses.replace(CONFIG, kv_dtype=torch.int8, keys_major=True),
    ]
    assert (configs[0].kv_dtype, configs[0].keys_major) == (torch.int8, True)
    caches = [poisoned_cache(config) for config in configs]
    sessions = [cache.open_session() for cache in caches]
    gen = torch.Generator().manual_seed(6)
    n = CONFIG.chunk_size
    for _ in range(3):
        calls = [
            ForwardCall(cache, cache.plan(s, "main", n), softmax_scale=0.3)
            for cache, s in zip(caches, sessions, strict=True)
        ]
        for layer in range(LAYERS):
            q = torch.randn(n, HEADS, DIM, generator=gen)
            kv = [torch.randn(n, KV_HEADS, DIM, generator=gen) + 3 for _ in range(2)]
            outs = [call.attend(layer, q, *kv) for call in calls]
            assert not outs[0].isnan().any()
            assert torch.equal(outs[0], outs[1])
        for call in calls:
            call.commit()
    assert caches[0].equalizers_chosen.all()
    for name in ("k_pools", "v_pools", "k_scales", "v_scales", "k_means"):
        ours, theirs = (getattr(cache, name) for cache in caches)
        assert ours.shape == theirs.shape, name
        assert torch.equal(
            ours.contiguous().view(torch.uint8), theirs.contiguous().view(torch.uint8)
        ), name

"""The sweep's quantized providers (our paged attention over FP8/INT8 pools): checked against
the dequantizing oracle, rated against the bf16 pool in the ratio table."""

from __future__ import annotations

import pytest
import torch

from paged_video import kernels, reference
from paged_video.bench.providers import (
    PROVIDERS,
    QUANTIZED_PROVIDERS,
    Bench,
    Provider,
    eight_bit_pools,
    quantized_pools,
)
from paged_video.bench.results import QUANTIZED_GOALS
from paged_video.bench.sweep import (
    K8V8_ALLOWANCE,
    WrongResultError,
    _dequantizing_oracle,
    bytes_moved,
    eight_bit_oracle,
    run_sweep,
    selected_providers,
)
from paged_video.bench.table import format_ratios, quantized_cases
from paged_video.bench.workload import (
    Geometry,
    dequantized_sequences,
    make_workload,
    oracle_attention,
)
from paged_video.reference.attention import gather_sequence
from tests.bench.rows import STEADY_CEILINGS, measured
from tests.bench.tiny import TINY, paged_config
from tests.library_device import library_tensors_on


def test_quantized_pools_hold_the_codes_write_slots_makes():
    workload = make_workload(TINY, 5)
    for dtype in (torch.int8,):
        pools = quantized_pools(workload, dtype)
        assert pools is quantized_pools(workload, dtype)  # made once per workload
        assert pools.k_cache.dtype == dtype and pools.k_scale.shape == workload.k_cache.shape[:-1]
        for codes, scale, source in (
            (pools.k_cache, pools.k_scale, workload.k_cache),
            (pools.v_cache, pools.v_scale, workload.v_cache),
        ):
            want = reference.quantize.dequantize(*reference.quantize.quantize(source, dtype))
            got = reference.quantize.dequantize(codes, scale)
            assert torch.allclose(got, want, rtol=1e-6, atol=0)


def test_quantized_rows_are_checked_against_the_dequantizing_oracle(tmp_path):
    names = tuple(QUANTIZED_PROVIDERS)
    result = run_sweep(
        paged_config(providers=("triton", *names)), tmp_path / "s.csv", progress=False
    )
    rows = {r["provider"]: r for r in result.rows if r["kernel"] == "paged_attention"}
    assert set(rows) == {"triton", *names}
    for name in names:
        row = rows[name]
        assert row["role"] == "quantized" and row["max_error"] <= row["error_limit"]
        assert row["backend"].startswith("triton paged_attention ")
    # The dequantizing mode is held to the bf16 pool's limit: the storage's rounding is in the
    # oracle, not in the tolerance.
    assert rows["triton-int8"]["error_limit"] == rows["triton"]["error_limit"]
    assert rows["triton-int8"]["max_error"] < 1e-5
    # The same codes and scales in another layout: each mode's results, to float32 rounding.
    # k8v16 rounds the query rows and K alone, as its oracle does: float32 distance, the bf16
    # pool's limit. k8v8's emulation rounds P once, the kernel per key tile (TINY: one tile).
    assert rows["triton-k8v16"]["error_limit"] == rows["triton"]["error_limit"]
    assert rows["triton-k8v16"]["max_error"] < 1e-5
    k8v8 = rows["triton-k8v8"]
    assert k8v8["error_limit"] == pytest.approx(rows["triton"]["error_limit"] + K8V8_ALLOWANCE)
    assert k8v8["max_error"] < 1e-5
    assert k8v8["backend"] == "triton paged_attention k8v8 (int8 K, e4m3 V per channel)"
    for name, mode in (("triton-int8", "int8 dequant"),):
        keys = rows[f"{name}-keys"]
        assert keys["backend"] == f"triton paged_attention {mode}, keys-major"
        assert abs(keys["max_error"] - rows[name]["max_error"]) < 1e-6


def test_the_one_switch_oracles_are_their_formats_arithmetic():
    workload = make_workload(TINY, 5)
    q = reference.quantize.round_rows(workload.q, torch.int8)
    k8v16 = eight_bit_pools(workload, "k8v16")
    assert k8v16 is eight_bit_pools(workload, "k8v16") and k8v16.v_channel_scale is None
    assert torch.equal(k8v16.v_cache, workload.v_cache)
    keys, _ = dequantized_sequences(workload, quantized_pools(workload, torch.int8))
    want = oracle_attention(workload, q=q, keys=keys, values=workload.values)
    assert torch.equal(_dequantizing_oracle(workload, QUANTIZED_PROVIDERS["triton-k8v16"]), want)
    # k8v8: V's codes under frozen channel scales read back within e4m3's rounding (half a step:
    # 2**-4 of the value, or 2**-10 of the scale among the subnormals); the emulation rounds P
    # to e4m3, so it differs from float64 attention over the same codes.
    k8v8 = eight_bit_pools(workload, "k8v8")
    scale = k8v8.v_channel_scale.double()[:, None]
    assert k8v8.v_channel_scale.stride(0) == 0 and k8v8.v_cache.dtype == torch.float8_e4m3fn
    values = k8v8.v_cache.double() * scale
    source = workload.v_cache.double()
    assert ((values - source).abs() <= source.abs() * 2.0**-4 + scale * 2.0**-10).all()
    assert (values != source).any()
    table = workload.block_table[0]
    logical = gather_sequence(values, table, workload.geometry.kv_tokens)[None]
    exact_p = oracle_attention(workload, q=q, keys=keys, values=logical)
    # Chosen from the sequences' V, not the spare blocks: every block size's pools share them,
    # and so the oracle the sweep keeps per geometry.
    other = eight_bit_pools(make_workload(TINY, 4), "k8v8").v_channel_scale
    assert torch.equal(other[0], k8v8.v_channel_scale[0])
    amax = workload.values.abs().flatten(0, 1).amax(dim=0)
    assert torch.allclose(k8v8.v_channel_scale[0], amax * 256 / 448, rtol=1e-6, atol=0)
    emulated = _dequantizing_oracle(workload, QUANTIZED_PROVIDERS["triton-k8v8"])
    error = (emulated - exact_p).abs().max()
    assert 1e-4 * exact_p.abs().max() < error < 0.1 * exact_p.abs().max()


@pytest.mark.parametrize("kv_format", ["k8v8", "k8v16"])
def test_the_one_switch_oracles_are_on_the_workloads_device(kv_format):
    # The sweep compares a kernel's output with its oracle: on a GPU, an oracle left on the CPU
    # crashes the comparison. Here a tensor the oracle makes without a device goes to meta.
    workload = make_workload(TINY, 5)
    with library_tensors_on("meta"):
        oracle = eight_bit_oracle(workload, kv_format)
    assert oracle.device == workload.q.device


def _k8v8_wrong_channel_scales(workload, tile):
    """The k8v8 kernel with half of V's channels read at twice their scale."""
    w = workload
    pools = eight_bit_pools(w, "k8v8")
    scales = pools.v_channel_scale.clone()
    scales[..., ::2] *= 2
    return Bench(
        lambda: kernels.paged_attention(
            w.q,
            pools.k_cache,
            pools.v_cache,
            w.block_table,
            w.cu_seqlens_q,
            w.seq_lens_k,
            max_seqlen_q=w.geometry.q_tokens,
            k_scale=pools.k_scale,
            v_channel_scale=scales,
        )
    )


def _k8v16_missing_a_block(workload, tile):
    """The k8v16 kernel over all but the last block of keys."""
    w = workload
    pools = eight_bit_pools(w, "k8v16")
    return Bench(
        lambda: kernels.paged_attention(
            w.q,
            pools.k_cache,
            pools.v_cache,
            w.block_table,
            w.cu_seqlens_q,
            w.seq_lens_k - w.block_size,
            max_seqlen_q=w.geometry.q_tokens,
            k_scale=pools.k_scale,
        )
    )


def _bf16_pool_answer(workload, tile):
    """Attention over the unquantized pool: right for the bf16 oracle, not for the codes."""
    w = workload
    pools = quantized_pools(w, torch.int8)  # built, but not read
    assert pools.k_cache.dtype == torch.int8
    return Bench(
        lambda: kernels.paged_attention(
            *w.attention_args(), max_seqlen_q=w.geometry.q_tokens, check_values=False
        )
    )


@pytest.mark.parametrize(
    ("name", "build"),
    [
        ("triton-int8", _bf16_pool_answer),
        ("triton-k8v8", _k8v8_wrong_channel_scales),
        ("triton-k8v16", _k8v16_missing_a_block),
    ],
)
def test_a_wrong_quantized_result_raises(tmp_path, name, build):
    template = next(p for p in PROVIDERS if p.name == name)
    wrong = Provider("paged_attention", "wrong", build, role="quantized", quant=template.quant)
    with pytest.raises(WrongResultError, match="paged_attention/wrong"):
        run_sweep(paged_config(), tmp_path / "s.csv", providers=[wrong], progress=False)


def test_a_quantized_pool_moves_about_half_the_bytes_of_bf16():
    shipped = Geometry(1560, 3, 9, 9, 40, 40, 128, "bf16")
    workload = make_workload(TINY, 8)
    workload.geometry = shipped  # bytes_moved reads only the geometry
    quant = QUANTIZED_PROVIDERS["triton-int8"]
    g = shipped
    q_and_out = 2 * g.q_tokens * g.heads * g.head_dim * 2
    kv_bf16 = bytes_moved("paged_attention", workload) - q_and_out
    kv_int8 = bytes_moved("paged_attention", workload, quant) - q_and_out
    assert kv_int8 / kv_bf16 == pytest.approx((128 + 4) / 256)


def test_the_ratio_table_rates_quantized_rows_against_the_bf16_pool():
    rows = [
        *STEADY_CEILINGS[:2],
        measured("paged_attention", "triton", 16, 2.0, role="ours"),
        measured("paged_attention", "sdpa-flash", 16, 3.0),
        measured("paged_attention", "triton-int8", 16, 1.25, role="quantized"),  # 1.6x
        measured("paged_attention", "triton-k8v8", 16, 1.5, role="quantized"),  # 1.33x
        measured("paged_attention", "triton-int8", 1560, 1.0, role="quantized"),  # no bf16 row
        *STEADY_CEILINGS[2:],
    ]
    cases = {(c["row"]["provider"], c["row"]["block_size"]): c for c in quantized_cases(rows)}
    assert cases["triton-int8", 16]["speedup"] == pytest.approx(1.6)
    assert cases["triton-int8", 1560]["speedup"] is None
    text = format_ratios(rows, goal=True)
    # The quantized rows do not stand in for ours against the baselines: 3.0 / 2.0.
    assert "1.50x" in text.split("quantized KV pools")[0]
    lines = {line.split()[2]: line for line in text.splitlines() if "triton-" in line}
    [int8_16] = [line for line in text.splitlines() if "triton-int8" in line and "1.60x" in line]
    assert "BELOW" not in int8_16  # 1.6x >= 1.3x
    assert lines["triton-k8v8"].rstrip().endswith(f"BELOW {QUANTIZED_GOALS['triton-k8v8']:.2f}x")
    assert "quantized goals: 1 of 2 rows below" in text
    # The header's goals are those of the providers that ran.
    [header] = [line for line in text.splitlines() if line.startswith("quantized KV pools")]
    assert "triton-k8v8 1.50x" in header and "triton-int8 1.30x" in header
    assert "triton-k8v16" not in header and "-keys" not in header


def test_the_speedup_plot_draws_the_quantized_pools_without_a_baseline(tmp_path):
    from paged_video.bench.plot import plot_rows

    rows = [
        *STEADY_CEILINGS,
        measured("paged_attention", "triton", 16, 2.0, role="ours"),
        measured("paged_attention", "triton-int8", 16, 1.25, role="quantized"),
    ]
    paths = [p.name for p in plot_rows(rows, tmp_path)]
    assert paths == ["speedup.png", "paged_attention.png"]


def test_dequantizing_keys_major_providers_run_only_when_named():
    # They are the GPU check's probe's to time; the default sweep keeps its cases.
    chosen = {p.name for p in selected_providers(paged_config(), PROVIDERS)}
    assert {"triton-int8", "triton-k8v16"} <= chosen
    assert "triton-int8-keys" not in chosen

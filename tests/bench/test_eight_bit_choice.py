"""``bench.eight_bit_choice``: today's rows are ``bench accuracy``'s floors, the candidates are
the emulation of their format, the verdicts are the issue's goals."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from paged_video.bench import eight_bit_choice as choice
from paged_video.bench import sweep
from paged_video.bench.accuracy import (
    AccuracyConfig,
    Data,
    FloorCache,
    Prepared,
    Variant,
    eight_bit_emulation,
    make_data,
    prepare,
    reference_output,
)
from paged_video.kernels.value_channels import V_HEADROOM
from paged_video.reference import eight_bit_attention as eba
from paged_video.reference import regrow

# Two frames of 64 keys, 64 queries (one Q block), 1 head of 128.
TINY = AccuracyConfig(
    heads=1, head_dim=128, chunk_size=64, sink_chunks=1, window_chunks=1, q_rows=64
)


def test_today_rows_are_bench_accuracys_floors_and_candidates_their_emulation() -> None:
    config = AccuracyConfig(**{**TINY.__dict__, "data": ("k-token-outliers",)})
    name = "int8-slot/frozen16/e4m3/acc13"
    table = choice.measure(config, {name: choice.candidates()[name]})
    data = make_data("k-token-outliers", config)
    expected, prepared = reference_output(data), prepare(data, config)
    floors = FloorCache(data, expected, prepared, config)
    for row, variant in (
        ("today e4m3 pool", Variant("e4m3", "dequant", True, False)),
        ("today INT8-MMA", Variant("int8", "int8-mma", True, True)),
    ):
        assert table[row]["k-token-outliers"] == pytest.approx(floors.floors(variant).mode)
    fmt = eba.EightBitFormat(v_headroom=16.0)
    out = eba.eight_bit_attention(
        data.q,
        data.keys,
        data.values,
        fmt,
        first_write=64,
        smooth=prepared.mean,
        k_factor=prepared.smoothed_k_factor,
    )
    rel_l1 = float((out - expected).abs().sum() / expected.abs().sum())
    assert table[name]["k-token-outliers"] == pytest.approx(rel_l1, rel=1e-12)


def test_candidate_names_spell_their_format() -> None:
    every = choice.candidates()
    fmt = every["e4m3-tile64/block256/e4m3/acc13"].format
    assert (fmt.k_dtype, fmt.k_keys_per_scale, fmt.v_scales) == (torch.float8_e4m3fn, 64, "block")
    assert (fmt.v_keys_per_scale, fmt.p_dtype, fmt.acc_bits) == (256, torch.float8_e4m3fn, 13)
    fmt = every["int8-slot/frozen256/e4m3/acc13/flush8"].format
    assert (fmt.v_scales, fmt.v_headroom, fmt.flush_tiles) == ("frozen", 256.0, 8)
    fmt = every["int8-slot/bf16/fp16/exact"].format
    assert (fmt.v_scales, fmt.p_dtype, fmt.acc_bits) == ("none", torch.float16, None)
    assert not every["e4m3-slot/block64/e4m3/acc13"].equalize_k
    assert not every["int8-slot/block64/e4m3/acc13/no-equalize"].equalize_k


def test_verdicts_are_the_issues_goals() -> None:
    today = {"random": 0.037, "v-grows": 0.03}
    table = {name: dict(today) for name in choice.TODAY}
    table |= {
        "fast": {"random": 0.039, "v-grows": 0.033},  # 1.1x today's e4m3 pool at most
        "too slow on a kind": {"random": 0.039, "v-grows": 0.0331},
        "over 4% on random": {"random": 0.0401, "v-grows": 0.01},
        "both": {"random": 0.015, "v-grows": 0.001},
    }
    assert choice.verdicts(table) == {
        "fast": "fast",
        "too slow on a kind": "-",
        "over 4% on random": "-",
        "both": "fast accurate",
    }
    printed = choice.format_table(table, markdown=True)
    assert "| fast | 3.90 | 3.30 | fast |" in printed


def test_the_accurate_formats_error_budget_tells_q_and_k_rounding_apart() -> None:
    """With K's outlier channels and q unscaled, leaving both operands' codes unrounded leaves
    only P's bf16 rounding; leaving either one unrounded takes its share off."""
    config = AccuracyConfig(**{**TINY.__dict__, "data": ("k-outliers-q-unscaled",)})
    every = choice.candidates()
    accurate = "int8-slot/bf16/bf16/exact/q-row"
    names = [accurate] + [f"{accurate}/unrounded-{ops}" for ops in ("q", "k", "qk")]
    both = every[names[3]]
    assert both.unrounded == {"q", "k"} and both.format == every[accurate].format
    table = choice.measure(config, {name: every[name] for name in names})
    full, q_off, k_off, both_off = (table[name]["k-outliers-q-unscaled"] for name in names)
    assert max(q_off, k_off) < full
    assert both_off < 0.1 * min(q_off, k_off)


@pytest.mark.parametrize(
    "fields, match",
    [
        pytest.param({"unrounded": frozenset("v")}, "operands 'q' and 'k'", id="unknown-operand"),
        pytest.param(
            {"unrounded": frozenset("k"), "regrow": True}, "cannot leave them", id="regrown-k"
        ),
    ],
)
def test_unrounded_operands_are_q_and_k_of_a_frozen_k(fields: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        choice.Candidate(eba.ACCURATE_FORMAT, **fields)


# The formats docs/quantization.md chose ("Choosing the 8-bit format"), with K's factors frozen
# at the first write and regrowing as the cache's do (kernels.regrow), and, per data kind, how
# far over today's pool's error the cache's may be: the fast one 1.1x today's e4m3 pool (the
# issue's goal) where it meets it, with margins where it measured over it (v-token-outliers and
# v-grows 1.03-1.12x: e4m3 V under outlier channels); the accurate one <= 1.5%, or 1.1x today's
# int8 pool where that misses 1.5% too.
FAST = "int8-slot/block64/e4m3/acc13/q-row"
ACCURATE = "int8-slot/bf16/bf16/exact/q-row"
FAST_REGROWN, ACCURATE_REGROWN = FAST + "/regrow", ACCURATE + "/regrow"
FAST_OVER = {"v-token-outliers": 1.2, "v-grows": 1.2}
INT8_BOUND = ("k-outliers-q-unscaled", "v-small")


@pytest.mark.parametrize("seed", [0, 1])
def test_the_chosen_formats_meet_their_goals_on_small_data(seed: int) -> None:
    """Every data kind on 512-key frames (2 of them) and 64 queries, against today's pools'
    float64 emulations, so an oracle change that breaks a goal is caught here."""
    config = AccuracyConfig(
        heads=1, head_dim=128, chunk_size=512, sink_chunks=1, window_chunks=1, q_rows=64, seed=seed
    )
    every = choice.candidates()
    assert every[FAST_REGROWN].format == eba.FAST_FORMAT and every[FAST_REGROWN].regrow
    assert every[ACCURATE_REGROWN].format == eba.ACCURATE_FORMAT
    assert every[ACCURATE_REGROWN].regrow
    chosen = (FAST_REGROWN, ACCURATE_REGROWN)
    table = choice.measure(config, {name: every[name] for name in chosen})
    fast, accurate = table[FAST_REGROWN], table[ACCURATE_REGROWN]
    assert fast["random"] <= choice.FAST_RANDOM_GOAL
    for kind, e4m3 in table[choice.E4M3_POOL].items():
        assert fast[kind] <= FAST_OVER.get(kind, choice.FAST_VS_E4M3) * e4m3, kind
        bound = 1.1 * table["today int8 pool"][kind] if kind in INT8_BOUND else 0.015
        assert accurate[kind] <= bound, kind
        assert fast[kind] >= 1.5 * accurate[kind], kind


def test_k8v8_as_it_ships_is_one_format_for_every_oracle() -> None:
    """The choice's k8v8 rows, the sweep's oracle and ``bench accuracy``'s floor are one
    format (``K8V8_FORMAT``), with the cache's V headroom; each run sets only its accumulator
    and tile."""
    every = choice.candidates()
    assert every["k8v8"] == choice.Candidate(eba.K8V8_FORMAT)
    assert every["k8v8/regrow"] == choice.Candidate(eba.K8V8_FORMAT, regrow=True)
    assert eba.K8V8_FORMAT.v_scales == "frozen" and eba.K8V8_FORMAT.v_headroom == V_HEADROOM
    assert dataclasses.replace(eba.K8V8_FORMAT, acc_bits=None) == sweep.K8V8_EMULATION
    floor = eight_bit_emulation(Variant("k8v8", "k8v8", smooth=True), TINY)
    assert floor == dataclasses.replace(eba.K8V8_FORMAT, acc_bits=None, tile_keys=floor.tile_keys)


@pytest.mark.parametrize(
    "name", ["int8-slot/frozen16/e4m3/acc13", "e4m3-tile64/block256/e4m3/acc13"]
)
def test_a_candidate_is_emulated_on_the_datas_device(name: str) -> None:
    # Over CUDA data an output made on the CPU crashes the comparison with the float64 reference
    # (on the data's device); meta tensors turn the same mistake into an error on a CPU.
    data = make_data("random", TINY)
    prepared = prepare(data, TINY)
    meta = Data(*(t.to("meta") for t in dataclasses.astuple(data)))
    meta_prepared = Prepared(*(t.to("meta") for t in dataclasses.astuple(prepared)))
    out = choice.emulate(choice.candidates()[name], meta, meta_prepared, TINY.chunk_size)
    assert out.device.type == "meta" and out.shape == data.q.shape


def test_regrowing_factors_win_on_k_grows_and_change_nothing_on_random_data() -> None:
    """The chosen formats with K's factors regrowing (``reference.regrow``): K channels 100x
    wider after the first frame regrow them, random data never does (bit for bit the frozen
    rows), and the regrowing rows then meet the issue's goals on k-grows."""
    config = AccuracyConfig(**{**TINY.__dict__, "data": ("random", "k-grows")})
    every = choice.candidates()
    names = (FAST, FAST_REGROWN, ACCURATE, ACCURATE_REGROWN)
    assert [every[name].regrow for name in names] == [False, True, False, True]
    table = choice.measure(config, {name: every[name] for name in names})
    for frozen in (FAST, ACCURATE):
        assert table[frozen + "/regrow"]["random"] == table[frozen]["random"]
        assert table[frozen + "/regrow"]["k-grows"] < 0.9 * table[frozen]["k-grows"]
    e4m3 = table[choice.E4M3_POOL]["k-grows"]
    assert table[FAST + "/regrow"]["k-grows"] <= choice.FAST_VS_E4M3 * e4m3
    assert table[ACCURATE + "/regrow"]["k-grows"] <= choice.ACCURATE_GOAL


def test_regrowing_keys_are_the_replayed_frames_codes() -> None:
    """A regrowing candidate's K is what ``reference.regrow.replay_writes`` stores frame by
    frame; a frozen one's is every key under the first frame's factors."""
    data = make_data("k-grows", TINY)
    prepared = prepare(data, TINY)
    candidate = choice.candidates()[FAST_REGROWN]
    keys, factor = choice.stored_keys(candidate, data.keys, prepared.mean, TINY.chunk_size)
    assert factor is not None and (factor > prepared.smoothed_k_factor).any()
    frozen = dataclasses.replace(candidate, regrow=False)
    frozen_keys, frozen_factor = choice.stored_keys(frozen, data.keys, prepared.mean, 64)
    assert frozen_factor is not None and torch.equal(frozen_factor, prepared.smoothed_k_factor)
    # The second frame is stored under the grown factors; the first frame's codes are restated
    # from the frozen factors', under their scales.
    second = eba.quantize_keys(
        data.keys[64:], candidate.format, smooth=prepared.mean, factor=factor
    )
    assert torch.equal(keys.codes[64:], second.codes) and torch.equal(keys.scale[64:], second.scale)
    first = regrow.regrow_codes(frozen_keys.codes[:64], frozen_factor, factor)
    assert torch.equal(keys.codes[:64], first) and torch.equal(
        keys.scale[:64], frozen_keys.scale[:64]
    )
    assert not torch.equal(first, frozen_keys.codes[:64])
    with pytest.raises(ValueError, match="regrow needs equalize_k"):
        dataclasses.replace(candidate, equalize_k=False)


def test_the_command_measures_the_heads_and_candidates_it_names(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    seen = {}

    def measure(config: AccuracyConfig, chosen: dict, *, log: bool = False) -> dict:
        seen.update(config=config, chosen=chosen)
        return {row: {"random": 0.01} for row in (*choice.TODAY, *chosen)}

    monkeypatch.setattr(choice, "measure", measure)
    assert choice.main(["--heads", "8", "--data", "random", "--only", "k8v8/regrow"]) == 0
    assert seen["config"].heads == 8 and list(seen["chosen"]) == ["k8v8/regrow"]
    assert "8 head(s) of 128" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        choice.main(["--only", "k8v9"])

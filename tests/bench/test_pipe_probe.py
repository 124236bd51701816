"""``python -m paged_video.bench.pipe_probe``: the instruction-mix kernels that tell which pipe
an int32 -> float32 conversion takes on the GPU. Their sm_90a loops issue what each mix's name
says (compiled on a CPU; skipped where Triton's wheel has no cuobjdump or ptxas), the CPU run
writes every mix's row marked as no speed, and a kernel that does not do its arithmetic is an
error, never a figure."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch

from paged_video.bench import pipe_probe, sass

CPU = torch.device("cpu")
# What each mix's loop issues per element and repetition; every other counted opcode is absent.
EXPECTED = {
    "ffma": {"FFMA": 1},
    "exp2": {"FFMA": 1, "MUFU.EX2": 1},
    "i2f": {"LOP3": 1, "I2F": 1, "FFMA": 1},
    "bits": {"LOP3": 1, "IADD": 1, "FADD": 1, "FFMA": 1},
    "exp2+i2f": {"LOP3": 1, "I2F": 1, "FFMA": 1, "MUFU.EX2": 1},
    "exp2+bits": {"LOP3": 1, "IADD": 1, "FADD": 1, "FFMA": 1, "MUFU.EX2": 1},
}


@pytest.fixture(scope="module")
def compiled() -> dict:
    from triton import knobs

    for name in ("cuobjdump", "ptxas"):
        tool = getattr(knobs.nvidia, name)
        if tool is None or not Path(tool.path).is_file():
            pytest.skip(f"no {name} in Triton's wheel (triton/backends/nvidia/bin)")
    return pipe_probe.sass_counts()


def test_each_loop_issues_what_its_mix_names(compiled) -> None:
    assert set(compiled["counts"]) == set(pipe_probe.MIXES)
    for mix, counts in compiled["counts"].items():
        wanted = {name: float(EXPECTED[mix].get(name, 0)) for name in pipe_probe.CATEGORIES}
        assert {name: counts[name] for name in wanted} == wanted, mix
        # Nothing else but the loop's counter and branch, shared by the unrolled repetitions.
        assert counts["all"] - sum(EXPECTED[mix].values()) < 0.2, (mix, counts)
    conversions = compiled["conversions"]
    assert {mix for mix, ops in conversions.items() if ops} == {"i2f", "exp2+i2f"}
    assert conversions["i2f"] == ["I2FP.F32.S32"]


PLANTED = """
        Function : planted
        /*0000*/                   UMOV UR4, 0x400 ;
        /*0010*/                   UIADD3 UR4, UR4, -0x4, URZ ;
        /*0020*/                   ISETP.NE.U32.AND P0, PT, RZ, UR4, PT ;
        /*0030*/                   FFMA R2, R2, R5, R6 ;
        /*0040*/                   MUFU.EX2 R2, R2 ;
        /*0050*/                   FFMA R3, R3, R5, R6 ;
        /*0060*/                   MUFU.EX2 R3, R3 ;
        /*0070*/                   FFMA R2, R2, R5, R6 ;
        /*0080*/                   MUFU.EX2 R2, R2 ;
        /*0090*/                   FFMA R3, R3, R5, R6 ;
        /*00a0*/                   MUFU.EX2 R3, R3 ;
        /*00b0*/                   IADD3 R7, R7, 0x3, RZ ;
        /*00c0*/               @P0 BRA 0x10 ;
        /*00d0*/                   EXIT ;
"""


def test_counts_divide_by_elements_and_the_counters_step() -> None:
    # Four repetitions per pass (the step of the counter the branch tests, not the other add's
    # 3): the pass's 4 FFMAs and 4 MUFU.EX2 are one of each per element and repetition at one
    # element per thread, half at two.
    loop = pipe_probe.the_loop(PLANTED)
    assert pipe_probe.unroll_factor(loop) == 4
    assert pipe_probe.loop_counts(loop, elements_per_thread=2)["FFMA"] == 0.5
    counts = pipe_probe.loop_counts(loop, elements_per_thread=1)
    assert counts["FFMA"] == counts["MUFU.EX2"] == 1.0
    assert counts["IADD"] == 1 / 4 and counts["I2F"] == 0
    no_counter = PLANTED.replace("UIADD3 UR4, UR4, -0x4, URZ", "UMOV UR4, UR5")
    with pytest.raises(ValueError, match="no counter step"):
        pipe_probe.unroll_factor(pipe_probe.the_loop(no_counter))
    assert len(sass.find_loops(sass.parse_sass(PLANTED))) == 1


def test_cpu_run_writes_every_mix_marked_as_no_speed(tmp_path, capsys) -> None:
    assert pipe_probe.main(["--device", "cpu", "--reps", "4", "--out", str(tmp_path)]) == 0
    with open(tmp_path / "pipe_probe.csv", newline="") as stream:
        rows = list(csv.DictReader(stream))
    assert [r["mix"] for r in rows] == list(pipe_probe.MIXES)
    for row in rows:
        assert row["figures"] == "cpu-interpreter" and row["reading"] == "", row
        assert float(row["ms"]) > 0 and row["reps"] == "4", row
        assert row["elements"] == str(2 * pipe_probe.BLOCK_M * pipe_probe.BLOCK_N)
        assert row["triton"] and row["torch"] and row["commit"] and row["timestamp"]
    ffma = next(r for r in rows if r["mix"] == "ffma")
    assert float(ffma["vs_ffma"]) == 1.0
    assert "not speeds" in capsys.readouterr().out


def test_a_kernel_that_skips_the_conversion_is_an_error(tmp_path, monkeypatch) -> None:
    real = pipe_probe.launch
    # The i2f mix launched without its conversion (the ffma kernel).
    monkeypatch.setattr(
        pipe_probe, "launch", lambda mix, *rest: real("ffma" if mix == "i2f" else mix, *rest)
    )
    with pytest.raises(RuntimeError, match=r"^i2f: the kernel's output differs"):
        pipe_probe.main(["--device", "cpu", "--reps", "2", "--out", str(tmp_path)])
    # The mixes before it keep their rows; the wrong one has none.
    with open(tmp_path / "pipe_probe.csv", newline="") as stream:
        assert [r["mix"] for r in csv.DictReader(stream)] == ["ffma", "exp2"]


def test_exp2_outputs_are_held_to_a_tight_tolerance(monkeypatch) -> None:
    real = pipe_probe.reference
    # A reference off by 1e-4 (ten times the allowance) for one exp2 mix.
    monkeypatch.setattr(
        pipe_probe,
        "reference",
        lambda mix, *rest: real(mix, *rest) * (1 + 1e-4 if mix == "exp2+i2f" else 1),
    )
    with pytest.raises(RuntimeError, match=r"^exp2\+i2f: "):
        list(pipe_probe.measure_mixes(CPU, reps=2, programs=1))


def test_a_bits_output_must_equal_its_i2f_twin() -> None:
    x, n = pipe_probe.inputs("bits", 1, CPU)
    out = pipe_probe.reference("bits", x, n, 3)
    pipe_probe.check("bits", out, out, twin=out.clone())
    twin = out.clone()
    twin[5] = torch.nextafter(twin[5], torch.tensor(float("inf")))
    with pytest.raises(RuntimeError, match="twin"):
        pipe_probe.check("bits", out, out, twin=twin)


@pytest.mark.parametrize(
    ("pair_ms", "verdict"),
    [(3.9, "shared"), (2.1, "separate"), (2.0, "separate")],
)
def test_reading_a_pair(pair_ms: float, verdict: str) -> None:
    ms = {"exp2": 2.0, "i2f": 1.8, "exp2+i2f": pair_ms}
    found, line = pipe_probe.reading(ms, "exp2+i2f")
    assert found == verdict
    assert ("does not share" in line) == (verdict == "separate"), line

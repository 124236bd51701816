"""``bench/gpu_check.sh``: its dry run on a CPU, as a GPU machine runs it (two calls, part 1 then
part 2 into the same folder), and the text a GPU window depends on (providers, probe runs,
stage limits, the documented device commands)."""

from __future__ import annotations

import csv
import os
import re
import subprocess
import tarfile
from pathlib import Path

import pytest

from paged_video.bench import choose
from paged_video.bench.results import read_rows
from paged_video.kernels import launch_table

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "gpu_check.sh"
PART1 = ["versions", "peers_setup", "tests", "sweep", "launches", "choose"]
PART2 = [
    "versions", "peers_setup", "pipes", "probes", "choose2", "peers", "rollout", "accuracy",
    "regrow", "compile", "report",
]  # fmt: skip
# What each stage writes (relative to OUT_DIR) for the stages after it to read.
WRITES = {
    "tests": {"tests.log"},
    "sweep": {"sweep.csv", "sweep.log"},
    "launches": {"launches/sweep.csv"},
    "choose": {"launch_choices.json"},
    "pipes": {"pipe_probe.csv"},
    "probes": {"probe_dequant/probe.csv", "probe_eight_bit/probe.csv"},
    "choose2": {"launch_choices.json"},
    "peers": {"peers/sweep.csv"},
    "rollout": {"rollout.csv"},
    "accuracy": {"accuracy.csv"},
    "regrow": {"regrow_cost.csv"},
    "compile": {"compile.csv"},
    "report": {"speedup.png"},
}


def _manifest(out: Path) -> list[dict]:
    with open(out / "stages.tsv", newline="") as stream:
        return list(csv.DictReader(stream, delimiter="\t"))


def _run_part(part: str, out: Path, pack: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    return subprocess.run(
        ["bash", str(SCRIPT), "--dry-run", "--part", part, "--pack", str(pack), str(out)],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
        cwd=REPO,
    )


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory) -> tuple[Path, Path, dict[str, str]]:
    """Both parts of the dry run, into one folder: what each printed."""
    root = tmp_path_factory.mktemp("gpu_check")
    out, pack = root / "out", root / "pack"
    table = launch_table.TABLE_PATH.read_bytes()
    printed = {}
    for part in ("1", "2"):
        done = _run_part(part, out, pack)
        printed[part] = done.stdout
        assert done.returncode == 0, (part, done.stdout[-4000:], done.stderr[-2000:])
    # A rehearsal never writes the shipped launch table.
    assert launch_table.TABLE_PATH.read_bytes() == table
    return out, pack, printed


def test_the_dry_run_runs_every_stage_and_writes_what_the_next_reads(dry_run) -> None:
    out, pack, printed = dry_run
    rows = _manifest(out)
    assert [(r["part"], r["stage"]) for r in rows] == [
        *(("1", s) for s in PART1),
        *(("2", s) for s in PART2),
    ]
    for row in rows:
        assert row["exit"] == "0", row
        wanted = WRITES.get(row["stage"], set())
        assert wanted <= set(filter(None, row["files"].split(","))), row
    # Each part printed its stages and their limits first.
    for part, stages in (("1", PART1), ("2", PART2)):
        head = printed[part].split("== versions (limit")[0]
        assert [line.split()[0] for line in head.splitlines()[1:-1]] == stages, head
    # The sweeps: every kernel measured, the peers skipped with one line each.
    sweep = read_rows(out / "sweep.csv", skipped=True)
    ran = {(r["kernel"], r["provider"]) for r in sweep if not r["skipped"]}
    for kernel in ("paged_attention", "staged", "gather_blocks", "write_slots"):
        assert (kernel, "triton") in ran
    skipped = {r["provider"]: r["skipped"] for r in sweep if r["skipped"]}
    assert "not installed" in skipped["sageattention"]
    assert "not installed" in skipped["flash-attn-4"]
    peers = read_rows(out / "peers" / "sweep.csv", skipped=True)
    assert {r["provider"] for r in peers} >= {"triton", "triton-tma-n128", "sageattention"}
    # The launches and the probes, as choose reads them; the table it wrote passes its checks.
    launches = read_rows(out / "launches" / "sweep.csv")
    assert {r["provider"] for r in launches} >= set(choose.LAUNCH_PROVIDERS)
    for name, modes in (
        ("probe_dequant", {"int8_keys"}),
        ("probe_eight_bit", {"k8v8_keys", "k8v16_keys"}),
    ):
        probed = choose.read_probe(out / name / "probe.csv")
        assert {r["mode"] for r in probed if r["outcome"] == "ok"} == modes, name
    table = launch_table.read_table(out / "launch_choices.json")
    assert any(r["device"].startswith("cpu") for r in table["choices"])
    assert "not picked by any row (launch providers)" in printed["2"]
    # The rollout: the plain cache and the paged one in bf16 and k8v8 (the fast format), frames
    # per second, the anchors.
    with open(out / "rollout.csv", newline="") as stream:
        rollout = list(csv.DictReader(stream))
    assert [(r["provider"], r["kv_format"]) for r in rollout] == [
        ("plain", "-"),
        ("paged", "bf16"),
        ("paged", "k8v8"),
    ]
    assert all(float(r["steady_fps"]) > 0 for r in rollout)
    assert "Self-Forcing 17 FPS, LongLive 20.7 FPS" in printed["2"]
    # Accuracy: every quantized format kept, each against its own float64 emulation (on a GPU
    # the only check of the 8-bit formats' arithmetic as the hardware rounds it).
    with open(out / "accuracy.csv", newline="") as stream:
        accurate = list(csv.DictReader(stream))
    assert {r["format"] for r in accurate} == {"bf16", "int8", "k8v8", "k8v16"}
    assert all(r["mode_floor_rel_l1"] for r in accurate if r["format"] != "bf16")
    with open(out / "compile.csv", newline="") as stream:
        compiled = list(csv.DictReader(stream))
    assert compiled and all(not r["error"] for r in compiled)
    assert compiled[0]["global_access_bytes"].startswith("16"), compiled[0]
    # What a device call brings back: one archive per part, the first one's results in it.
    with tarfile.open(pack / "gpu_check-part1.tgz") as archive:
        names = {Path(n).relative_to(out.name).as_posix() for n in archive.getnames()[1:]}
    assert {"sweep.csv", "launches/sweep.csv", "launch_choices.json", "tests.log"} <= names
    assert (pack / "gpu_check-part2.tgz").is_file()


# A session's device time (the device tool: 15 minutes, every start and idle wait counted)
# and what the machine's start may take of it ("a minute or more"; allowed twice that).
DEVICE_WINDOW_S = 15 * 60
DEVICE_START_S = 120


def _gpu_limits(script: str) -> dict[str, int]:
    """The GPU branch's stage limits (the first ``limits=(...)``)."""
    block = re.search(r"limits=\(([^)]*)\)", script).group(1)
    return {name: int(n) for name, n in re.findall(r"(\w+)=(\d+)", block)}


def test_the_gpu_check_names_real_providers_and_runs_and_fits_two_calls() -> None:
    # A typo here would cost a GPU window: every provider the script names exists, every
    # probe run parses, and each part's stage limits fit its documented device call.
    from paged_video.bench.launch_probe import parse_runs
    from paged_video.bench.providers import PROVIDERS, SDPA_BEST

    script = SCRIPT.read_text()
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0
    variables = dict(re.findall(r"^(\w+)=([\w.,+@-]+)$", script, flags=re.M))
    names = {p.name for p in PROVIDERS} | {SDPA_BEST}
    for listed in ("launch_providers", "peer_providers"):
        assert set(variables[listed].split(",")) <= names, listed
    probes = re.findall(r'--runs\s+"([^"]+)"', script)
    # The 8-bit formats' candidates first (issue 45's speed goals), then the dequantizing int8
    # mode's (the MMA modes: deleted).
    assert len(probes) == 2, probes
    for runs in probes:
        for name, value in variables.items():
            runs = runs.replace(f"${name}", value)
        assert len(parse_runs(runs)) >= 3, runs
    eight_bit = parse_runs(probes[0].replace("$eight_bit_runs", variables["eight_bit_runs"]))
    assert {p for p, _ in eight_bit} == {"triton-k8v8", "triton-k8v16"}
    # Each format's launch beside its twin with the scores by their bits, first.
    assert [(p, str(launch)) for p, launch in eight_bit[:4]] == [
        (provider, launch)
        for provider in ("triton-k8v8", "triton-k8v16")
        for launch in ("default", "default+bits")
    ]
    limits = _gpu_limits(script)
    stage_limit = {
        "versions": "VERSIONS", "peers_setup": "PEERS_SETUP", "tests": "TESTS", "sweep": "SWEEP",
        "launches": "LAUNCH", "choose": "CHOOSE", "pipes": "PIPES", "probes": "PROBE",
        "choose2": "CHOOSE2", "peers": "PEERS", "rollout": "ROLLOUT", "accuracy": "ACCURACY",
        "regrow": "REGROW", "compile": "COMPILE", "report": "REPORT",
    }  # fmt: skip
    assert set(stage_limit.values()) == set(limits)
    docs = (REPO / "docs" / "benchmarks.md").read_text()
    calls = []
    for part, stages in (("1", PART1), ("2", PART2)):
        total = sum(limits[stage_limit[s]] for s in stages)
        command = re.search(rf"`(bash bench/gpu_check.sh --part {part} [^`]*)`", docs).group(1)
        call = int(re.search(rf"--part {part}\b.*?timeout_s (\d+)", docs, re.S).group(1))
        assert "--pack" in command, command
        # Every stage ends (and packs its files) before the call's own limit cuts the run.
        assert total + 10 <= call, (part, total, call)
        calls.append(call)
    # Both calls and the machine's start fit the session's device time.
    assert sum(calls) + DEVICE_START_S <= DEVICE_WINDOW_S, calls
    assert f"{DEVICE_WINDOW_S // 60} minutes" in docs and f"{DEVICE_START_S} s" in docs
    # The sweep runs the shipped block sizes first and the ratio table last.
    assert "BLOCK_SIZES:-16,1560,24,64,256,520,32,128}" in script
    commands = [line for line in script.splitlines() if '"$python" -m paged_video.bench' in line]
    assert "sweep" in commands[0]
    table = '"$python" -m paged_video.bench table "$out_dir/sweep.csv" --goal'
    assert commands[-1].strip() == table


def test_the_gpu_tests_list_names_the_launch_rows_first() -> None:
    ids = [
        line.strip()
        for line in (REPO / "bench" / "gpu_tests.txt").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert ids[0] == "tests/kernels/test_launch_rows.py"
    for test_id in ids:
        assert (REPO / test_id.split("::")[0]).is_file(), test_id


@pytest.mark.parametrize("bad", [["--part", "3"], ["--frobnicate"], ["--part"]])
def test_a_wrong_option_is_refused_before_any_stage(bad: list[str], tmp_path) -> None:
    done = subprocess.run(
        ["bash", str(SCRIPT), *bad, str(tmp_path / "out")], capture_output=True, text=True
    )
    assert done.returncode == 2, done
    assert "gpu_check:" in done.stderr
    assert not (tmp_path / "out" / "stages.tsv").exists()

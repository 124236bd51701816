"""``bench choose``: the launch table from a (synthetic) GPU sweep of the launch providers."""

from __future__ import annotations

import json
import shutil

import pytest

from paged_video.bench import choose
from paged_video.bench.cli import main
from paged_video.bench.providers import LAUNCH_PROVIDERS, launch_backend
from paged_video.bench.results import write_rows
from paged_video.kernels import launch_table
from tests.bench.rows import STEADY_CEILINGS, measured

# Per block size, each launch's milliseconds. Contiguous blocks (64, 256): TMA wins at both;
# block_tiles (520, 1560): cp_async at 128 keys wins once and loses once, but its geometric mean
# beats the 64-key cp_async; rows (16, 32): the 64-key cp_async.
TIMES = {
    16: {"triton-cp_async": 1.0, "triton-tma": 1.0, "triton-cp_async-n128": 1.2},
    32: {"triton-cp_async": 1.0, "triton-tma": 1.0, "triton-cp_async-n128": 1.3},
    64: {"triton-cp_async": 1.0, "triton-tma": 0.9, "triton-cp_async-n128": 1.1},
    256: {"triton-cp_async": 1.0, "triton-tma": 0.8, "triton-tma-n128": 0.85},
    520: {"triton-cp_async": 1.0, "triton-tma": 1.0, "triton-cp_async-n128": 0.8},
    1560: {"triton-cp_async": 1.0, "triton-tma": 1.0, "triton-cp_async-n128": 1.05},
}
WINNERS = {
    "contiguous": ("tma", 64),
    "block_tiles": ("cp_async", 128),
    "rows": ("cp_async", 64),
}


def _rows(figures: str = "gpu") -> list[dict]:
    rows = list(STEADY_CEILINGS)
    for block, times in TIMES.items():
        for name, ms in times.items():
            launch = LAUNCH_PROVIDERS[name]
            settings = {
                "variant": launch["variant"],
                "tile": f"128x{launch['block_n']}",
                "num_warps": 8,
                "num_stages": 3,
                "tma": "on",
                "ahead": "on" if launch["scores_ahead"] else "off",
            }
            rows.append(
                measured(
                    "paged_attention",
                    name,
                    block,
                    ms,
                    role="ours",
                    backend=launch_backend(settings),
                    figures=figures,
                )
            )
        rows.append(measured("paged_attention", "sdpa-best", block, 1.1, role="best-of"))
        rows.append(measured("paged_attention", "triton-int8", block, 0.7, role="quantized"))
    return rows


def test_winners_per_class() -> None:
    choices, lines = choose.choose(_rows())
    got = {c["kv_path"]: (c["variant"], c["block_n"]) for c in choices}
    assert got == WINNERS
    assert all(c["head_dim"] == 128 and c["source"] == "gpu run" for c in choices)
    assert {c["device"] for c in choices} == {"NVIDIA H200"}
    assert {c["date"] for c in choices} == {"2026-12-03"}
    # The winner table: one line per block size, the winner's speedup over sdpa-best.
    [line_256] = [line for line in lines if " | 256 | " in line]
    assert "tma" in line_256 and f"{1.1 / 0.8:.2f}x" in line_256
    assert f"{1.1 / 0.7:.2f}x" in line_256  # the int8 pool over sdpa-best


def test_the_table_names_the_winning_variant_where_a_block_fell_back() -> None:
    # block_tiles class: at block 24 a 128-key TMA tile straddles blocks, so the launcher ran
    # the pointer loop (its backend says cp_async); at 520/1560 it ran TMA and won. The row
    # written must say tma, else blocks 520/1560 would lose the launch that won there.
    rows = list(STEADY_CEILINGS)
    for block, ran in ((24, "cp_async"), (520, "tma"), (1560, "tma")):
        for name, variant, ms in (
            ("triton-cp_async", "cp_async", 1.0),
            ("triton-tma-n128", ran, 0.8),
        ):
            settings = {
                "variant": variant,
                "tile": f"128x{LAUNCH_PROVIDERS[name]['block_n']}",
                "num_warps": 8,
                "num_stages": 3,
                "tma": "on" if variant == "tma" else "off",
                "ahead": "off",
            }
            backend = launch_backend(settings)
            rows.append(measured("paged_attention", name, block, ms, role="ours", backend=backend))
    [choice] = choose.choose(rows)[0]
    assert (choice["kv_path"], choice["variant"], choice["block_n"]) == ("block_tiles", "tma", 128)
    assert (choice["num_warps"], choice["num_stages"]) == (8, 3)


def _launch_row(name: str, block: int, ms: float, variant: str | None = None) -> dict:
    launch = LAUNCH_PROVIDERS[name]
    settings = {
        "variant": variant or launch["variant"],
        "tile": f"128x{launch['block_n']}",
        "num_warps": 8,
        "num_stages": 3,
        "tma": "on" if (variant or launch["variant"]) == "tma" else "off",
        "ahead": "on" if launch["scores_ahead"] else "off",
    }
    backend = launch_backend(settings)
    return measured("paged_attention", name, block, ms, role="ours", backend=backend)


@pytest.mark.parametrize("ahead", ["", "-ahead"], ids=["plain", "ahead"])
def test_the_pair_loop_counts_as_the_pointer_loop_a_table_row_runs(ahead: str) -> None:
    # Contiguous class (blocks 64, 256): at 64, triton-tma-n128 ran the loop over tiles of two
    # whole blocks (fastest there), which a table row would read by pointer, as slowly as
    # triton-cp_async-n128. Weighed so, the 64-key TMA loop wins the class (geometric means
    # 1.02 against 1.14); taken at its own time, tma-n128 would have (1.00 against 1.08).
    # With the scores ahead (its pair loop too), the same against triton-cp_async-n128-ahead.
    pairs, pointers = f"triton-tma-n128{ahead}", f"triton-cp_async-n128{ahead}"
    rows = list(STEADY_CEILINGS)
    times = {
        64: {"triton-tma": 1.0, pairs: 0.9, pointers: 1.3},
        256: {"triton-tma": 1.0, pairs: 0.96, pointers: 1.2},
    }
    for block, by_name in times.items():
        rows += [_launch_row(name, block, ms) for name, ms in by_name.items()]
        rows.append(measured("paged_attention", "sdpa-best", block, 1.0, role="best-of"))
    [choice], lines = choose.choose(rows)
    assert (choice["kv_path"], choice["variant"], choice["block_n"]) == ("contiguous", "tma", 64)
    [line_64] = [line for line in lines if " | 64 | " in line]
    assert "0.900 (pairs)" in line_64 and "(pairs)" not in lines[-1]
    # Without the pointer loop's time at 64, tma-n128 does not compete in the class.
    rows = [r for r in rows if r["provider"] != pointers]
    [choice], _ = choose.choose(rows)
    assert (choice["variant"], choice["block_n"]) == ("tma", 64)
    # With a faster pointer loop at 64 tma-n128 wins as a table row runs it (1.00 against
    # 1.12 and 1.14), and the winner's speedup at 64 is the pointer loop's: 1.0 / 0.8.
    rows += [_launch_row(pointers, b, ms) for b, ms in ((64, 0.8), (256, 1.2))]
    [choice], lines = choose.choose(rows)
    assert (choice["variant"], choice["block_n"]) == ("tma", 128)
    assert choice["scores_ahead"] == bool(ahead)
    [line_64] = [line for line in lines if " | 64 | " in line]
    assert " | 1.25x" in line_64 and " | 1.11x" not in line_64


def test_cpu_figures_choose_nothing() -> None:
    with pytest.raises(ValueError, match="GPU run only"):
        choose.choose(_rows(figures="cpu"))


def test_a_launch_missing_at_one_block_does_not_compete() -> None:
    rows = [r for r in _rows() if not (r["provider"] == "triton-tma" and r["block_size"] == 256)]
    choices, _ = choose.choose(rows)
    # Contiguous blocks 64 and 256: only the 64-key cp_async is measured at both.
    contiguous = [c for c in choices if c["kv_path"] == "contiguous"]
    assert [(c["variant"], c["block_n"]) for c in contiguous] == [("cp_async", 64)]


def test_a_class_without_a_complete_launch_keeps_its_row() -> None:
    # Cut short: at block 32 nothing was measured but tma, at 16 nothing but cp_async.
    rows = [
        r
        for r in _rows()
        if not (r["block_size"] == 32 and r["provider"] != "triton-tma")
        and not (r["block_size"] == 16 and r["provider"] != "triton-cp_async")
    ]
    choices, lines = choose.choose(rows)
    assert {c["kv_path"] for c in choices} == {"contiguous", "block_tiles"}
    assert any("rows: no launch measured at every block size" in line for line in lines)
    only_rows = [r for r in rows if r["block_size"] in (16, 32)]
    with pytest.raises(ValueError, match="no class"):
        choose.choose(only_rows)


def _key(row: dict) -> tuple:
    return row["head_dim"], row["kv_path"], row["mode"]


def test_write_replaces_measured_classes_only(tmp_path) -> None:
    table = tmp_path / "launch_choices.json"
    shutil.copy(launch_table.TABLE_PATH, table)
    csv_path = tmp_path / "sweep.csv"
    write_rows(csv_path, _rows())
    assert main(["choose", str(csv_path), "--write", str(table)]) == 0
    written = launch_table.read_table(table)
    shipped = launch_table.read_table()
    for row in written["choices"]:
        key = _key(row)
        if key[0] == 128 and key[1] in WINNERS and key[2] == "same":
            assert (row["variant"], row["block_n"]) == WINNERS[row["kv_path"]], row
            assert row["source"] == "gpu run"
        else:
            [old] = [r for r in shipped["choices"] if _key(r) == key]
            assert row == old
    assert len(written["choices"]) == len(shipped["choices"])


def test_write_refuses_cpu_rows_and_leaves_the_table(tmp_path, capsys) -> None:
    table = tmp_path / "launch_choices.json"
    shutil.copy(launch_table.TABLE_PATH, table)
    before = table.read_text()
    csv_path = tmp_path / "sweep.csv"
    write_rows(csv_path, _rows(figures="cpu"))
    with pytest.raises(SystemExit):
        main(["choose", str(csv_path), "--write", str(table)])
    assert "GPU run only" in capsys.readouterr().err
    assert table.read_text() == before
    assert json.loads(before)  # still the committed table


def test_backend_names_the_launch() -> None:
    settings = {"variant": "tma", "tile": "128x64", "num_warps": 8, "num_stages": 3, "tma": "on"}
    for ahead in (True, False):
        backend = launch_backend({**settings, "ahead": "on" if ahead else "off"})
        launch = choose.launch_of({"provider": "x", "backend": backend})
        want = {"variant": "tma", "block_n": 64, "num_warps": 8, "num_stages": 3}
        assert launch == {**want, "scores_ahead": ahead}
    # A row of a run before the scores-ahead loop existed: its loop had it off.
    old = "triton paged_attention variant=tma tile=128x64 warps=8 stages=3 tma=on"
    assert choose.launch_of({"provider": "x", "backend": old})["scores_ahead"] is False
    with pytest.raises(ValueError, match="names no launch"):
        choose.launch_of({"provider": "x", "backend": "triton paged_attention"})


def test_a_scores_ahead_winner_writes_its_row(tmp_path) -> None:
    # The block_tiles class: the 128-key TMA loop with the scores ahead is fastest at 520 and
    # 1560; the row written names it, and the table the launcher reads takes it.
    rows = list(STEADY_CEILINGS)
    for block in (24, 520, 1560):
        rows.append(_launch_row("triton-tma-n128", block, 1.0, "cp_async" if block == 24 else None))
        rows.append(
            _launch_row("triton-tma-n128-ahead", block, 0.9, "cp_async" if block == 24 else None)
        )
    [choice] = choose.choose(rows)[0]
    assert (choice["variant"], choice["block_n"], choice["scores_ahead"]) == ("tma", 128, True)
    table = tmp_path / "choices.json"
    shutil.copy(launch_table.TABLE_PATH, table)
    written = choose.write_choices(table, [choice])
    key = (128, "block_tiles", "same")
    [row] = [r for r in written["choices"] if (r["head_dim"], r["kv_path"], r["mode"]) == key]
    assert row["scores_ahead"] is True
    assert launch_table.read_table(table) == written


def test_launch_providers_run_when_named_only(tmp_path) -> None:
    from paged_video.bench.sweep import run_sweep
    from tests.bench.tiny import paged_config

    # Unnamed, the sweep leaves them out; named, each is checked against the oracle and its
    # backend names the launch that ran: at block 64 (64-key tiles: the contiguous path) the
    # TMA loop; at block 16 (the rows path) the pointer loop. The tiny geometry's GQA has no
    # warp-specialized kernel: skipped with the reason.
    plain = run_sweep(paged_config(block_sizes=(64,)), tmp_path / "a.csv", progress=False)
    assert not {r["provider"] for r in plain.rows} & set(LAUNCH_PROVIDERS)
    names = ("triton-tma", "triton-cp_async", "triton-ws")
    config = paged_config(block_sizes=(64, 16), providers=names)
    result = run_sweep(config, tmp_path / "b.csv", progress=False)
    rows = {
        (r["provider"], r["block_size"]): r
        for r in result.rows
        if r["kernel"] == "paged_attention" and not r.get("skipped")
    }
    assert set(rows) == {(n, b) for n in names[:2] for b in (64, 16)}
    assert all(r["max_error"] <= r["error_limit"] for r in rows.values())
    assert "variant=tma" in rows[("triton-tma", 64)]["backend"]
    assert "variant=cp_async" in rows[("triton-tma", 16)]["backend"]
    assert "variant=cp_async" in rows[("triton-cp_async", 64)]["backend"]
    skipped = [s for s in result.skipped if s.provider == "triton-ws"]
    assert len(skipped) == 2 and all("one query head per KV head" in s.reason for s in skipped)


def test_a_warp_specialized_row_names_the_stages_that_ran(monkeypatch) -> None:
    # The launcher caps the ws kernel at WS_MAX_STAGES whatever the tiles say; the row's backend
    # (which `choose` writes into the table) must say what ran, not the tiles' stage count.
    from paged_video import kernels
    from paged_video.bench.providers import PROVIDERS
    from paged_video.bench.workload import Geometry, make_workload
    from paged_video.kernels.paged_attention import WS_MAX_STAGES

    real = kernels.choose_tiles
    monkeypatch.setattr(kernels, "choose_tiles", lambda **kw: {**real(**kw), "num_stages": 4})
    [ws] = [p for p in PROVIDERS if p.kernel == "paged_attention" and p.name == "triton-ws"]
    workload = make_workload(Geometry(64, 1, 1, 1, 2, 2, 64, "fp16", 1), 64, device="cpu")
    backend = ws.build(workload, None).backend
    assert "variant=ws" in backend and f"stages={WS_MAX_STAGES} " in backend, backend
    [tma] = [p for p in PROVIDERS if p.kernel == "paged_attention" and p.name == "triton-tma"]
    assert "stages=4 " in tma.build(workload, None).backend


# --- quantized rows from a launch probe ------------------------------------------------------

K8V16, INT8 = "triton-k8v16", "triton-int8-keys"
# (provider, mode, block, config, what ran, ms). k8v16 at 1560 (block_tiles): the
# 64-key TMA loop wins; the launcher's default, the 128-key TMA launch, is probed twice there (as
# default and by its settings) and counts at its faster time. At 256 (contiguous, its own class) the
# 128-key TMA launch wins. int8 (dequantizing) at 1560: its pointer loop wins.
PROBED = [
    (K8V16, "k8v16_keys", 1560, "default", ("tma", 128, 8, 3), 4.8),
    (K8V16, "k8v16_keys", 1560, "128x128w8s3+tma", ("tma", 128, 8, 3), 5.0),
    (K8V16, "k8v16_keys", 1560, "128x64w8s3+cp_async", ("cp_async", 64, 8, 3), 5.2),
    (K8V16, "k8v16_keys", 1560, "128x64w8s3+tma", ("tma", 64, 8, 3), 4.0),
    (K8V16, "k8v16_keys", 256, "default", ("tma", 128, 8, 3), 4.0),
    (K8V16, "k8v16_keys", 256, "128x64w8s3+cp_async", ("cp_async", 64, 8, 3), 5.0),
    (K8V16, "k8v16_keys", 256, "128x64w8s3+tma", ("tma", 64, 8, 3), 4.1),
    (INT8, "int8_keys", 1560, "default", ("cp_async", 64, 8, 3), 6.0),
    (INT8, "int8_keys", 1560, "128x64w8s3+tma", ("tma", 64, 8, 3), 6.3),
    (INT8, "int8_keys", 1560, "128x128w8s3+tma", ("tma", 128, 8, 3), 6.6),
]


def _probe_rows(figures: str = "gpu", probed=PROBED) -> list[dict]:
    rows = []
    for provider, mode, block, config, (variant, block_n, warps, stages), ms in probed:
        settings = {
            "variant": variant,
            "tile": f"128x{block_n}",
            "num_warps": warps,
            "num_stages": stages,
            "tma": "on" if variant == "tma" else "off",
            "ahead": "off",
        }
        # As csv.DictReader gives them back: strings.
        row = {
            "provider": provider, "mode": mode, "head_dim": "128", "block_size": str(block),
            "launch": config, "backend": launch_backend(settings), "ms": str(ms),
            "outcome": "ok", "figures": figures, "device": "NVIDIA H200",
            "commit": "abc123", "timestamp": "2026-12-05T10:00:00+00:00",
        }  # fmt: skip
        rows.append(row)
    return rows


def test_quantized_winners_per_class_and_mode() -> None:
    choices, lines = choose.choose_quantized(_probe_rows())
    got = {(c["kv_path"], c["mode"]): (c["variant"], c["block_n"]) for c in choices}
    assert got == {
        ("block_tiles", "k8v16_keys"): ("tma", 64),
        ("contiguous", "k8v16_keys"): ("tma", 128),
        ("block_tiles", "int8_keys"): ("cp_async", 64),
    }
    [k8v16_tiles] = [c for c in choices if c["kv_path"] == "block_tiles" and "k8v16" in c["mode"]]
    # 128-key TMA at its faster time, 4.8 (as default; not the later 5.0), over the winner's.
    assert f"tma n128 w8 s3 {4.8 / 4.0:.3f}" in k8v16_tiles["evidence"]
    assert "launch_probe at blocks 1560" in k8v16_tiles["evidence"]
    assert all(c["source"] == "gpu run" and c["device"] == "NVIDIA H200" for c in choices)
    assert {c["date"] for c in choices} == {"2026-12-05"}
    launch_table.check_table({"about": "x", "choices": choices})
    assert any("winner tma n128 w8 s3" in line and "| 256 |" in line for line in lines)


def test_a_probed_class_with_one_launch_keeps_its_row() -> None:
    # Cut short: at block 256 only the default ran. Nothing was compared there.
    probed = [p for p in PROBED if p[2] != 256 or p[3] == "default"]
    choices, lines = choose.choose_quantized(_probe_rows(probed=probed))
    assert {(c["kv_path"], c["mode"]) for c in choices} == {
        ("block_tiles", "k8v16_keys"),
        ("block_tiles", "int8_keys"),
    }
    assert any("contiguous k8v16_keys: fewer than two" in line for line in lines)


def test_probed_cpu_figures_choose_nothing() -> None:
    with pytest.raises(ValueError, match="GPU run only"):
        choose.choose_quantized(_probe_rows(figures="cpu-interpreter"))


def test_a_probed_launch_the_table_cannot_hold_is_no_choice() -> None:
    rows = _probe_rows()
    # The fastest INT8 launch ran 64-row query tiles: the table names no query tile.
    rows.append({**rows[-1], "backend": rows[-1]["backend"].replace("128x128", "64x128")})
    rows[-1]["ms"] = "1.0"
    choices, lines = choose.choose_quantized(rows)
    [int8] = [c for c in choices if c["mode"] == "int8_keys"]
    assert (int8["variant"], int8["block_n"]) == ("cp_async", 64)
    assert any("another query tile" in line for line in lines)
    # Nor one that read its scales the wide way: the table cannot say so.
    rows[-1] = {**rows[-2], "launch": "128x128w8s3+wide+tma", "ms": "1.0"}
    choices, lines = choose.choose_quantized(rows)
    [int8] = [c for c in choices if c["mode"] == "int8_keys"]
    assert (int8["variant"], int8["block_n"]) == ("cp_async", 64)
    assert any("wide scale loads" in line for line in lines)
    # Nor one that took its scores by their bits.
    rows[-1] = {**rows[-2], "launch": "default+bits", "ms": "1.0"}
    choices, lines = choose.choose_quantized(rows)
    [int8] = [c for c in choices if c["mode"] == "int8_keys"]
    assert (int8["variant"], int8["block_n"]) == ("cp_async", 64)
    assert any("scores by their bits" in line for line in lines)


def _write_probe(path, rows: list[dict]) -> None:
    import csv

    with open(path, "w", newline="") as stream:
        writer = csv.DictWriter(stream, list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def test_write_from_a_probe_replaces_its_quantized_rows_only(tmp_path) -> None:
    table = tmp_path / "launch_choices.json"
    shutil.copy(launch_table.TABLE_PATH, table)
    probe_csv = tmp_path / "probe.csv"
    _write_probe(probe_csv, _probe_rows())
    assert main(["choose", "--probe", str(probe_csv), "--write", str(table)]) == 0
    written = {_key(r): r for r in launch_table.read_table(table)["choices"]}
    shipped = {_key(r): r for r in launch_table.read_table()["choices"]}
    chosen = {k for k, r in written.items() if r["source"] == "gpu run" and k[2] != "same"}
    assert chosen == {
        (128, "block_tiles", "k8v16_keys"),
        (128, "contiguous", "k8v16_keys"),
        (128, "block_tiles", "int8_keys"),
    }
    assert written[(128, "block_tiles", "k8v16_keys")]["block_n"] == 64
    assert written[(128, "block_tiles", "int8_keys")]["variant"] == "cp_async"
    kept = {k: r for k, r in shipped.items() if k not in chosen}
    assert {k: r for k, r in written.items() if k not in chosen} == kept
    assert set(written) == set(shipped) | chosen


def test_choose_names_what_is_missing_or_wrong(tmp_path, capsys) -> None:
    with pytest.raises(SystemExit):
        main(["choose"])
    assert "a sweep CSV, a --probe CSV, or both" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["choose", "--probe", str(tmp_path / "none.csv")])
    assert "--probe" in capsys.readouterr().err
    not_probe = tmp_path / "sweep.csv"
    write_rows(not_probe, _rows())
    with pytest.raises(SystemExit):
        main(["choose", "--probe", str(not_probe)])
    assert "not a launch_probe CSV" in capsys.readouterr().err
    # A probe where nothing was compared: nothing to write, said, table untouched.
    table = tmp_path / "launch_choices.json"
    shutil.copy(launch_table.TABLE_PATH, table)
    before = table.read_text()
    probe_csv = tmp_path / "probe.csv"
    _write_probe(probe_csv, _probe_rows(probed=PROBED[:1]))
    with pytest.raises(SystemExit):
        main(["choose", "--probe", str(probe_csv), "--write", str(table)])
    assert "nothing to choose" in capsys.readouterr().err
    assert table.read_text() == before


def test_a_sweep_that_chooses_nothing_does_not_cost_the_probes_rows(tmp_path, capsys) -> None:
    # One GPU window: its probe's choice is written though the sweep's could not be made, and
    # the command still fails, naming the sweep.
    table = tmp_path / "launch_choices.json"
    shutil.copy(launch_table.TABLE_PATH, table)
    sweep_csv, probe_csv = tmp_path / "sweep.csv", tmp_path / "probe.csv"
    write_rows(sweep_csv, _rows(figures="cpu"))
    _write_probe(probe_csv, _probe_rows())
    code = main(["choose", str(sweep_csv), "--probe", str(probe_csv), "--write", str(table)])
    assert code == 1
    assert "error: csv: launch rows have cpu figures" in capsys.readouterr().err
    written = launch_table.read_table(table)["choices"]
    assert sum(r["source"] == "gpu run" and r["mode"] != "same" for r in written) == 3


def test_the_launches_no_row_picked_are_listed_last() -> None:
    # After a GPU run the losers go: the list must name exactly what was measured and won
    # nowhere, the 16-bit launches and the quantized ones alike.
    choices, lines = choose.choose(_rows())
    measured = {r["provider"] for r in _rows() if r.get("provider") in LAUNCH_PROVIDERS}
    fields = ("variant", "block_n", "scores_ahead")
    chosen = {tuple(c[f] for f in fields) for c in choices}
    winners = {n for n in measured if tuple(LAUNCH_PROVIDERS[n][f] for f in fields) in chosen}
    prefix = "not picked by any row (launch providers): "
    assert lines[-1].startswith(prefix)
    listed = set(lines[-1].removeprefix(prefix).split(", "))
    assert listed and listed == measured - winners
    choices, lines = choose.choose_quantized(_probe_rows())
    listed = lines[-1].removeprefix("not picked by any row (quantized launches): ").split(", ")
    picked = {f"{c['mode']} {choose._launch_label(c)}" for c in choices}
    assert listed == [
        "int8_keys tma n128 w8 s3",
        "int8_keys tma n64 w8 s3",
        "k8v16_keys cp_async n64 w8 s3",
    ]
    assert not picked & set(listed)


def test_a_rehearsal_chooses_from_cpu_figures() -> None:
    with pytest.raises(ValueError, match="a GPU run only"):
        choose.choose(_rows(figures="cpu-interpreter"))
    choices, _ = choose.choose(_rows(figures="cpu-interpreter"), rehearsal=True)
    assert {c["kv_path"]: (c["variant"], c["block_n"]) for c in choices} == WINNERS

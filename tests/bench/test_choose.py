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
# beats the 64-key cp_async; rows (16, 7): the 64-key cp_async.
TIMES = {
    16: {"triton-cp_async": 1.0, "triton-tma": 1.0, "triton-cp_async-n128": 1.2},
    7: {"triton-cp_async": 1.0, "triton-tma": 1.0, "triton-cp_async-n128": 1.3},
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
        rows.append(measured("paged_attention", "triton-e4m3", block, 0.7, role="quantized"))
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
    assert f"{1.1 / 0.7:.2f}x" in line_256  # the e4m3 pool over sdpa-best


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
            }
            backend = launch_backend(settings)
            rows.append(measured("paged_attention", name, block, ms, role="ours", backend=backend))
    [choice] = choose.choose(rows)[0]
    assert (choice["kv_path"], choice["variant"], choice["block_n"]) == ("block_tiles", "tma", 128)
    assert (choice["num_warps"], choice["num_stages"]) == (8, 3)


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
    # Cut short: at block 7 nothing was measured but tma, at 16 nothing but cp_async.
    rows = [
        r
        for r in _rows()
        if not (r["block_size"] == 7 and r["provider"] != "triton-tma")
        and not (r["block_size"] == 16 and r["provider"] != "triton-cp_async")
    ]
    choices, lines = choose.choose(rows)
    assert {c["kv_path"] for c in choices} == {"contiguous", "block_tiles"}
    assert any("rows: no launch measured at every block size" in line for line in lines)
    only_rows = [r for r in rows if r["block_size"] in (16, 7)]
    with pytest.raises(ValueError, match="no class"):
        choose.choose(only_rows)


def test_write_replaces_measured_classes_only(tmp_path) -> None:
    table = tmp_path / "launch_choices.json"
    shutil.copy(launch_table.TABLE_PATH, table)
    csv_path = tmp_path / "sweep.csv"
    write_rows(csv_path, _rows())
    assert main(["choose", str(csv_path), "--write", str(table)]) == 0
    written = launch_table.read_table(table)
    shipped = launch_table.read_table()
    for row in written["choices"]:
        key = (row["head_dim"], row["kv_path"])
        if row["head_dim"] == 128 and row["kv_path"] in WINNERS:
            assert (row["variant"], row["block_n"]) == WINNERS[row["kv_path"]], row
            assert row["source"] == "gpu run"
        else:
            [old] = [r for r in shipped["choices"] if (r["head_dim"], r["kv_path"]) == key]
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
    launch = choose.launch_of({"provider": "x", "backend": launch_backend(settings)})
    assert launch == {"variant": "tma", "block_n": 64, "num_warps": 8, "num_stages": 3}
    with pytest.raises(ValueError, match="names no launch"):
        choose.launch_of({"provider": "x", "backend": "triton paged_attention"})


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

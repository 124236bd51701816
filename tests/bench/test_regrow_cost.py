"""bench.regrow_cost: every format and case timed on the small preset, the CSV written in long
format, nothing regrown on rows of one kind, bad formats refused."""

from __future__ import annotations

import csv

import pytest
import torch

from paged_video.bench import regrow_cost


def test_small_preset_times_every_format_and_case(tmp_path, capsys) -> None:
    assert regrow_cost.main(["--preset", "small", "--device", "cpu", "--out", str(tmp_path)]) == 0
    with open(tmp_path / "regrow_cost.csv", newline="") as stream:
        rows = list(csv.DictReader(stream))
    assert {(r["format"], r["case"]) for r in rows} == {
        (f, c) for f in regrow_cost.FORMATS for c in regrow_cost.CASES
    }
    assert all(float(r["ms"]) > 0 and r["commit"] and r["device"] for r in rows)
    table = capsys.readouterr().out
    assert all(f"\n{f} " in table for f in regrow_cost.FORMATS)


def test_the_check_is_what_the_checked_write_runs(monkeypatch) -> None:
    # The "checked" write runs the regrowth rule and the "frozen" one does not: counted.
    small = regrow_cost.PRESETS["small"]
    setup = regrow_cost._setup("k8v16", small, torch.device("cpu"), torch.float32)
    calls = []
    real = regrow_cost.regrow.regrown_factors
    monkeypatch.setattr(
        regrow_cost.regrow, "regrown_factors", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    timed = regrow_cost.cases(setup)
    timed["frozen"]()
    assert not calls
    timed["checked"]()
    assert len(calls) == 1


@pytest.mark.parametrize("bad", ["e4m3", "int8,fp8", ","])
def test_unknown_formats_are_refused(bad: str) -> None:
    with pytest.raises(SystemExit):
        regrow_cost.main(["--preset", "small", "--device", "cpu", "--formats", bad])

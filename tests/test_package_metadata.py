"""The package says what it is: a license with its text, authors, and the Triton range it is
tested on (the GPU figures' 3.6 to CI's 3.9), which the running Triton must be in."""

from __future__ import annotations

from pathlib import Path

import pytest
import triton
from packaging.requirements import Requirement
from packaging.version import Version

REPO = Path(__file__).resolve().parents[1]
tomllib = pytest.importorskip("tomllib")  # Python 3.11+


def _project() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def test_license_authors_and_the_license_text():
    project = _project()
    assert project["license"] == "MIT" and project["license-files"] == ["LICENSE"]
    assert (REPO / "LICENSE").read_text().startswith("MIT License\n")
    assert project["authors"] and all(author.get("name") for author in project["authors"])


def test_triton_is_pinned_to_the_tested_range_and_this_one_is_in_it():
    [triton_requirement] = [
        Requirement(text) for text in _project()["dependencies"] if text.startswith("triton")
    ]
    allowed = triton_requirement.specifier
    assert Version("3.6.0") in allowed and Version("3.9.0") in allowed
    assert Version("3.5.1") not in allowed and Version("3.10.0") not in allowed
    assert Version(triton.__version__) in allowed

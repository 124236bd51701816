"""Fixtures of the kernel tests."""

from __future__ import annotations

import pytest

from tests.helpers import copy_tiling


@pytest.fixture
def gpu_tiles():
    """Copy kernels launch with the GPU's tile geometry for the whole test."""
    with copy_tiling(True):
        yield

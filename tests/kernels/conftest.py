"""Fixtures of the kernel tests."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import copy_tiling


@pytest.fixture
def gpu_tiles():
    """Copy kernels launch with the GPU's tile geometry for the whole test."""
    with copy_tiling(True):
        yield


@pytest.fixture
def nan_filled_empty(monkeypatch):
    """``torch.empty`` hands out NaN-filled tensors for the whole test (integer ones -128, a code
    no symmetric int8 rounding makes), so a launcher's own outputs (which it allocates) cannot
    pass where its kernel left an element unwritten."""
    real_empty = torch.empty

    def empty(*args, **kwargs):
        tensor = real_empty(*args, **kwargs)
        return tensor.fill_(float("nan") if tensor.is_floating_point() else -128)

    monkeypatch.setattr(torch, "empty", empty)

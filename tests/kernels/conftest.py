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
    """``torch.empty`` hands out NaN-filled tensors for the whole test, so a launcher's own
    outputs (which it allocates) cannot pass where its kernel left an element unwritten."""
    real_empty = torch.empty

    def empty(*args, **kwargs):
        return real_empty(*args, **kwargs).fill_(float("nan"))

    monkeypatch.setattr(torch, "empty", empty)

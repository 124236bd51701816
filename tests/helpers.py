"""Plain helpers shared by test modules (fixtures live in conftest.py)."""

from __future__ import annotations

import torch

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")


def nan_like(t: torch.Tensor) -> torch.Tensor:
    """A fresh tensor shaped like ``t`` and filled with NaN, so unwritten outputs cannot pass."""
    return torch.full_like(t, float("nan"))

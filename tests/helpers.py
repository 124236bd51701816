"""Plain helpers shared by test modules (fixtures live in conftest.py)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

from paged_video.kernels import _copy_tiles

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")


def record_launches(monkeypatch: pytest.MonkeyPatch, module: object, name: str) -> list[dict]:
    """The keyword arguments (constexprs, warps, stages) of every ``kernel[grid](...)`` launch
    of the Triton kernel ``module.name``, recorded; each launch still runs."""
    launches: list[dict] = []
    real_kernel = getattr(module, name)

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append(kwargs)
                return real_kernel[grid](*args, **kwargs)

            return launch

    monkeypatch.setattr(module, name, Spy())
    return launches


def nan_like(t: torch.Tensor) -> torch.Tensor:
    """A fresh tensor shaped like ``t`` and filled with NaN, so unwritten outputs cannot pass."""
    return torch.full_like(t, float("nan"))


@contextlib.contextmanager
def copy_tiling(gpu: bool) -> Iterator[None]:
    """With ``gpu``, the copy kernels launch with the GPU's tile geometry (small tiles, column
    chunks) even when interpreted; otherwise with this machine's."""
    with pytest.MonkeyPatch.context() as patch:
        if gpu:
            patch.setattr(_copy_tiles, "interpreter_active", lambda: False)
        yield

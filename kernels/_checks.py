"""Argument validation shared by the launchers: every error names the argument at fault."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import Tensor

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)
MAX_HEAD_DIM = 256


def check_tensor(name: str, value: object) -> Tensor:
    if not isinstance(value, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def check_rank(name: str, tensor: Tensor, rank: int, layout: str) -> None:
    check_tensor(name, tensor)
    if tensor.dim() != rank:
        raise ValueError(f"{name} must have rank {rank} {layout}, got shape {tuple(tensor.shape)}")


def check_dtype(name: str, tensor: Tensor, allowed: Iterable[torch.dtype]) -> None:
    allowed = tuple(allowed)
    if tensor.dtype not in allowed:
        names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
        raise TypeError(f"{name} must have dtype {names}, got {tensor.dtype}")


def check_same_device(**tensors: Tensor | None) -> torch.device:
    present = {name: t for name, t in tensors.items() if t is not None}
    devices = {t.device for t in present.values()}
    if len(devices) > 1:
        listing = ", ".join(f"{name} on {t.device}" for name, t in present.items())
        raise ValueError(f"all tensors must be on one device, got {listing}")
    return next(iter(devices))


def check_head_dim(name: str, head_dim: int) -> None:
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"{name} has head_dim {head_dim}; supported is 1..{MAX_HEAD_DIM}")


def check_int(name: str, value: object, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def check_softmax_scale(value: object) -> None:
    """``None`` or a finite real number; a string or NaN would fail deep in the launch."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"softmax_scale must be a float or None, got {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"softmax_scale must be finite, got {value}")


def contiguous_index(tensor: Tensor | None) -> Tensor | None:
    """An index tensor the kernels can read as ``ptr + i``: a strided view (a column of a 2-D
    tensor, a slice with a step) is copied, a contiguous one returned as is (no copy)."""
    return None if tensor is None else tensor.contiguous()

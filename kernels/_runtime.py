"""Where the kernels run: on a GPU, or under Triton's interpreter on a CPU.

Triton reads ``TRITON_INTERPRET`` when a kernel is *decorated*, so this module is imported by
``kernels/__init__.py`` before any kernel module.
"""

from __future__ import annotations

import os

import torch


def _gpu_visible() -> bool:
    return torch.cuda.is_available()


def enable_interpreter_if_no_gpu() -> None:
    """Switch the interpreter on when no GPU is visible and the user has not chosen."""
    if "TRITON_INTERPRET" not in os.environ and not _gpu_visible():
        os.environ["TRITON_INTERPRET"] = "1"


def interpreter_active() -> bool:
    """True when Triton kernels run under the interpreter (numpy on the CPU)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_torch_path(tensor: torch.Tensor) -> bool:
    """True for CPU tensors when Triton cannot run them (no interpreter): use plain PyTorch."""
    return tensor.device.type == "cpu" and not interpreter_active()

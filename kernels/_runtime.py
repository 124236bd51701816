"""Where the kernels run: on a GPU, under Triton's interpreter, or as plain PyTorch on a CPU.

Triton (3.9) reads ``TRITON_INTERPRET`` when it is first imported (its own library functions are
decorated then) and again when each kernel is decorated, so this module is imported by
``kernels/__init__.py`` before any kernel module, and the interpreter can only be switched on
here if nothing imported triton before (``torch._dynamo`` does). Otherwise a CPU gets the
plain-PyTorch path.
"""

from __future__ import annotations

import os
import sys

import torch


def _gpu_visible() -> bool:
    return torch.cuda.is_available()


def enable_interpreter_if_no_gpu() -> None:
    """Switch the interpreter on when no GPU is visible and the user has not chosen.

    Too late once triton is imported: setting the variable then would interpret our kernels
    but not triton's library functions they call, which fails.
    """
    if "TRITON_INTERPRET" not in os.environ and "triton" not in sys.modules and not _gpu_visible():
        os.environ["TRITON_INTERPRET"] = "1"


def interpreter_active() -> bool:
    """True when Triton kernels run under the interpreter (numpy on the CPU)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_torch_path(tensor: torch.Tensor) -> bool:
    """True for CPU tensors when Triton cannot run them (no interpreter): use plain PyTorch."""
    return tensor.device.type == "cpu" and not interpreter_active()

"""Where the kernels run: on a GPU, under Triton's interpreter, or as plain PyTorch on a CPU.

Triton (3.9) reads ``TRITON_INTERPRET`` when it is first imported (its own library functions are
decorated then) and again when each kernel is decorated, so this module is imported by
``kernels/__init__.py`` before any kernel module, and the interpreter can only be switched on
here if nothing imported triton before (``torch._dynamo`` does). Otherwise a CPU gets the
plain-PyTorch path, and the first launch that takes it says so once (``backend()`` tells any
time which path a device gets).
"""

from __future__ import annotations

import os
import sys
import warnings

import torch

# Set when the interpreter was wanted (no GPU, the variable unset) but triton was imported first.
_interpreter_too_late = False
_warned = False


def _gpu_visible() -> bool:
    return torch.cuda.is_available()


def enable_interpreter_if_no_gpu() -> None:
    """Switch the interpreter on when no GPU is visible and the user has not chosen.

    Too late once triton is imported: setting the variable then would interpret our kernels
    but not triton's library functions they call, which fails. That case is remembered, so the
    plain-PyTorch path it leads to is announced once.
    """
    global _interpreter_too_late
    if "TRITON_INTERPRET" in os.environ or _gpu_visible():
        return
    if "triton" in sys.modules:
        _interpreter_too_late = True
    else:
        os.environ["TRITON_INTERPRET"] = "1"


def interpreter_active() -> bool:
    """True when Triton kernels run under the interpreter (numpy on the CPU)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def backend(device: torch.device | str = "cpu") -> str:
    """Which path the kernels take for tensors on ``device``: ``"triton"`` (compiled Triton on
    a GPU), ``"interpreter"`` (Triton's interpreter, ``TRITON_INTERPRET=1``) or ``"torch"`` (the
    plain-PyTorch path of ``kernels/torch_path.py``, for a CPU without the interpreter)."""
    if interpreter_active():
        return "interpreter"
    return "torch" if torch.device(device).type == "cpu" else "triton"


def use_torch_path(tensor: torch.Tensor) -> bool:
    """True for CPU tensors when Triton cannot run them (no interpreter): use plain PyTorch."""
    if tensor.device.type != "cpu" or interpreter_active():
        return False
    _warn_once_if_unintended()
    return True


def _warn_once_if_unintended() -> None:
    global _warned
    if _interpreter_too_late and not _warned:
        _warned = True
        warnings.warn(
            "paged_video.kernels: triton was imported before paged_video.kernels, too late to "
            "switch Triton's interpreter on, so CPU tensors run the plain-PyTorch path "
            "(kernels/torch_path.py), not the Triton kernels. Import paged_video.kernels "
            "first or export TRITON_INTERPRET=1 to run them under the interpreter; "
            "TRITON_INTERPRET=0 chooses the PyTorch path without this warning.",
            RuntimeWarning,
            stacklevel=4,
        )

"""A CPU stand-in for a GPU's device mismatch: tensors the library makes without a device land
on another device ("meta"), while the tests' own tensors stay on the CPU.

On a GPU every tensor made without ``device=`` is a CPU tensor beside the CUDA data, and fails
only there. Here, under ``library_tensors_on("meta")``, each factory call (``torch.zeros``,
``torch.tensor``, ``torch.arange``, ...) without a device whose nearest caller outside torch is
library code (``paged_video``) makes a meta tensor instead, which collides with the CPU data as
the CPU tensor would with CUDA's (the tests' data keep relying on the CPU default, as on a GPU
run they are moved with ``.to(DEVICE)``). Opt in for a whole run with
``python -m pytest --library-device=meta``; a focused test wraps the call it checks.
"""

from __future__ import annotations

import contextlib
import functools
import linecache
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors

REPO = Path(__file__).resolve().parents[1]
LIBRARY = tuple(
    str(REPO / name) + os.sep
    for name in ("bench", "integrations", "kernels", "models", "paging", "reference")
)
TORCH = str(Path(torch.__file__).resolve().parent) + os.sep
COMPREHENSIONS = ("<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>")

# Tensors the library makes on the CPU on purpose: ``(path in the repository, function, text of
# the line)``, an empty text naming every line of the function. They stay on the CPU here, as they
# do beside CUDA data. (A call given a CPU ``generator=`` stays on the CPU too: it is drawn there
# on purpose, so that a seed gives the same numbers on any device.)
INTENDED_CPU: frozenset[tuple[str, str, str]] = frozenset(
    {
        ("bench/accuracy.py", "make_data", ""),  # drawn on the CPU, then moved
        ("bench/accuracy.py", "_attend_eight_bit", '"v_scale_chosen": torch.tensor('),
        ("bench/accuracy.py", "_attend_eight_bit", '"equalizers_chosen": torch.tensor('),
        ("bench/accuracy.py", "attend", '"equalizers_chosen": torch.tensor('),
        ("bench/providers.py", "eight_bit_pools", '"v_scale_chosen": torch.tensor('),
        ("bench/sweep.py", "bytes_moved", ".element_size()"),  # read for its size
        # Host flags and 0-dim scalars the fused op reads without a device sync (CPU_FLAGS,
        # stage tags, LayerInputs' layer, stage_from and stage_key).
        ("kernels/fused.py", "empty", ""),
        ("paging/cache.py", "_allocate", "_chosen = torch.zeros("),
        ("paging/cache.py", "_allocate", "self.stage_tags = torch.full("),
        ("paging/staging.py", "__init__", "self.tags = torch.full("),
        ("paging/forward.py", "__init__", "self._keep_from = torch.tensor("),
        ("paging/forward.py", "__init__", "self._stage_key = torch.tensor("),
        ("paging/forward.py", "__init__", "self._layers = [torch.tensor("),
        ("models/wan_paged.py", "__init__", "self.layer_index = torch.tensor("),
        ("models/wan_paged.py", "_read", "torch.arange("),  # the host's record of what was read
        # Indices: a CPU index tensor indexes a CUDA tensor (torch moves it).
        ("reference/wan_rollout.py", "__init__", "self.read: Tensor = torch.empty("),
        ("reference/wan_rollout.py", "reference_rollout", "history.read = torch.tensor("),
        ("kernels/torch_path.py", "paged_attention", ""),  # runs CPU tensors only
        ("reference/quantized_attention.py", "paged_quantized_attention", ""),  # on the CPU
        # The compile report's launch arguments: never run, compiled from their dtypes alone.
        ("bench/compile_report.py", "_paged_launches", ""),
        ("bench/compile_report.py", "_anchor_launch", ""),
        ("bench/compile_report.py", "_tutorial_launch", ""),
        ("bench/compile_report.py", "_launches", ""),
        ("bench/compile_report.py", "<lambda>", "torch.empty("),
        # A forward's plan, built on the host and moved by one copy (paging/transfer.py).
        ("paging/plan.py", "_build", ""),
        ("paging/shard.py", "project", ""),
        ("paging/shard.py", "local_keys", ""),
        ("paging/shard.py", "local_slots", ""),
        ("paging/shard.py", "local_inputs", ""),
        ("paging/shard.py", "__init__", "self._local_stage_from = "),
        ("paging/transfer.py", "pack", "torch.empty("),
        ("reference/quantize.py", "quantize_best_scale", "torch.linspace("),  # read as floats
    }
)


def intended_cpu(path: str, function: str, line: int) -> bool:
    """Whether the call at ``path:line`` (in ``function``) is listed in ``INTENDED_CPU``."""
    text = linecache.getline(str(REPO / path), line)
    return any((path, function) == entry[:2] and entry[2] in text for entry in INTENDED_CPU)


@functools.cache
def _origin(filename: str) -> str:
    """``"torch"``, ``"wrapper"`` (a tests' conftest fixture standing in for a torch function),
    the library file's repository path, or ``""`` (a test, Triton, anything else)."""
    path = os.path.realpath(filename)
    if path.startswith(TORCH) or path == os.path.realpath(__file__):
        return "torch"
    if path.startswith(str(REPO / "tests") + os.sep) and path.endswith("conftest.py"):
        return "wrapper"
    if path.startswith(LIBRARY):
        return Path(path).relative_to(REPO).as_posix()
    return ""


def library_caller(frame: FrameType | None) -> tuple[str, str, int] | None:
    """The library file, function and line of the nearest caller outside torch (and the tests'
    fixture wrappers), or None when that caller is not the library's."""
    while frame is not None:
        origin = _origin(frame.f_code.co_filename)
        if origin not in ("torch", "wrapper"):
            if not origin:
                return None
            function = frame.f_code.co_name
            if function in COMPREHENSIONS and frame.f_back is not None:
                function = frame.f_back.f_code.co_name  # their own frames before Python 3.12
            return origin, function, frame.f_lineno
        frame = frame.f_back
    return None


class LibraryDevice(TorchFunctionMode):
    """Factory calls without a device made by the library go to ``device``."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device
        self.moved: set[tuple[str, str, int]] = set()  # the call sites sent to ``device``

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _device_constructors() and kwargs.get("device") is None:
            generator = kwargs.get("generator")
            cpu_drawn = generator is not None and generator.device.type == "cpu"
            caller = None if cpu_drawn else library_caller(sys._getframe(1))
            if caller is not None and not intended_cpu(*caller):
                kwargs["device"] = self.device
                self.moved.add(caller)
        return func(*args, **kwargs)


@contextlib.contextmanager
def library_tensors_on(device: str | torch.device = "meta") -> Iterator[LibraryDevice]:
    """Within the block, tensors the library makes without a device are made on ``device``
    (the mode yielded records where)."""
    with LibraryDevice(torch.device(device)) as mode:
        yield mode

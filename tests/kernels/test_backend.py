"""``kernels.backend()`` names the path the kernels take, and taking the PyTorch path on a CPU
because triton was imported first is announced once."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from paged_video import kernels
from paged_video.kernels import _runtime

REPO = Path(__file__).resolve().parents[2]


def test_backend_follows_the_interpreter_switch_and_the_device(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert kernels.backend("cpu") == "interpreter"
    assert kernels.backend(torch.device("cuda")) == "interpreter"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert kernels.backend("cpu") == "torch"
    assert kernels.backend(torch.device("cpu")) == "torch"
    assert kernels.backend("cuda") == "triton"
    monkeypatch.delenv("TRITON_INTERPRET")
    assert kernels.backend("cpu") == "torch"


def test_the_pytorch_path_taken_because_triton_came_first_warns_once(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(_runtime, "_interpreter_too_late", True)
    monkeypatch.setattr(_runtime, "_warned", False)
    cpu = torch.zeros(1)
    with pytest.warns(RuntimeWarning, match="triton was imported before paged_video.kernels"):
        assert _runtime.use_torch_path(cpu)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _runtime.use_torch_path(cpu)  # once only


def test_choosing_the_pytorch_path_or_a_gpu_does_not_warn(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(_runtime, "_interpreter_too_late", False)
    monkeypatch.setattr(_runtime, "_warned", False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _runtime.use_torch_path(torch.zeros(1))
        assert not _runtime.use_torch_path(torch.zeros(1, device="meta"))


SCRIPT = """
import warnings
{first}
from paged_video import kernels
import torch

warnings.simplefilter("default")
key = torch.randn(3, 1, 4)
pool = torch.zeros(8, 1, 4)
for _ in range(2):
    kernels.write_slots(key, key, pool, pool.clone(), torch.tensor([1, 2, 3]))
print(kernels.backend("cpu"))
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU paths only")
@pytest.mark.parametrize(
    ("first", "backend", "warned"),
    [("import triton", "torch", True), ("", "interpreter", False)],
    ids=["triton-imported-first", "kernels-first"],
)
def test_import_order_picks_the_path_and_says_so(first, backend, warned):
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(REPO)
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(first=first)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == [backend]
    assert done.stderr.count("triton was imported before paged_video.kernels") == int(warned)

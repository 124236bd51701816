"""Shared test set-up: the Triton interpreter on CPU machines, hypothesis profiles, NaN fixtures.

The interpreter must be switched on before any ``@triton.jit`` function is decorated, so this
runs before the test modules import ``kernels``.

Thread counts are pinned to one per process (unless set in the environment): under the
interpreter every kernel is many small numpy ops, and with ``pytest -n 2`` on two cores the
OpenMP/OpenBLAS pools of both workers fight over the cores, spinning while they wait. The
variables must be set before numpy or torch is imported (nothing imports them before this).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
from hypothesis import HealthCheck, settings

from tests.helpers import DEVICE, nan_like

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# `ci` is what CI runs (`--hypothesis-profile=ci`): more examples, no deadline, reproducible.
settings.register_profile(
    "ci",
    max_examples=60,
    deadline=None,
    derandomize=True,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
# The default is quick, for iterating locally.
settings.register_profile(
    "dev",
    max_examples=10,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))


@pytest.fixture
def device() -> torch.device:
    return DEVICE


@pytest.fixture
def nan_out():
    """Factory fixture: ``nan_out(t)`` returns a NaN-filled tensor shaped like ``t``."""
    return nan_like

"""A pytest plugin that runs a test suite with the backend installed.

``pytest -p paged_video.integrations.vllm_omni.pytest_plugin ...``

For vllm-omni's own tests: ``install()`` runs before any test module is imported (so every
binding they import is the backend's) and ``uninstall()`` after the session.
``--paged-video-perturb=EPS`` adds EPS to every attention output and staged row this backend
produces: a suite that still passes with it cannot tell this backend from a broken one.
"""

from __future__ import annotations

import pytest
import torch

from paged_video.integrations.vllm_omni import backend, install, uninstall
from paged_video.kernels._runtime import interpreter_active


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--paged-video-perturb",
        type=float,
        default=0.0,
        help="add this to every attention output and staged row of the paged_video backend",
    )


def _perturbed(function, eps: float, result_of):
    def perturbed(*args, **kwargs):
        result = function(*args, **kwargs)
        for tensor in result_of(result, args, kwargs):
            tensor.add_(eps)
        return result

    return perturbed


def pytest_configure(config: pytest.Config) -> None:
    install(propagate=False)
    eps = config.getoption("--paged-video-perturb")
    if eps:
        patch = pytest.MonkeyPatch()
        patch.setattr(
            backend,
            "paged_attention",
            _perturbed(backend.paged_attention, eps, lambda out, args, kwargs: (out,)),
        )
        # gather_blocks(k_cache, v_cache, block_ids, stage_k, stage_v, ...) fills the stages.
        patch.setattr(
            backend,
            "gather_blocks",
            _perturbed(backend.gather_blocks, eps, lambda out, args, kwargs: args[3:5]),
        )
        config.add_cleanup(patch.undo)
    config.add_cleanup(uninstall)


def pytest_report_header(config: pytest.Config) -> str:
    if torch.cuda.is_available():
        where = "Triton on the GPU"
    elif interpreter_active():
        where = "Triton's interpreter on the CPU"
    else:
        where = "the plain-PyTorch path on the CPU (TRITON_INTERPRET=0 or set too late)"
    eps = config.getoption("--paged-video-perturb")
    perturbed = f", outputs perturbed by {eps}" if eps else ""
    return f"paged_video backend installed for vllm-omni: kernels run on {where}{perturbed}"

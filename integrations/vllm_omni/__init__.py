"""vllm-omni's AR-Diffusion paged self-attention on this project's kernels.

One line in a launch script, before the engine starts::

    import paged_video.integrations.vllm_omni as pv; pv.install()

or, without touching the script, ``PAGED_VIDEO_VLLM_OMNI=1`` in the environment: vllm-omni loads
its ``vllm_omni.general_plugins`` entry points in every process it starts, and this package
registers ``install_from_env`` there. ``install()`` sets that variable too, so the worker
processes vllm-omni spawns follow the launch script.

The CPU seam, the two CUDA call forms and the history staging of vllm-omni 0.30.0 run on
``paged_attention`` and ``gather_blocks`` (``backend``); how and where is in ``patching``.
Any other vllm-omni is refused with a one-line ``UnsupportedVllmOmniError`` before anything is
patched. ``uninstall()`` puts every original object back; ``installed()`` is the context
manager.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from paged_video.integrations.vllm_omni.patching import (
    ENV_SWITCH,
    TESTED_SEAMS,
    UnsupportedVllmOmniError,
    install,
    is_installed,
    uninstall,
)

__all__ = [
    "ENV_SWITCH",
    "TESTED_SEAMS",
    "UnsupportedVllmOmniError",
    "install",
    "install_from_env",
    "installed",
    "is_installed",
    "uninstall",
]


@contextlib.contextmanager
def installed(*, propagate: bool = False) -> Iterator[None]:
    """Install for the ``with`` block; uninstall after it unless it was installed before."""
    already = is_installed()
    install(propagate=propagate)
    try:
        yield
    finally:
        if not already:
            uninstall()


def install_from_env() -> None:
    """The ``vllm_omni.general_plugins`` entry point: install when ``PAGED_VIDEO_VLLM_OMNI=1``."""
    value = os.environ.get(ENV_SWITCH, "")
    if value in ("", "0"):
        return
    if value != "1":
        raise ValueError(f"{ENV_SWITCH} must be 1 (install) or 0 (do not), got {value!r}")
    install(propagate=False)

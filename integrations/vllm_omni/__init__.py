"""vllm-omni's AR-Diffusion paged self-attention on this project's kernels.

One line in a launch script, before the engine starts::

    import paged_video.integrations.vllm_omni as pv; pv.install()

or, without touching the script, ``PAGED_VIDEO_VLLM_OMNI=1`` in the environment: vllm-omni loads
its ``vllm_omni.general_plugins`` entry points in every process it starts (engines, stages,
workers), and this package registers ``install_from_env`` there; with the variable unset it
imports nothing past this module. ``install()`` sets that variable too, so the worker processes
vllm-omni spawns follow the launch script. A process where vllm-omni's plugin loader does not
run (a bare test process calling vllm-omni's functions) needs the ``install()`` line.

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
from typing import TYPE_CHECKING

# Read by the entry point vllm-omni calls in every process it starts (engines, stages, workers):
# this module imports nothing else of the project until the switch says to install, and
# ``install()`` sets it to "1" so that the worker processes install too.
ENV_SWITCH = "PAGED_VIDEO_VLLM_OMNI"

if TYPE_CHECKING:
    from paged_video.integrations.vllm_omni.patching import (
        TESTED_SEAMS,
        UnsupportedVllmOmniError,
        install,
        is_installed,
        uninstall,
    )

# Imported from ``patching`` (which loads torch and the kernels) on first use.
_FROM_PATCHING = frozenset(
    {"TESTED_SEAMS", "UnsupportedVllmOmniError", "install", "is_installed", "uninstall"}
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


def __getattr__(name: str) -> object:
    if name in _FROM_PATCHING:
        from paged_video.integrations.vllm_omni import patching

        return getattr(patching, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | _FROM_PATCHING)


@contextlib.contextmanager
def installed(*, propagate: bool = False) -> Iterator[None]:
    """Install for the ``with`` block; uninstall after it unless it was installed before."""
    from paged_video.integrations.vllm_omni import patching

    already = patching.is_installed()
    patching.install(propagate=propagate)
    try:
        yield
    finally:
        if not already:
            patching.uninstall()


def install_from_env() -> None:
    """The ``vllm_omni.general_plugins`` entry point: install when ``PAGED_VIDEO_VLLM_OMNI=1``;
    otherwise return having imported nothing more of this project."""
    value = os.environ.get(ENV_SWITCH, "")
    if value in ("", "0"):
        return
    if value != "1":
        raise ValueError(f"{ENV_SWITCH} must be 1 (install) or 0 (do not), got {value!r}")
    from paged_video.integrations.vllm_omni import patching

    patching.install(propagate=False)

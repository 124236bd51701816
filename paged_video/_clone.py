"""A clone's top folders imported by their bare names (``kernels``, ``paging``, ...).

Running from a clone puts its root on ``sys.path`` (``python -m``, pytest), so ``import kernels``
would find the clone's ``kernels/`` folder before Hugging Face's ``kernels`` package, which
vllm-omni, transformers and diffusers import. The folders are ``paged_video``'s subpackages;
imported by a bare name, they hand that name to whichever package owns it outside the clone.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
from pathlib import Path


def hand_over(name: str, init_file: str) -> None:
    """Load the package named ``name`` from outside this clone into ``sys.modules[name]``.

    Called by a top folder's ``__init__`` when it is imported as ``name``; the import system
    returns what ``sys.modules[name]`` holds once that ``__init__`` has run. Raises
    ``ModuleNotFoundError`` when nothing outside the clone has that name.
    """
    clone = Path(init_file).resolve().parent.parent
    outside = [entry for entry in sys.path if Path(entry or ".").resolve() != clone]
    spec = None
    for finder in sys.meta_path:
        if finder is importlib.machinery.PathFinder:
            spec = finder.find_spec(name, outside)
        elif hasattr(finder, "find_spec"):
            spec = finder.find_spec(name, None)
        if spec is not None and spec.origin != init_file:
            break
        spec = None
    if spec is None or spec.loader is None:
        raise ModuleNotFoundError(
            f"No module named {name!r} (this clone's {name}/ folder is paged_video.{name})",
            name=name,
        )
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)

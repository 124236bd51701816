"""The bench's optional packages, imported where they are used: a plain ``pip install`` runs
every subcommand but the plots (matplotlib) and the progress bar (tqdm), both in the ``bench``
extra, and a missing one is one line naming that extra, never a traceback at import."""

from __future__ import annotations

import importlib
from types import ModuleType

EXTRA = "bench"
INSTALL = f"pip install 'paged-video-attention[{EXTRA}]'"


class MissingExtraError(ImportError):
    """An optional package the asked-for output needs is not installed."""


def require(module: str, needed_for: str) -> ModuleType:
    """Import ``module`` (e.g. ``"matplotlib.figure"``), or raise ``MissingExtraError`` in one
    line saying what needs it and which extra installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        package = module.partition(".")[0]
        raise MissingExtraError(
            f"{needed_for} need {package}, which is not installed ({error.name or package}): "
            f"{INSTALL}"
        ) from error

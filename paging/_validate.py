"""Argument checks shared by the paging entry points: every error names the argument at fault."""

from __future__ import annotations


def require_int(name: str, value: object, *, minimum: int, maximum: int | None = None) -> int:
    """``value`` as an int in ``minimum..maximum``; else ``TypeError``/``ValueError`` naming
    ``name`` and the accepted range."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if maximum is None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and not minimum <= value <= maximum:
        raise ValueError(f"{name} must be in {minimum}..{maximum}, got {value}")
    return value


def require_bool(name: str, value: object) -> bool:
    """``value`` as a bool; ``TypeError`` naming ``name`` otherwise."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value

"""The paging modules import one another without circles, counting every import statement:
module level, inside functions and under ``if TYPE_CHECKING:`` alike (read from the source with
``ast``, so an import that only a type checker or a late call runs still counts)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "paged_video.paging"


def sources(folder: Path) -> dict[str, str]:
    """``{module name: source}`` of every module in ``folder`` (``__init__`` included)."""
    return {path.stem: path.read_text() for path in sorted(folder.glob("*.py"))}


def import_graph(modules: dict[str, str], package: str = PACKAGE) -> dict[str, set[str]]:
    """``{module: modules of the package it imports}``.

    ``from <package> import name`` is an edge to the submodule ``name`` when there is one, else
    to ``__init__`` (a name the package re-exports); relative imports resolve the same way.
    """
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, source in modules.items():
        for node in ast.walk(ast.parse(source)):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = package if node.level else (node.module or "")
                if node.level and node.module:
                    base = f"{package}.{node.module}"
                if base == package:
                    targets = [f"{package}.{alias.name}" for alias in node.names]
                else:
                    targets = [base]
            for target in targets:
                if target == package:
                    graph[name].add("__init__")
                elif target.startswith(package + "."):
                    module = target[len(package) + 1 :].split(".")[0]
                    graph[name].add(module if module in modules else "__init__")
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` as ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for child in sorted(graph.get(node, ())):
            if state.get(child) == 1:
                return [*path[path.index(child) :], child]
            if child not in state and (cycle := visit(child)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_paging_has_no_import_circles() -> None:
    graph = import_graph(sources(ROOT / "paging"))
    assert {"cache", "plan", "session", "config", "window"} <= set(graph)
    assert "__init__" not in set().union(*graph.values()), "a module imports the package facade"
    cycle = find_cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_the_kernels_never_import_paging() -> None:
    # paging.forward and the cache import kernels; an import back would close a circle.
    for path in sorted((ROOT / "kernels").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            assert not any(n.startswith(PACKAGE) for n in names), f"{path.name} imports paging"


@pytest.mark.parametrize(
    ("modules", "cycle"),
    [
        (  # a circle through an import only a type checker runs
            {
                "a": "from paged_video.paging.b import B",
                "b": "from typing import TYPE_CHECKING\n"
                "if TYPE_CHECKING:\n    from paged_video.paging.a import A",
            },
            ["a", "b", "a"],
        ),
        (  # through an import inside a function, by submodule name
            {
                "config": "def check():\n    from paged_video.paging import window",
                "window": "from paged_video.paging.config import PagingConfig",
            },
            ["config", "window", "config"],
        ),
        (  # through the package facade and a relative import
            {"__init__": "from .cache import Cache", "cache": "from . import NULL_BLOCK"},
            ["__init__", "cache", "__init__"],
        ),
        ({"a": "import paged_video.paging.b", "b": "import torch"}, None),
    ],
)
def test_the_checker_sees_every_kind_of_import(modules: dict[str, str], cycle) -> None:
    assert find_cycle(import_graph(modules)) == cycle

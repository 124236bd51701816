"""The mutant list of ``tests/mutation.py`` stays runnable: each snippet is found exactly once,
each mutated file compiles, and each named test function exists (cheap: nothing is run)."""

from __future__ import annotations

import ast

from tests.mutation import MUTANTS, ROOT, check_mutants


def test_every_mutant_applies_and_names_existing_tests() -> None:
    check_mutants(MUTANTS, ROOT)
    assert len(MUTANTS) >= 40
    functions: dict[str, set[str]] = {}
    for mutant in MUTANTS:
        assert mutant.tests, f"{mutant.name} names no test"
        for test in mutant.tests:
            path, _, name = test.partition("::")
            if path not in functions:
                tree = ast.parse((ROOT / path).read_text())
                functions[path] = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
            assert not name or name.split("[")[0] in functions[path], f"{mutant.name}: {test}"

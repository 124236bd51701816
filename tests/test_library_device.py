"""The meta-default harness (tests/library_device.py) moves exactly the library's tensors made
without a device, so a CPU run can show the CPU tensors a GPU run would put beside CUDA data."""

from __future__ import annotations

import ast

import torch

from tests.library_device import INTENDED_CPU, REPO, library_tensors_on


def compiled_as(path: str, name: str, expression: str):
    """A function ``name`` returning ``expression``, its code marked as the repository file
    ``path`` (its return on line 2)."""
    scope = {"torch": torch}
    source = f"def {name}():\n    return {expression}\n"
    exec(compile(source, str(REPO / path), "exec"), scope)
    return scope[name]


def test_library_tensors_without_a_device_go_to_meta_and_the_tests_stay_on_the_cpu() -> None:
    implicit = compiled_as("reference/made_up.py", "f", "torch.zeros(2)")
    explicit = compiled_as("paging/made_up.py", "f", "torch.ones(2, device='cpu')")
    intended = compiled_as("kernels/fused.py", "empty", "torch.empty(0)")
    elsewhere = compiled_as("tests/made_up.py", "f", "torch.arange(3)")
    with library_tensors_on("meta") as mode:
        assert implicit().device.type == "meta"
        assert explicit().device.type == "cpu"
        assert intended().device.type == "cpu"  # listed in INTENDED_CPU
        assert elsewhere().device.type == "cpu"
        assert torch.tensor([1.0]).device.type == "cpu"
    assert mode.moved == {("reference/made_up.py", "f", 2)}
    assert implicit().device.type == "cpu"


def test_every_intended_cpu_entry_names_a_call_in_its_function() -> None:
    # An entry whose function or line moved would silently stop listing anything.
    wanted = {entry[:2] for entry in INTENDED_CPU}
    bodies: dict[tuple[str, str], list[str]] = {}
    for path in {entry[0] for entry in INTENDED_CPU}:
        source = (REPO / path).read_text()
        lines = source.splitlines()
        for node in ast.walk(ast.parse(source)):
            name = getattr(node, "name", "<lambda>")
            if isinstance(node, ast.FunctionDef | ast.Lambda) and (path, name) in wanted:
                body = "\n".join(lines[node.lineno - 1 : node.end_lineno])
                bodies.setdefault((path, name), []).append(body)
    for path, function, text in INTENDED_CPU:
        assert any(text in body for body in bodies.get((path, function), [])), (path, function)

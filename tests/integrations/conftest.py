"""The stand-in vllm-omni seam (``standin_paged_attention.py``) in ``sys.modules`` for a test."""

from __future__ import annotations

import importlib.util
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from paged_video.integrations.vllm_omni import patching, uninstall

MODEL_MODULE = "vllm_omni.diffusion.models.lingbot_world.transformer"


@dataclass
class StandIn:
    """The fake modules: the seam, the ``kv_cache`` package and a model module that imported
    the entry point by name, and ``vllm.vllm_flash_attn`` whose calls are recorded."""

    module: types.ModuleType
    package: types.ModuleType
    model: types.ModuleType
    flash_attn: types.ModuleType
    originals: dict[str, object]
    flash_attn_calls: list[dict] = field(default_factory=list)


def load_standin(monkeypatch: pytest.MonkeyPatch, version: str = "0.30.0") -> StandIn:
    path = Path(__file__).with_name("standin_paged_attention.py")
    spec = importlib.util.spec_from_file_location(patching.SEAM_MODULE, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    entry = module.ar_diffusion_paged_attention
    root = types.ModuleType("vllm_omni")
    root.__version__ = version
    package = types.ModuleType("vllm_omni.experimental.ar_diffusion.kv_cache")
    package.ar_diffusion_paged_attention = entry
    package.paged_attention = module
    model = types.ModuleType(MODEL_MODULE)
    model.ar_diffusion_paged_attention = entry
    flash_attn = types.ModuleType("vllm.vllm_flash_attn")
    standin = StandIn(
        module=module,
        package=package,
        model=model,
        flash_attn=flash_attn,
        originals={name: getattr(module, name) for name in patching.EXPECTED_PARAMETERS},
    )

    def flash_attn_varlen_func(**kwargs):
        standin.flash_attn_calls.append(kwargs)
        return kwargs["out"]

    flash_attn.flash_attn_varlen_func = flash_attn_varlen_func
    for name, fake in {
        "vllm_omni": root,
        package.__name__: package,
        patching.SEAM_MODULE: module,
        MODEL_MODULE: model,
        "vllm": types.ModuleType("vllm"),
        flash_attn.__name__: flash_attn,
    }.items():
        monkeypatch.setitem(sys.modules, name, fake)
    # The stand-in is the tested seam of its version for the length of the test.
    monkeypatch.setitem(patching.TESTED_SEAMS, version, patching.seam_fingerprint(module))
    return standin


@pytest.fixture
def standin(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv(patching.ENV_SWITCH, raising=False)
    yield load_standin(monkeypatch)
    uninstall()  # before monkeypatch puts sys.modules back

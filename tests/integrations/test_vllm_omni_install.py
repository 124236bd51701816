"""install / uninstall / installed() / the env switch, and every refusal, on the stand-in seam."""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch

from paged_video.integrations import vllm_omni
from paged_video.integrations.vllm_omni import (
    ENV_SWITCH,
    UnsupportedVllmOmniError,
    install,
    install_from_env,
    installed,
    is_installed,
    patching,
    uninstall,
)

ENTRY, CPU_SEAM, STAGING_SEAM = patching.ENTRY, patching.CPU_SEAM, patching.STAGING_SEAM
REPO = Path(__file__).resolve().parents[2]


def bindings(standin) -> dict[str, object]:
    """Every object install() may replace, by where it is bound."""
    return {
        "module.entry": standin.module.ar_diffusion_paged_attention,
        "package.entry": standin.package.ar_diffusion_paged_attention,
        "model.entry": standin.model.ar_diffusion_paged_attention,
        "module.cpu_seam": getattr(standin.module, CPU_SEAM, None),
        "module.staging": getattr(standin.module, STAGING_SEAM, None),
        "flash_attn": standin.flash_attn.flash_attn_varlen_func,
    }


def test_install_replaces_every_binding_and_uninstall_restores_each(standin, monkeypatch):
    before = bindings(standin)
    install()
    after = bindings(standin)
    assert after["flash_attn"] is before["flash_attn"]  # vLLM's function is never touched
    replaced = {name for name in before if after[name] is not before[name]}
    assert replaced == set(before) - {"flash_attn"}
    entry = after["module.entry"]
    assert after["package.entry"] is entry and after["model.entry"] is entry
    # A module imported after install() binds the replacement; uninstall() finds it too.
    late = types.ModuleType("late_model")
    late.attention = standin.module.ar_diffusion_paged_attention
    monkeypatch.setitem(sys.modules, "late_model", late)
    uninstall()
    assert bindings(standin) == before
    assert all(bindings(standin)[name] is before[name] for name in before)
    assert late.attention is standin.originals[ENTRY]
    assert not is_installed()


def test_install_is_idempotent_and_installed_restores_only_what_it_installed(standin):
    with installed():
        replacement = standin.module.ar_diffusion_paged_attention
        install()
        assert standin.module.ar_diffusion_paged_attention is replacement
    assert standin.module.ar_diffusion_paged_attention is standin.originals[ENTRY]
    install()
    with installed():
        pass
    assert is_installed()  # it was installed before the block


@pytest.mark.parametrize("before", [None, "0"])
def test_install_propagates_the_env_switch_and_uninstall_restores_it(standin, monkeypatch, before):
    if before is not None:
        monkeypatch.setenv(ENV_SWITCH, before)
    install()
    assert os.environ[ENV_SWITCH] == "1"  # vllm-omni's spawned workers install it too
    uninstall()
    assert os.environ.get(ENV_SWITCH) == before
    install(propagate=False)
    assert os.environ.get(ENV_SWITCH) == before


@pytest.mark.parametrize(("value", "installs"), [("", False), ("0", False), ("1", True)])
def test_install_from_env(standin, monkeypatch, value, installs):
    monkeypatch.setenv(ENV_SWITCH, value)
    install_from_env()
    assert is_installed() is installs


def test_install_from_env_refuses_other_values(standin, monkeypatch):
    monkeypatch.setenv(ENV_SWITCH, "yes")
    with pytest.raises(ValueError, match=ENV_SWITCH):
        install_from_env()
    assert not is_installed()


def _same_signature_other_body(
    query, key_cache, value_cache, block_table, query_start_loc, seq_lens, softmax_scale, *, causal
):
    return query


def _no_source_function():
    namespace: dict = {}
    exec(  # compiled from a string: inspect.getsource cannot find its text
        "def f(query, key_cache, value_cache, block_table, query_start_loc, seq_lens,"
        " softmax_scale, *, causal):\n    return query\n",
        namespace,
    )
    return namespace["f"]


def _other_signature(query, key_cache, value_cache, block_table, query_start_loc, seq_lens, scale):
    return query


# breaker -> (what the refusal says, how the stand-in is broken)
BREAKERS = {
    "version": ("version is not among them", "__version__", "0.31.0"),
    "missing seam": ("_stage_window is missing", STAGING_SEAM, None),
    "missing switch": ("contiguous_kv_gather_enabled is missing", patching.GATHER_SWITCH, None),
    "missing fused op": ("_paged_write_attn_impl is missing", patching.FUSED_OP_IMPL, None),
    "signature": ("has the signature", CPU_SEAM, _other_signature),
    "source": ("source differs", CPU_SEAM, _same_signature_other_body),
    "no source": ("cannot be read", CPU_SEAM, _no_source_function()),
}


@pytest.mark.parametrize("breaker", BREAKERS)
def test_an_untested_seam_is_refused_and_nothing_is_patched(standin, monkeypatch, breaker):
    message, name, value = BREAKERS[breaker]
    if name == "__version__":
        monkeypatch.setattr(sys.modules["vllm_omni"], name, value)
    elif value is None:
        monkeypatch.delattr(standin.module, name)
    else:
        monkeypatch.setattr(standin.module, name, value)
    before = bindings(standin)
    with pytest.raises(UnsupportedVllmOmniError) as refusal:
        install()
    text = str(refusal.value)
    assert message in text and "\n" not in text
    assert "tested with vllm-omni 0.30.0" in text
    version = sys.modules["vllm_omni"].__version__
    assert f"this is vllm-omni {version}" in text
    assert all(bindings(standin)[name] is before[name] for name in before)
    assert not is_installed() and ENV_SWITCH not in os.environ


def test_the_shipped_fingerprint_is_vllm_omni_0_30_0s_not_the_stand_ins(standin, monkeypatch):
    """Without the stand-in's registration its source is not a tested seam."""
    monkeypatch.setitem(
        patching.TESTED_SEAMS, "0.30.0", vllm_omni.patching.TESTED_SEAMS["0.30.0"] + "x"
    )
    with pytest.raises(UnsupportedVllmOmniError, match="source differs"):
        install()


def test_uninstall_leaves_a_foreign_patch_and_says_so(standin):
    install()
    foreign = lambda *args, **kwargs: None
    standin.module._stage_window = foreign
    with pytest.raises(RuntimeError, match="_stage_window was replaced by someone else"):
        uninstall()
    assert standin.module._stage_window is foreign
    assert standin.module._reference_paged_attention is standin.originals[CPU_SEAM]
    assert standin.module.ar_diffusion_paged_attention is standin.originals[ENTRY]
    assert not is_installed()


def test_rocm_and_other_devices_keep_vllm_omnis_own_paths(monkeypatch):
    cuda_tensor = types.SimpleNamespace(is_cuda=True)
    monkeypatch.setattr(torch.version, "hip", None)
    assert patching._on_our_cuda_path(cuda_tensor)
    monkeypatch.setattr(torch.version, "hip", "6.4")
    assert not patching._on_our_cuda_path(cuda_tensor)
    calls = []
    seam = patching.make_cpu_seam(lambda *args, **kwargs: calls.append(args) or "vllm-omni's")
    xpu_query = types.SimpleNamespace(device=types.SimpleNamespace(type="xpu"))
    assert seam(xpu_query, None, None, None, None, None, 1.0, causal=False) == "vllm-omni's"
    assert len(calls) == 1


def _plugin_entry_point() -> importlib.metadata.EntryPoint:
    """This package's ``vllm_omni.general_plugins`` entry point, as pyproject.toml declares it."""
    pyproject = (REPO / "pyproject.toml").read_text()
    value = re.search(r'^paged_video = "(.+)"$', pyproject, re.M).group(1)
    return importlib.metadata.EntryPoint("paged_video", value, "vllm_omni.general_plugins")


# How vllm-omni's plugin loader runs the entry point (load it, call it), in a fresh process.
PLUGIN_LOADER = textwrap.dedent(
    """
    import importlib.metadata
    import sys

    name, value, group = sys.argv[1:4]
    importlib.metadata.EntryPoint(name, value, group).load()()
    print(sorted(name for name in sys.modules if name.startswith("paged_video")))
    print("torch" in sys.modules)
    """
)


def test_the_plugin_entry_point_imports_nothing_with_the_switch_unset(tmp_path):
    # vllm-omni runs its plugins in every process it starts: with the switch unset they must
    # not load the kernels (nor torch) there.
    entry_point = _plugin_entry_point()
    env = {k: v for k, v in os.environ.items() if k != ENV_SWITCH}
    env["PYTHONPATH"] = str(REPO)
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            PLUGIN_LOADER,
            entry_point.name,
            entry_point.value,
            entry_point.group,
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    needed = ["paged_video", "paged_video.integrations", "paged_video.integrations.vllm_omni"]
    assert result.stdout.splitlines() == [str(needed), "False"]


def test_the_plugin_entry_point_installs_with_the_switch_set(standin, monkeypatch):
    monkeypatch.setenv(ENV_SWITCH, "1")
    _plugin_entry_point().load()()
    entry = standin.module.ar_diffusion_paged_attention
    assert is_installed() and entry is not standin.originals[ENTRY]
    assert standin.package.ar_diffusion_paged_attention is entry

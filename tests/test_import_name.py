"""The installed name ``paged_video`` coexists with Hugging Face's ``kernels`` package.

vllm-omni and diffusers import Hugging Face's hub-kernel package by its name, ``kernels``. In a
fresh interpreter with a stand-in package of that name first on ``sys.path`` (and this clone
after it, as running from a clone puts it), ``import kernels`` must give the stand-in while
every subpackage of this project imports and runs.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

CHECK = textwrap.dedent(
    """
    import runpy
    import sys

    import kernels

    assert kernels.HUB_KERNELS_STANDIN and kernels.get_kernel("x") == "stand-in", kernels.__file__

    import torch

    import paged_video.bench
    import paged_video.integrations.vllm_omni
    import paged_video.models
    from paged_video import reference
    from paged_video.kernels import paged_attention
    from paged_video.paging import PagedKVCache, PagingConfig

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(3, 2, 16, generator=gen)
    k_cache, v_cache = torch.randn(2, 4, 7, 1, 16, generator=gen)
    args = (
        q, k_cache, v_cache, torch.tensor([[2, 0, 3]], dtype=torch.int32),
        torch.tensor([0, 3], dtype=torch.int32), torch.tensor([17], dtype=torch.int32),
    )
    got = paged_attention(*args, max_seqlen_q=3)
    want = reference.paged_attention(*args, max_seqlen_q=3)
    torch.testing.assert_close(got.double(), want.double(), atol=2e-5, rtol=0)

    cache = PagedKVCache(
        PagingConfig(block_size=4, chunk_size=8, window_chunks=2, sink_chunks=1),
        num_layers=1, num_kv_heads=1, head_dim=2,
    )
    inputs = cache.plan(cache.open_session(), "main", 8, commit=True).prepare()
    assert inputs.block_table.dtype == torch.int32 and int(inputs.seq_lens_k[0]) == 8

    sys.argv = ["paged_video.bench", "--help"]
    try:
        runpy.run_module("paged_video.bench", run_name="__main__", alter_sys=True)
    except SystemExit as done:
        assert done.code in (0, None), done.code

    assert sys.modules["kernels"] is kernels and not kernels.__name__.startswith("paged_video")
    print("coexists")
    """
)


def test_paged_video_runs_beside_a_package_named_kernels(tmp_path: Path) -> None:
    standin = tmp_path / "site" / "kernels"
    standin.mkdir(parents=True)
    (standin / "__init__.py").write_text(
        "HUB_KERNELS_STANDIN = True\n\n\ndef get_kernel(repo_id):\n    return 'stand-in'\n"
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(standin.parent), str(REPO)])
    env.pop("TRITON_INTERPRET", None)  # the fresh interpreter decides, as a user's would
    result = subprocess.run(
        [sys.executable, "-c", CHECK],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "usage" in result.stdout and result.stdout.rstrip().endswith("coexists")


CLONE_FIRST = textwrap.dedent(
    """
    import importlib
    import sys

    clone, site = sys.argv[1:3]
    sys.path[:0] = [clone] + ([site] if site else [])  # the clone first, as `python -m` puts it
    for name in ("kernels", "paging", "reference", "bench", "models", "integrations"):
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as error:
            print(name, "absent", error.name)
        else:
            print(name, "standin" if getattr(module, "STANDIN", False) else module.__file__)
    from paged_video.kernels import paged_attention  # still importable by its own name
    print("paged_video", paged_attention.__module__)
    """
)


def _import_bare_names(tmp_path: Path, site: Path | None) -> list[str]:
    result = subprocess.run(
        [sys.executable, "-c", CLONE_FIRST, str(REPO), str(site or "")],
        cwd=tmp_path,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.splitlines()


def test_a_clone_on_sys_path_hands_bare_names_to_the_packages_that_own_them(tmp_path: Path):
    # Running from a clone puts its root first on sys.path, before site-packages: its folders
    # must not shadow Hugging Face's `kernels` (or any other `models`, `bench`, ...).
    site = tmp_path / "site"
    for name in ("kernels", "models"):
        (site / name).mkdir(parents=True)
        (site / name / "__init__.py").write_text("STANDIN = True\n")
    lines = _import_bare_names(tmp_path, site)
    assert "kernels standin" in lines and "models standin" in lines
    assert {"paging absent paging", "reference absent reference"} <= set(lines)
    assert lines[-1] == "paged_video paged_video.kernels.paged_attention"


def test_a_bare_name_nobody_else_owns_is_not_found(tmp_path: Path):
    lines = _import_bare_names(tmp_path, None)
    assert lines[:6] == [
        f"{name} absent {name}"
        for name in ("kernels", "paging", "reference", "bench", "models", "integrations")
    ]


def test_each_top_folder_is_linked_under_the_import_name_and_installed():
    # Static tools (mypy, editors) and setuptools read `paged_video/<folder>`: a link to the
    # clone's top folder, one per package the wheel installs.
    import tomllib

    packages = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    tops = {name.split(".")[1] for name in packages["packages"] if name.count(".") >= 1}
    for name in tops:
        link = REPO / "paged_video" / name
        assert link.is_symlink() and os.readlink(link) == f"../{name}", name
        assert (link / "__init__.py").is_file(), name
    assert "package-dir" not in packages
    assert tops == {"kernels", "paging", "reference", "models", "bench", "integrations"}

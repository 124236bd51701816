"""The peers' providers (``sageattention``, ``flash-attn-4``): one skip line each where they
cannot run, and, on a CPU through stand-ins that compute what their documented calls compute,
the layouts and arguments our providers hand them checked against the float64 oracle."""

from __future__ import annotations

import importlib.machinery
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from paged_video.bench.providers import PROVIDERS, Provider
from paged_video.bench.sweep import Checked, _check_then_time, _Oracles
from paged_video.bench.workload import make_workload
from tests.bench.tiny import QUICK, TINY


def _provider(name: str) -> Provider:
    [provider] = [p for p in PROVIDERS if p.kernel == "paged_attention" and p.name == name]
    return provider


def _attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Heads-first non-causal attention with GQA, in float64."""
    group = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(group, dim=1).double() for t in (k, v))
    return F.scaled_dot_product_attention(q.double(), k, v).to(q.dtype)


def _sageattn(q: Tensor, k: Tensor, v: Tensor, tensor_layout: str = "HND", **kwargs) -> Tensor:
    """SageAttention 1.0.6's ``sageattn`` as documented: HND is (batch, heads, tokens, dim)."""
    assert q.is_contiguous() and k.is_contiguous() and v.is_contiguous()
    if tensor_layout == "NHD":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        return _attention(q, k, v).transpose(1, 2)
    assert tensor_layout == "HND"
    return _attention(q, k, v)


def _flash_attn_varlen_func(
    q: Tensor, k: Tensor, v: Tensor, *, seqused_k: Tensor, page_table: Tensor, causal: bool
) -> tuple[Tensor, Tensor]:
    """FA4's paged call as documented: q (batch, seqlen_q, heads, dim), k/v (pages, page_size,
    kv_heads, dim), page_table (batch, pages per sequence), seqused_k (batch); (out, lse)."""
    assert not causal and page_table.dtype == seqused_k.dtype == torch.int32
    outs = []
    for seq in range(q.shape[0]):
        length = int(seqused_k[seq])
        keys, values = (t[page_table[seq].long()].flatten(0, 1)[:length] for t in (k, v))
        out = _attention(q[seq : seq + 1].transpose(1, 2), *(
            t.unsqueeze(0).transpose(1, 2) for t in (keys, values)
        ))  # fmt: skip
        outs.append(out.transpose(1, 2))
    return torch.cat(outs), torch.empty(0)


@pytest.fixture
def stand_ins(monkeypatch):
    sage = types.ModuleType("sageattention")
    sage.sageattn = _sageattn
    flash_attn, cute = types.ModuleType("flash_attn"), types.ModuleType("flash_attn.cute")
    cute.flash_attn_varlen_func = _flash_attn_varlen_func
    flash_attn.cute = cute
    for module in (sage, flash_attn, cute):
        module.__spec__ = importlib.machinery.ModuleSpec(module.__name__, None)
        monkeypatch.setitem(sys.modules, module.__name__, module)
    return sage, cute


@pytest.mark.parametrize(
    "name, words",
    [
        ("sageattention", "sageattention is not installed (bench/peer_wheels.sh"),
        ("flash-attn-4", "flash-attn-4 (flash_attn.cute) is not installed"),
    ],
)
def test_a_peer_that_is_not_installed_skips_with_one_line(name: str, words: str) -> None:
    reason = _provider(name).unsupported(make_workload(TINY, 8))
    assert reason is not None and reason.startswith(words) and "\n" not in reason
    assert _provider(name).role == "baseline"  # a failure is a skip, never the sweep's


@pytest.mark.parametrize("name", ["sageattention", "flash-attn-4"])
def test_an_importable_peer_skips_on_a_cpu_with_one_line(stand_ins, name: str) -> None:
    reason = _provider(name).unsupported(make_workload(TINY, 8))
    assert reason is not None and "GPU only" in reason and "\n" not in reason


@pytest.mark.parametrize("block_size", [1, 8, 24])
@pytest.mark.parametrize("name", ["sageattention", "flash-attn-4"])
def test_the_peers_calls_match_the_oracle_through_stand_ins(
    stand_ins, name: str, block_size: int
) -> None:
    workload = make_workload(TINY, block_size)
    checked = _check_then_time(
        _provider(name), None, workload, _Oracles(), torch.device("cpu"), QUICK
    )
    assert isinstance(checked, Checked), checked
    assert checked.error <= checked.limit


def test_a_peer_handed_the_wrong_layout_is_caught(stand_ins, monkeypatch) -> None:
    sage, _ = stand_ins
    # Our provider passes heads-first tensors; read as tokens-first, the result is wrong.
    monkeypatch.setattr(sage, "sageattn", lambda q, k, v, **kw: _sageattn(q, k, v, "NHD"))
    checked = _check_then_time(
        _provider("sageattention"), None, make_workload(TINY, 8), _Oracles(),
        torch.device("cpu"), QUICK,
    )  # fmt: skip
    assert isinstance(checked, str) and checked.startswith(("wrong result", "failed")), checked


def test_a_wheel_split_over_two_calls_comes_back_whole_or_not_at_all(tmp_path) -> None:
    # bench/peer_wheels.sh: the first call carries .whl_a, the second .whl_b; on the warm
    # machine the halves give the wheel back, checked by its sha256; a half missing or
    # corrupted installs nothing of it.
    script = Path(__file__).resolve().parents[2] / "bench" / "peer_wheels.sh"
    wheel = tmp_path / "big-1.0-py3-none-any.whl"
    payload = bytes(range(256)) * 41 + b"odd"
    wheel.write_bytes(payload)
    env = {**os.environ, "PEER_WHEELS_ROOT": str(tmp_path)}

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", str(script), *args], env=env, capture_output=True, text=True)

    assert run("split", str(wheel)).returncode == 0
    assert not wheel.exists()
    halves = [
        tmp_path / ".whl_a" / f"{wheel.name}.part1",
        tmp_path / ".whl_b" / f"{wheel.name}.part2",
    ]
    assert [h.stat().st_size for h in halves] == [
        len(payload) - len(payload) // 2,
        len(payload) // 2,
    ]
    back = tmp_path / "back"
    back.mkdir()
    assert run("reassemble", str(back)).returncode == 0
    assert (back / wheel.name).read_bytes() == payload
    (back / wheel.name).unlink()
    halves[1].write_bytes(halves[1].read_bytes()[:-1] + b"!")
    done = run("reassemble", str(back))
    assert done.returncode == 1 and "do not give the wheel" in done.stderr
    assert not (back / wheel.name).exists()
    halves[1].unlink()
    done = run("reassemble", str(back))
    assert done.returncode == 0 and "not installed" in done.stdout
    assert not list(back.iterdir())


def test_ours_over_each_peer_side_by_side() -> None:
    from paged_video.bench.peers import peer_lines
    from tests.bench.rows import measured

    rows = [
        measured("paged_attention", "triton", 16, 5.0, role="ours", figures="gpu"),
        measured("paged_attention", "sdpa-cudnn", 16, 4.0, figures="gpu"),
        measured("paged_attention", "sdpa-best", 16, 4.0, role="best-of", figures="gpu"),
        measured("paged_attention", "flash-attn-4", 16, 10.0, figures="gpu"),
        measured(
            "paged_attention", "sageattention", 16, 1.0, figures="gpu", skipped="not installed"
        ),
    ]
    lines = peer_lines(rows)
    assert lines[0].startswith("kernel")  # GPU figures: no warning line
    ratios = {line.split()[4]: line.split()[-1] for line in lines[1:] if line.startswith("paged")}
    # sdpa-best stands for the forced backends; each peer over ours.
    assert ratios == {"sdpa-best": "0.800x", "flash-attn-4": "2.00x"}
    assert lines[-1] == "not run: paged_attention/sageattention: not installed"

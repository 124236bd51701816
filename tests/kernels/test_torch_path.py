"""The plain-PyTorch path a CPU takes without Triton's interpreter, against the oracle."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from paged_video import kernels, reference
from paged_video.kernels import _runtime
from tests.helpers import nan_like
from tests.kernels.paged_case import assert_lse_close, make_paged_case


@pytest.fixture
def no_interpreter(monkeypatch):
    monkeypatch.setattr(_runtime, "interpreter_active", lambda: False)
    assert _runtime.use_torch_path(torch.zeros(1))


@pytest.mark.parametrize("block_size", [1, 7, 16], ids=lambda b: f"B{b}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_attention(no_interpreter, block_size: int, causal: bool) -> None:
    case = make_paged_case(
        q_lens=[5, 0, 12],
        k_lens=[30, 4, 12],
        block_size=block_size,
        num_heads=6,
        num_kv_heads=2,
        head_dim=80,
    )
    key_limits = torch.arange(17, dtype=torch.int32) % 9
    key_gap = torch.tensor([[2, 11], [0, 0], [1, 3]], dtype=torch.int32)
    kwargs = dict(max_seqlen_q=12, causal=causal, key_limits=key_limits, key_gap=key_gap)
    got, lse = kernels.paged_attention(
        *case.args(), out=nan_like(case.q), return_lse=True, **kwargs
    )
    want, want_lse = reference.paged_attention(*case.args(), return_lse=True, **kwargs)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert_lse_close(lse, want_lse, 2e-6)


def test_attention_over_no_keys(no_interpreter) -> None:
    # A sequence with no keys gives zeros and -inf (a max over no keys must not raise).
    case = make_paged_case(q_lens=[3, 2], k_lens=[0, 9], block_size=4, num_heads=2)
    got, lse = kernels.paged_attention(
        *case.args(), max_seqlen_q=3, out=nan_like(case.q), return_lse=True
    )
    want, want_lse = reference.paged_attention(*case.args(), max_seqlen_q=3, return_lse=True)
    assert torch.equal(got[:3], torch.zeros_like(got[:3]))
    torch.testing.assert_close(got, want.float(), atol=1e-5, rtol=0)
    assert_lse_close(lse, want_lse, 2e-6)


def test_write_and_gather(no_interpreter) -> None:
    k_cache = torch.randn(6, 7, 2, 16)
    v_cache = torch.randn(6, 7, 2, 16)
    k_want, v_want = k_cache.clone(), v_cache.clone()
    key, value = torch.randn(5, 2, 16), torch.randn(5, 2, 16)
    slots = torch.tensor([3, -1, 20, 41])
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            k_want.view(-1, 2, 16)[slot], v_want.view(-1, 2, 16)[slot] = key[t], value[t]
    kernels.write_slots(key, value, k_cache.view(-1, 2, 16), v_cache.view(-1, 2, 16), slots)
    assert torch.equal(k_cache, k_want) and torch.equal(v_cache, v_want)

    stage_k, stage_v = torch.full((30, 2, 16), 5.0), torch.full((30, 2, 16), 5.0)
    ids = torch.tensor([4, 1, 2], dtype=torch.int32)
    kernels.gather_blocks(k_cache, v_cache, ids, stage_k, stage_v, first_block=1)
    assert torch.equal(stage_k[:7], torch.full((7, 2, 16), 5.0))
    assert torch.equal(stage_k[7:21], k_cache[[1, 2]].flatten(0, 1))
    assert torch.equal(stage_v[7:21], v_cache[[1, 2]].flatten(0, 1))
    assert torch.equal(stage_k[21:], torch.full((9, 2, 16), 5.0))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a CPU-only process")
def test_cpu_process_without_interpreter() -> None:
    # A user who turned the interpreter off on a CPU still gets correct attention.
    script = (
        "import torch\n"
        "from paged_video import kernels, reference\n"
        "from paged_video.kernels._runtime import interpreter_active\n"
        "assert not interpreter_active()\n"
        "q = torch.randn(4, 2, 16); kc = torch.randn(3, 5, 1, 16); vc = torch.randn(3, 5, 1, 16)\n"
        "t = torch.tensor([[2, 0, 1]], dtype=torch.int32)\n"
        "cu = torch.tensor([0, 4], dtype=torch.int32); sk = torch.tensor([13], dtype=torch.int32)\n"
        "got = kernels.paged_attention(q, kc, vc, t, cu, sk, max_seqlen_q=4)\n"
        "want = reference.paged_attention(q, kc, vc, t, cu, sk, max_seqlen_q=4)\n"
        "torch.testing.assert_close(got, want, atol=1e-5, rtol=0)\n"
        "print('ok')\n"
    )
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"

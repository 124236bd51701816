"""vllm-omni's AR-Diffusion call forms on the backend, against the float64 oracle.

The seam is the stand-in (``conftest.py``); ``kernel_calls`` proves the project's kernels ran,
since the stand-in's own reference would match the oracle too. The CUDA branch of the entry
point runs here on CPU tensors, its device test patched.
"""

from __future__ import annotations

import pytest
import torch

from paged_video import reference
from paged_video.integrations.vllm_omni import backend, install, patching
from tests.integrations.ar_case import ar_case, assert_matches

GATHER_ENV = "VLLM_OMNI_AR_DIFFUSION_KV_GATHER"


@pytest.fixture
def kernel_calls(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    calls = {"paged_attention": 0, "gather_blocks": 0}

    def spy(name):
        real = getattr(backend, name)

        def counted(*args, **kwargs):
            calls[name] += 1
            return real(*args, **kwargs)

        return counted

    for name in calls:
        monkeypatch.setattr(backend, name, spy(name))
    return calls


@pytest.fixture
def cuda_branch(monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU tensors take the entry point's CUDA branch."""
    monkeypatch.setattr(patching, "_on_our_cuda_path", lambda query: True)


def call_entry(standin, case, **extra):
    return standin.module.ar_diffusion_paged_attention(
        case.query, case.key_cache, case.value_cache, **case.kwargs(), **extra
    )


@pytest.mark.parametrize(
    ("block_size", "history_chunks", "action_len", "dtype", "batched"),
    [
        (16, 0, 0, torch.float32, True),
        (16, 1, 3, torch.float32, False),
        (16, 3, 0, torch.float16, False),
        (7, 2, 3, torch.float32, True),
        (24, 1, 0, torch.float16, False),
    ],
)
def test_cpu_seam(standin, kernel_calls, block_size, history_chunks, action_len, dtype, batched):
    """A CPU query reaches ``_reference_paged_attention``, which is the backend's."""
    case = ar_case(
        block_size=block_size,
        history_chunks=history_chunks,
        action_len=action_len,
        dtype=dtype,
        batched=batched,
    )
    install()
    got = call_entry(standin, case)
    assert got.shape == case.query.shape and got.dtype == dtype
    assert_matches(got, case.expected())
    assert kernel_calls["paged_attention"] == 1


def test_cpu_seam_at_the_frame_block(standin, kernel_calls):
    """1560-token blocks (one frame), one history chunk; a few query rows keep it cheap."""
    case = ar_case(block_size=1560, history_chunks=1, query_len=5, heads=1, head_dim=16)
    install()
    assert_matches(call_entry(standin, case), case.expected())
    assert kernel_calls["paged_attention"] == 1


@pytest.mark.parametrize(
    ("block_size", "history_chunks", "action_len", "dtype"),
    [(16, 0, 3, torch.float32), (16, 3, 0, torch.float16), (7, 1, 3, torch.float32)],
)
def test_cuda_branch_paged_form(
    standin, kernel_calls, cuda_branch, block_size, history_chunks, action_len, dtype
):
    case = ar_case(
        block_size=block_size, history_chunks=history_chunks, action_len=action_len, dtype=dtype
    )
    install()
    assert_matches(call_entry(standin, case), case.expected())
    assert kernel_calls == {"paged_attention": 1, "gather_blocks": 0}
    assert standin.flash_attn_calls == []


@pytest.mark.parametrize(("block_size", "history_chunks", "action_len"), [(16, 2, 3), (24, 1, 0)])
def test_cuda_branch_gather_form_unstaged(
    standin, kernel_calls, cuda_branch, monkeypatch, block_size, history_chunks, action_len
):
    """The contiguous form gathers the whole window (NaN padding blocks included) first."""
    monkeypatch.setenv(GATHER_ENV, "1")
    case = ar_case(block_size=block_size, history_chunks=history_chunks, action_len=action_len)
    install()
    assert_matches(call_entry(standin, case), case.expected())
    assert kernel_calls == {"paged_attention": 1, "gather_blocks": 1}
    assert standin.flash_attn_calls == []


@pytest.mark.parametrize(("block_size", "dtype"), [(16, torch.float32), (7, torch.float16)])
def test_cuda_branch_gather_form_staged_then_reused(
    standin, kernel_calls, cuda_branch, monkeypatch, block_size, dtype
):
    """The first forward stages the whole window; a second one with ``reuse_history`` restages
    only the current chunk: history it would re-read is poisoned and must not show."""
    monkeypatch.setenv(GATHER_ENV, "1")
    case = ar_case(block_size=block_size, history_chunks=2, dtype=dtype)
    spare = 5  # capacity past max_seq_len, which staging must leave alone
    shape = (case.max_seq_len + spare, *case.key_cache.shape[2:])
    stage_k, stage_v = torch.full(shape, -7.0, dtype=dtype), torch.full(shape, -7.0, dtype=dtype)
    staging = {"stage_key": stage_k, "stage_value": stage_v, "current_tokens": case.current_tokens}
    install()
    assert_matches(call_entry(standin, case, **staging), case.expected())
    table = case.block_table[0, : case.max_seq_len // block_size].long()
    for stage, cache in ((stage_k, case.key_cache), (stage_v, case.value_cache)):
        want = cache.index_select(0, table).flatten(0, 1)
        torch.testing.assert_close(stage[: case.max_seq_len], want, rtol=0, atol=0, equal_nan=True)
        assert (stage[case.max_seq_len :] == -7).all()

    history_blocks = case.block_table[0, : case.history_blocks].long()
    current_blocks = case.block_table[0, case.history_blocks : case.history_blocks + 1].long()
    fresh = torch.randn(case.key_cache[current_blocks].shape).to(dtype)
    case.key_cache[current_blocks] = fresh
    case.value_cache[current_blocks] = -fresh
    want = case.expected()  # with the new current chunk, the history as staged
    for cache in (case.key_cache, case.value_cache):
        cache[history_blocks] = float("nan")
    got = call_entry(
        standin, case, **staging, reuse_history=True, stage_first_block=case.history_blocks
    )
    assert_matches(got, want)
    assert kernel_calls == {"paged_attention": 2, "gather_blocks": 2}
    assert standin.flash_attn_calls == []


def test_cuda_branch_traces_fullgraph_as_one_opaque_op(standin, kernel_calls, cuda_branch):
    """A compiled block that calls the entry point directly keeps one graph."""
    case = ar_case(block_size=16, history_chunks=1)
    install()
    entry = standin.model.ar_diffusion_paged_attention
    torch._dynamo.reset()
    try:
        compiled = torch.compile(
            lambda q: entry(q, case.key_cache, case.value_cache, **case.kwargs()) * 1.0,
            backend="eager",
            fullgraph=True,
        )
        assert_matches(compiled(case.query), case.expected())
    finally:
        torch._dynamo.reset()
    assert kernel_calls["paged_attention"] == 1


def test_cuda_branch_keeps_vllm_omnis_refusals(standin, cuda_branch, monkeypatch):
    """Misdescribed staged reuse and an unaligned window are refused before anything is staged."""
    monkeypatch.setenv(GATHER_ENV, "1")
    case = ar_case(block_size=16, history_chunks=1)
    stage = torch.full((case.max_seq_len, *case.key_cache.shape[2:]), -7.0)
    staging = {"stage_key": stage, "stage_value": stage.clone(), "reuse_history": True}
    install()
    with pytest.raises(AssertionError, match="block-aligned current chunk"):
        call_entry(standin, case, **staging, current_tokens=9, stage_first_block=1)
    with pytest.raises(AssertionError, match="exceeds the"):
        call_entry(standin, case, **staging, current_tokens=16, stage_first_block=5)
    case.max_seq_len += 1
    with pytest.raises(ValueError, match="block-aligned"):
        call_entry(standin, case)
    assert (stage == -7).all()


@pytest.mark.parametrize("cuda", [False, True])
def test_fused_op_body_reaches_the_backend(standin, kernel_calls, monkeypatch, cuda):
    """The fused op writes the current K/V, then calls the entry point through the seam
    module's globals: both branches end in the backend."""
    if cuda:
        monkeypatch.setattr(patching, "_on_our_cuda_path", lambda query: True)
    case = ar_case(block_size=16, history_chunks=1, action_len=3)
    block_size, heads, dim = case.key_cache.shape[1:]
    current = case.block_table[0, 1].item()
    k_curr, v_curr = torch.randn(2, block_size, heads, dim)
    video_slots = current * block_size + torch.arange(block_size)
    key_pool, value_pool = case.key_cache.flatten(0, 1), case.value_cache.flatten(0, 1)
    install()
    got = standin.module._paged_write_attn_impl(
        case.query, k_curr, v_curr, None, None, key_pool, value_pool, block_size,
        video_slots, torch.empty(0, dtype=torch.long), case.block_table, case.query_start_loc,
        case.seq_lens, case.max_query_len, case.max_seq_len, case.softmax_scale,
    )  # fmt: skip
    assert torch.equal(case.key_cache[current], k_curr)
    assert_matches(got, case.expected())
    assert kernel_calls["paged_attention"] == 1


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_paged_form_gqa_two_sequences(causal):
    """FlashAttention's paged form: GQA, two sequences, a permuted table, NaN-poisoned output."""
    gen = torch.Generator().manual_seed(1)
    block_size, heads, kv_heads, dim = 7, 4, 2, 16
    k_cache, v_cache = torch.randn(2, 6, block_size, kv_heads, dim, generator=gen)
    table = torch.tensor([[5, 2, 0], [1, 3, 4]], dtype=torch.int32)
    q_lens, k_lens = [3, 6], [17, 10]
    q = torch.randn(sum(q_lens), heads, dim, generator=gen)
    cu_q = torch.tensor([0, 3, 9], dtype=torch.int32)
    out = torch.full_like(q, float("nan"))
    got = backend.varlen_attention(
        q=q, k=k_cache, v=v_cache, out=out, cu_seqlens_q=cu_q, max_seqlen_q=6,
        max_seqlen_k=21, softmax_scale=0.3, causal=causal,
        seqused_k=torch.tensor(k_lens, dtype=torch.int32), block_table=table,
    )  # fmt: skip
    want = reference.paged_attention(
        q, k_cache, v_cache, table, cu_q, torch.tensor(k_lens, dtype=torch.int32),
        max_seqlen_q=6, softmax_scale=0.3, causal=causal,
    )  # fmt: skip
    assert got is out
    assert_matches(got, want.double())


def test_varlen_contiguous_form_reads_its_rows_only():
    """FlashAttention's contiguous form over packed rows read as blocks: keys before
    ``cu_seqlens_k[0]`` and from ``cu_seqlens_k[1]`` on are NaN and must not be read."""
    gen = torch.Generator().manual_seed(2)
    block_size, rows, heads, kv_heads, dim = 8, 40, 2, 1, 16
    k, v = torch.randn(2, rows, kv_heads, dim, generator=gen)
    lo, hi = 5, 29
    k[:lo], v[:lo], k[hi:], v[hi:] = (float("nan"),) * 4
    q = torch.randn(6, heads, dim, generator=gen)
    out = torch.full_like(q, float("nan"))
    got = backend.varlen_attention(
        q=q, k=k, v=v, out=out, cu_seqlens_q=torch.tensor([0, 6], dtype=torch.int32),
        max_seqlen_q=6, max_seqlen_k=rows, softmax_scale=dim**-0.5, causal=False,
        cu_seqlens_k=torch.tensor([lo, hi], dtype=torch.int32), kv_block_size=block_size,
    )  # fmt: skip
    assert_matches(got, reference.dense_attention(q, k[lo:hi], v[lo:hi]))


@pytest.mark.parametrize(
    ("forms", "message"),
    [
        ({}, "either block_table"),
        ({"block_table": "t", "cu_seqlens_k": "c"}, "either block_table"),
        ({"block_table": "t"}, "needs both"),
        ({"cu_seqlens_k": "c2"}, "one sequence"),
        ({"cu_seqlens_k": "c", "kv_block_size": 7}, "must divide"),
    ],
)
def test_varlen_refuses_other_forms(forms, message):
    values = {
        "t": torch.zeros(1, 1, dtype=torch.int32),
        "c": torch.tensor([0, 4], dtype=torch.int32),
        "c2": torch.tensor([0, 2, 4], dtype=torch.int32),
    }
    q = torch.randn(2, 1, 16)
    with pytest.raises(ValueError, match=message):
        backend.varlen_attention(
            q=q, k=torch.randn(16, 1, 16), v=torch.randn(16, 1, 16), out=torch.empty_like(q),
            cu_seqlens_q=torch.tensor([0, 2], dtype=torch.int32), max_seqlen_q=2,
            max_seqlen_k=16, softmax_scale=0.25, causal=False,
            **{name: values.get(value, value) for name, value in forms.items()},
        )  # fmt: skip


def test_causal_is_computed_where_vllm_omnis_reference_refuses(standin):
    """Bottom-right causal, as vllm-omni's CUDA path asks FlashAttention for."""
    case = ar_case(block_size=16, history_chunks=1, action_len=3)
    with pytest.raises(NotImplementedError):
        call_entry(standin, case, causal=True)
    install()
    got = call_entry(standin, case, causal=True)
    want = case.expected(causal=True)
    assert_matches(got, want)
    assert not torch.allclose(want, case.expected(), atol=1e-3)


def test_mixed_dtypes_are_refused_where_vllm_omni_returns_the_value_dtype(standin):
    case = ar_case(block_size=16, history_chunks=0, dtype=torch.float16)
    case.query = case.query.float()
    assert call_entry(standin, case).dtype == torch.float16  # vllm-omni's reference
    install()
    with pytest.raises(TypeError, match="must equal the query dtype"):
        call_entry(standin, case)

"""paging.transfer: a forward's metadata reaches the device in one copy, unchanged, unsynced."""

from __future__ import annotations

import pytest
import torch

from paged_video.paging import PagedKVCache, PagingConfig, plan, transfer
from tests.helpers import DEVICE, ON_GPU

CONFIGS = [
    pytest.param(
        PagingConfig(
            block_size=4, chunk_size=6, sink_chunks=1, window_chunks=2, max_action_tokens=5
        ),
        id="ragged-actions",
    ),
    pytest.param(
        PagingConfig(
            block_size=7,
            chunk_size=7,
            window_chunks=3,
            max_forward_chunks=2,
            reuse_history_staging=True,
            exact_window=True,
        ),
        id="staged-exact",
    ),
    pytest.param(
        PagingConfig(block_size=1, chunk_size=3, sink_chunks=2, window_chunks=2),
        id="B1-sink",
    ),
]


def per_tensor_copies(tensors, device):
    """The construction ``prepare`` used before: one ``.to(device)`` per tensor."""
    return [tensor.to(device) for tensor in tensors]


def rollout_inputs(config: PagingConfig, device: torch.device) -> list:
    """Every prepared forward's inputs over a rollout: scratch forwards with actions, commits."""
    cache = PagedKVCache(config, num_layers=1, num_kv_heads=1, head_dim=2, device=device)
    session = cache.open_session()
    seen = []
    for tick in range(12):
        actions = tick % (config.max_action_tokens + 1)
        chunks = 1 + tick % config.max_forward_chunks
        scratch = cache.plan(session, "main", chunks * config.chunk_size, action_tokens=actions)
        seen.append(scratch.prepare())
        scratch.cancel()
        committing = cache.plan(session, "main", chunks * config.chunk_size, commit=True)
        seen.append(committing.prepare())
        assert committing.commit()
    return seen


@pytest.mark.parametrize("config", CONFIGS)
def test_prepare_gives_the_tensors_per_tensor_copies_gave(config, monkeypatch) -> None:
    packed = rollout_inputs(config, DEVICE)
    monkeypatch.setattr(plan, "to_device", per_tensor_copies)
    separate = rollout_inputs(config, DEVICE)
    fields = ("video_slots", "action_slots", "block_table", "cu_seqlens_q", "seq_lens_k")
    for got, want in zip(packed, separate, strict=True):
        for name in (*fields, "key_gap"):
            a, b = getattr(got, name), getattr(want, name)
            assert (a.dtype, a.shape, a.device) == (b.dtype, b.shape, b.device), name
            assert a.is_contiguous() and torch.equal(a, b), name
        assert got.max_seqlen_q == want.max_seqlen_q and got.max_seqlen_k == want.max_seqlen_k
        # One buffer: every tensor is a view into the same device storage.
        storages = {getattr(got, name).untyped_storage().data_ptr() for name in fields}
        assert len(storages) == 1


def test_to_device_keeps_values_dtypes_shapes_and_aligns() -> None:
    tensors = [
        torch.arange(3, dtype=torch.int32),  # 12 bytes: the next view needs padding
        torch.arange(-5, 0, dtype=torch.int64),
        torch.empty(0, dtype=torch.int64),
        torch.tensor([[7, 8, 9]], dtype=torch.int32),
        torch.arange(10, dtype=torch.int64)[::3],  # not contiguous on the host
        torch.tensor([1.5, -2.0], dtype=torch.float32),
    ]
    moved = transfer.to_device(tensors, DEVICE)
    for got, want in zip(moved, tensors, strict=True):
        assert (got.dtype, got.shape, got.device.type) == (want.dtype, want.shape, DEVICE.type)
        assert got.is_contiguous() and got.data_ptr() % transfer.ALIGN == 0
        assert torch.equal(got.cpu(), want)
    assert len({t.untyped_storage().data_ptr() for t in moved}) == 1


def test_to_device_refuses_device_tensors() -> None:
    with pytest.raises(ValueError, match=r"tensors\[1\]"):
        transfer.pack([torch.zeros(2), torch.zeros(2, device="meta")], pin=False)


@pytest.mark.skipif(not ON_GPU, reason="pinned memory and stream synchronisation need CUDA")
def test_pack_pins_the_host_buffer_for_cuda() -> None:
    # A non_blocking copy from pageable memory is synchronous, and sync-debug mode misses it.
    buffer, _ = transfer.pack([torch.arange(4)], pin=True)
    assert buffer.is_pinned()


@pytest.mark.skipif(not ON_GPU, reason="synchronisation with the GPU needs CUDA")
@pytest.mark.parametrize("config", CONFIGS)
def test_prepare_never_synchronises(config) -> None:
    cache = PagedKVCache(config, num_layers=1, num_kv_heads=1, head_dim=2, device="cuda")
    session = cache.open_session()
    torch.cuda._sleep(10_000_000)  # keep the stream busy: a sync would have to wait for it
    for commit, actions in ((True, 0), (False, config.max_action_tokens)):
        forward = cache.plan(
            session, "main", config.chunk_size, commit=commit, action_tokens=actions
        )
        torch.cuda.set_sync_debug_mode("error")
        try:
            forward.prepare()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        if commit:
            forward.commit()
    torch.cuda.synchronize()

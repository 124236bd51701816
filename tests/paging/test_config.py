"""The configuration: validation per field, and the fixed widths derived from it by hand."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from paged_video.paging import PagingConfig, paging_block_size, window

VALID = dict(block_size=4, chunk_size=6, window_chunks=2)


def raises_exactly(error: type[Exception], message: str):
    """``pytest.raises`` matching the whole message, so a test trips the check it means to."""
    return pytest.raises(error, match=f"^{re.escape(message)}$")


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("block_size", 0, "block_size must be in 1..1048576, got 0"),
        ("block_size", 2**20 + 1, "block_size must be in 1..1048576, got 1048577"),
        ("chunk_size", 0, "chunk_size must be in 1..1048576, got 0"),
        ("window_chunks", 0, "window_chunks must be in 1..65536, got 0"),
        ("sink_chunks", -1, "sink_chunks must be in 0..65536, got -1"),
        ("sink_chunks", 10**9, "sink_chunks must be in 0..65536, got 1000000000"),
        ("max_forward_chunks", 0, "max_forward_chunks must be in 1..65536, got 0"),
        (
            "max_forward_chunks",
            3,
            "max_forward_chunks must be <= window_chunks (2): the window includes the current "
            "forward's own frames, got 3",
        ),
        ("max_action_tokens", -1, "max_action_tokens must be in 0..1048576, got -1"),
        ("max_action_tokens", 2**21, "max_action_tokens must be in 0..1048576, got 2097152"),
    ],
)
def test_invalid_value_names_the_field(field: str, value: int, message: str) -> None:
    with raises_exactly(ValueError, message):
        PagingConfig(**{**VALID, field: value})


def test_a_window_past_int32_keys_is_refused() -> None:
    # Every field in range, but 2**16 frames of 2**16 tokens, plus one action block, is
    # (2**16 + 1) * 2**16 keys.
    with raises_exactly(
        ValueError,
        "the read window is too long: (sink_chunks + window_chunks) * chunk_size plus "
        "max_action_tokens, in whole blocks, is 4295032832 keys; it must be <= 2147483647 "
        "(key positions are int32), got sink_chunks=0, window_chunks=65536, "
        "chunk_size=65536, block_size=65536, max_action_tokens=0",
    ):
        PagingConfig(block_size=2**16, chunk_size=2**16, window_chunks=2**16)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("chunk_size", 6.0, "chunk_size must be an int, got float"),
        ("block_size", True, "block_size must be an int, got bool"),
        ("reset_at_boundary", 1, "reset_at_boundary must be a bool, got int"),
        ("reuse_history_staging", "yes", "reuse_history_staging must be a bool, got str"),
        ("exact_window", None, "exact_window must be a bool, got NoneType"),
        ("compaction", 0, "compaction must be a bool, got int"),
        ("smooth_keys", 1, "smooth_keys must be a bool, got int"),
        (
            "kv_dtype",
            torch.float16,
            "kv_dtype must be None or torch.int8, got torch.float16",
        ),
        (
            "kv_dtype",
            "int8",
            "kv_dtype must be None or torch.int8, got 'int8'",
        ),
    ],
)
def test_wrong_type_names_the_field(field: str, value: object, message: str) -> None:
    with raises_exactly(TypeError, message):
        PagingConfig(**{**VALID, field: value})


@pytest.mark.parametrize("kv_dtype", [None, torch.int8])
@pytest.mark.parametrize("value", [True, "yes"], ids=["true", "str"])
def test_fp8_mma_was_deleted_for_k8v8(kv_dtype, value: object) -> None:
    # Issue 45: the old spelling names the new one (k8v8 dominates FP8-MMA).
    with raises_exactly(
        ValueError,
        'fp8_mma was deleted (issue 45): use kv_format="k8v8" (PagingConfig; to '
        "paged_attention: an int8 k_cache with k_scale and an e4m3 v_cache with v_channel_scale)",
    ):
        PagingConfig(**VALID, kv_dtype=kv_dtype, fp8_mma=value)
    assert not PagingConfig(**VALID, fp8_mma=False).fp8_mma  # its old default still reads


@pytest.mark.parametrize("kv_dtype", [None, torch.int8])
@pytest.mark.parametrize("value", [True, 1], ids=["true", "int"])
def test_int8_mma_was_deleted_for_k8v16(kv_dtype, value: object) -> None:
    # Issue 45: the old spelling names the new one (k8v16 dominates INT8-MMA).
    with raises_exactly(
        ValueError,
        'int8_mma was deleted (issue 45): use kv_format="k8v16" (PagingConfig; to '
        "paged_attention: an int8 k_cache with k_scale and a v_cache in q's dtype, no v_scale)",
    ):
        PagingConfig(**VALID, kv_dtype=kv_dtype, int8_mma=value)


def test_int8_format_sets_the_int8_pool_fields_and_survives_replace() -> None:
    config = PagingConfig(**VALID, kv_format="int8")
    assert (config.kv_dtype, config.keys_major, config.channel_equalization()) == (
        torch.int8,
        True,
        True,
    )
    assert dataclasses.replace(config, window_chunks=3) == dataclasses.replace(
        PagingConfig(**VALID, kv_dtype=torch.int8, keys_major=True),
        window_chunks=3,
        kv_format="int8",
    )
    # A field as the format sets it is accepted (what replace() passes back).
    assert PagingConfig(**VALID, kv_format="int8", kv_dtype=torch.int8).keys_major
    with raises_exactly(
        ValueError,
        "kv_format='k8v8' implies the pools' dtypes, layout and MMAs: leave kv_dtype unset",
    ):
        PagingConfig(**VALID, kv_format="k8v8", kv_dtype=torch.int8)


def test_e4m3_pool_was_deleted_for_k8v16_and_k8v8() -> None:
    # Issue 45: the old spelling names the new ones (k8v16 more accurate on every data kind,
    # k8v8 the same bytes).
    with raises_exactly(
        ValueError,
        "kv_dtype=torch.float8_e4m3fn (the e4m3 dequantizing pool) was deleted (issue 45): use "
        'kv_format="k8v16" (PagingConfig; to paged_attention: an int8 k_cache with k_scale and '
        "a v_cache in q's dtype, no v_scale): more accurate on every data kind; or "
        'kv_format="k8v8" (PagingConfig; to paged_attention: an int8 k_cache with k_scale and '
        "an e4m3 v_cache with v_channel_scale): the same bytes",
    ):
        PagingConfig(**VALID, kv_dtype=torch.float8_e4m3fn)


def test_equalize_channels_is_a_bool_or_none_and_needs_a_quantized_kv_dtype() -> None:
    with raises_exactly(TypeError, "equalize_channels must be a bool or None, got int"):
        PagingConfig(**VALID, kv_dtype=torch.int8, equalize_channels=1)
    with raises_exactly(
        ValueError,
        "equalize_channels=True needs a quantized kv_dtype (torch.int8) or kv_format: "
        "float pools store K/V as they are",
    ):
        PagingConfig(**VALID, equalize_channels=True)


@pytest.mark.parametrize(
    ("kv_dtype", "given", "equalized"),
    [
        (torch.int8, None, True),  # the default: on
        (torch.int8, False, False),
        (torch.int8, True, True),
        (None, None, False),
        (None, False, False),
    ],
)
def test_channel_equalization_defaults_by_format(kv_dtype, given, equalized) -> None:
    config = PagingConfig(**VALID, kv_dtype=kv_dtype, equalize_channels=given)
    assert config.channel_equalization() is equalized
    # A cache may give the format instead of the config (PagedKVCache(dtype=torch.int8)).
    plain = PagingConfig(**VALID, equalize_channels=None if given is None else False)
    assert plain.channel_equalization(torch.int8) is (given is None)
    assert not plain.channel_equalization(torch.bfloat16)


def test_quantized_switches_default_and_combine() -> None:
    config = PagingConfig(**VALID)
    assert (config.kv_dtype, config.smooth_keys, config.keys_major) == (None, True, False)
    config = PagingConfig(**VALID, kv_dtype=torch.int8, keys_major=True, smooth_keys=False)
    assert config.keys_major and not config.smooth_keys


def test_widths_worked_by_hand(ragged_config: PagingConfig) -> None:
    # S = 6, W = 12, B = 4, gcd(6, 4) = 2: ceil(6/4) = 2 sink blocks, ceil((12 + 2)/4) = 4
    # recent blocks, ceil(5/4) = 2 action blocks.
    assert window.sink_blocks(ragged_config) == 2
    assert window.max_video_blocks(ragged_config) == 6
    assert window.action_blocks(ragged_config) == 2
    assert window.table_width(ragged_config) == 8
    assert window.compaction_unit(ragged_config) == 12
    # Peak: 2 sink blocks + ceil((12 + 6 + 2)/4) = 5; scratch: ceil(6/4) + ceil(5/4) = 4.
    assert window.blocks_per_sequence(ragged_config) == 7
    assert window.scratch_blocks_per_sequence(ragged_config) == 4


def test_no_actions_still_reserve_one_action_block() -> None:
    # Aligned (C = B = 8): the recent range starts on a block edge, gcd = 8 adds no block.
    config = PagingConfig(block_size=8, chunk_size=8, window_chunks=3, sink_chunks=1)
    assert window.max_video_blocks(config) == 1 + 3
    assert window.table_width(config) == 5


def test_shipped_width() -> None:
    config = PagingConfig(
        block_size=16, chunk_size=1560, sink_chunks=9, window_chunks=9, max_forward_chunks=3
    )
    # ceil(14040/16) = 878, ceil((14040 + 16 - 8)/16) = 878, one action block.
    assert window.table_width(config) == 878 + 878 + 1


@pytest.mark.parametrize(
    ("frame", "supported", "expected"),
    [
        (1560, range(16, 4097, 16), 16),  # 1560 = 97.5 blocks of 16: the finest legal size
        (1600, range(16, 4097, 16), 1600),  # a frame that is a legal size is the block
        (220, [256, 512], 256),
        (1560, None, 1560),  # this project's kernels take any size
        (7, [7], 7),
    ],
)
def test_paging_block_size(frame: int, supported, expected: int) -> None:
    assert paging_block_size(frame, supported) == expected


@pytest.mark.parametrize(
    ("frame", "supported", "error", "message"),
    [
        (0, None, ValueError, "tokens_per_frame must be >= 1, got 0"),
        (16.0, None, TypeError, "tokens_per_frame must be an int, got float"),
        (16, [], ValueError, "supported must list at least one block size"),
        (16, [0, 16], ValueError, "supported must be >= 1, got 0"),
    ],
)
def test_paging_block_size_bad_input(frame, supported, error, message: str) -> None:
    with raises_exactly(error, message):
        paging_block_size(frame, supported)

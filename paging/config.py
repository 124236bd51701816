"""The paging configuration: the chunk window's geometry and the switches, validated once."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from paged_video._removed import refuse_e4m3_pool, refuse_removed
from paged_video.paging import window
from paged_video.paging._validate import require_bool, require_int

# Upper bounds, far above any real model and far below what would overflow. Frames and blocks:
# 1560 tokens per frame ship, 2**20 is a frame of a million tokens. Frames per window: 9 to 36
# ship, 2**16 is hours of latent video. Key positions and lengths reach the kernels as int32,
# so the read window (the table width times the block size) must stay below 2**31.
MAX_TOKENS = 2**20
MAX_CHUNKS = 2**16
MAX_KEYS = 2**31 - 1
# Quantized pool dtypes (kernels.quantize.QUANT_DTYPES; not imported: kernels load Triton).
KV_DTYPES = (torch.int8,)
# The one switch's formats (``kv_format``): the pools in the model's dtype, or k8v8 (int8 K, e4m3
# V with channel scales: both products on 8-bit tensor cores, docs/quantization.md).
KV_FORMATS = ("bf16", "k8v8", "k8v16", "int8")
# The fields a format sets (kv_format="int8": the int8 dequantizing pool in the layout its loop
# is shortest in: keys-major scales take the 128-key TMA loop at frame-sized blocks, 849
# instructions per 128 keys at block 1560 against 1050 slot-major, docs/quantization.md).
FORMAT_FIELDS: dict[str, dict[str, object]] = {"int8": {"kv_dtype": torch.int8, "keys_major": True}}


@dataclass(frozen=True)
class PagingConfig:
    """Geometry of the chunk window over a paged KV cache (docs/paging.md).

    ``chunk_size`` (``C``) is tokens per frame, the eviction unit; ``block_size`` (``B``) is
    tokens per block, the paging unit; the two are independent. The window keeps the first
    ``sink_chunks`` frames forever and the last ``window_chunks`` frames, the current
    forward's own included, so a forward may be at most ``window_chunks`` frames long.
    ``max_forward_chunks`` and ``max_action_tokens`` bound a forward: they size the pool, the
    scratch regions and the fixed block-table width.

    ``reset_at_boundary`` drops everything after the sink at every commit instead of sliding.
    ``reuse_history_staging`` allocates per-layer history staging buffers and lets a forward
    keep the staged history. ``exact_window`` hands attention the plan's ``key_gap`` so the
    out-of-window boundary tokens that whole-block reads add are masked. ``compaction`` removes
    evicted table entries; switching it off is for checking that compaction changes nothing.

    ``kv_dtype`` (``None`` or ``torch.int8``) stores K/V as codes with
    a float32 scale per (slot, KV head), quantized on write (docs/quantization.md); ``None`` keeps
    the cache's ``dtype``. ``smooth_keys`` subtracts a per-(layer, KV head) mean from K before
    quantizing, chosen from the first keys written to the layer and frozen (attention is
    unchanged by it). ``equalize_channels`` divides each (layer, KV head, channel) of K and V by
    a power of two chosen from the layer's first write and frozen, which attention folds into
    q and the output (unchanged in exact arithmetic): outlier channels then no longer take every
    row's codes. ``None`` (the default) equalizes int8 pools (``channel_equalization`` gives the
    choice). ``keys_major`` (quantized caches only) lays
    the scale pools out keys-major (``kernels.pool_layout``): a block's keys contiguous per KV
    head, which lets the scales load two at a time, at the cost of rows padded to 16 keys.
    ``fp8_mma`` and ``int8_mma`` were deleted (issue 45): ``True`` raises a ``ValueError``
    naming ``kv_format="k8v8"`` and ``kv_format="k8v16"``, which are more accurate on every
    data kind and issue fewer instructions (docs/quantization.md); so was the e4m3 pool
    (``kv_dtype=torch.float8_e4m3fn`` raises naming ``kv_format="k8v16"``, more accurate on
    every data kind, and ``kv_format="k8v8"``, the same bytes).

    ``kv_format`` (``None``: the switches above) is the one switch that implies them:
    ``"bf16"`` stores the pools in the cache's dtype, unquantized; ``"k8v8"`` stores K as int8
    codes (smoothed and equalized per ``smooth_keys``/``equalize_channels``, its scales
    keys-major) and V as keys-major e4m3 codes of a float32 scale per (layer, KV head, channel)
    frozen at the layer's first write with headroom 256 (``kernels.value_channels``), attended
    with an int8 ``Q K^T`` MMA and an FP8 ``P V`` MMA; ``"k8v16"`` stores K so and V in the
    cache's dtype, attended with the int8 ``Q K^T`` MMA and a 16-bit ``P V``; ``"int8"`` is the
    int8 dequantizing pool (``kv_dtype=torch.int8``, K smoothed, K and V equalized) with its
    scales keys-major: it sets ``kv_dtype`` and ``keys_major`` so (``FORMAT_FIELDS``). With a
    format, ``kv_dtype`` and ``keys_major`` stay unset (or as the format sets them).
    """

    block_size: int
    chunk_size: int
    window_chunks: int
    sink_chunks: int = 0
    max_forward_chunks: int = 1
    max_action_tokens: int = 0
    reset_at_boundary: bool = False
    reuse_history_staging: bool = False
    exact_window: bool = False
    compaction: bool = True
    kv_dtype: torch.dtype | None = None
    smooth_keys: bool = True
    fp8_mma: bool = False  # deleted: only its old default is accepted (refuse_removed)
    int8_mma: bool = False  # deleted: only its old default is accepted (refuse_removed)
    equalize_channels: bool | None = None
    keys_major: bool = False
    kv_format: str | None = None

    def __post_init__(self) -> None:
        require_int("block_size", self.block_size, minimum=1, maximum=MAX_TOKENS)
        require_int("chunk_size", self.chunk_size, minimum=1, maximum=MAX_TOKENS)
        require_int("window_chunks", self.window_chunks, minimum=1, maximum=MAX_CHUNKS)
        require_int("sink_chunks", self.sink_chunks, minimum=0, maximum=MAX_CHUNKS)
        require_int("max_forward_chunks", self.max_forward_chunks, minimum=1, maximum=MAX_CHUNKS)
        require_int("max_action_tokens", self.max_action_tokens, minimum=0, maximum=MAX_TOKENS)
        refuse_removed(fp8_mma=self.fp8_mma, int8_mma=self.int8_mma)
        switches = (
            "reset_at_boundary",
            "reuse_history_staging",
            "exact_window",
            "compaction",
            "smooth_keys",
            "keys_major",
        )
        for name in switches:
            require_bool(name, getattr(self, name))
        if self.equalize_channels is not None and not isinstance(self.equalize_channels, bool):
            raise TypeError(
                "equalize_channels must be a bool or None, got "
                f"{type(self.equalize_channels).__name__}"
            )
        refuse_e4m3_pool("kv_dtype", self.kv_dtype)
        if self.kv_dtype is not None and not any(self.kv_dtype is d for d in KV_DTYPES):
            raise TypeError(f"kv_dtype must be None or torch.int8, got {self.kv_dtype!r}")
        if self.kv_format is not None:
            self._check_kv_format()
            for name, value in FORMAT_FIELDS.get(self.kv_format, {}).items():
                object.__setattr__(self, name, value)  # frozen: set once, as given
        if self.equalize_channels and self.kv_dtype is None and self.kv_format in (None, "bf16"):
            raise ValueError(
                "equalize_channels=True needs a quantized kv_dtype (torch.int8) or kv_format: "
                "float pools store K/V as they are"
            )
        if self.max_forward_chunks > self.window_chunks:
            raise ValueError(
                f"max_forward_chunks must be <= window_chunks ({self.window_chunks}): the window "
                f"includes the current forward's own frames, got {self.max_forward_chunks}"
            )
        keys = window.table_width(self) * self.block_size
        if keys > MAX_KEYS:
            raise ValueError(
                f"the read window is too long: (sink_chunks + window_chunks) * chunk_size plus "
                f"max_action_tokens, in whole blocks, is {keys} keys; it must be <= {MAX_KEYS} "
                f"(key positions are int32), got sink_chunks={self.sink_chunks}, "
                f"window_chunks={self.window_chunks}, chunk_size={self.chunk_size}, "
                f"block_size={self.block_size}, max_action_tokens={self.max_action_tokens}"
            )

    def _check_kv_format(self) -> None:
        if not isinstance(self.kv_format, str) or self.kv_format not in KV_FORMATS:
            raise ValueError(
                f"kv_format must be None or one of {', '.join(KV_FORMATS)}, got {self.kv_format!r}"
            )
        # A field the format sets may also come as the format sets it (dataclasses.replace).
        fields = FORMAT_FIELDS.get(self.kv_format, {})
        implied = [
            name
            for name, value in (
                ("kv_dtype", self.kv_dtype is not None),
                ("keys_major", self.keys_major),
            )
            if value and (name not in fields or getattr(self, name) != fields[name])
        ]
        if implied:
            raise ValueError(
                f"kv_format={self.kv_format!r} implies the pools' dtypes, layout and MMAs: "
                f"leave {', '.join(implied)} unset"
            )
        if self.kv_format == "bf16" and self.equalize_channels:
            raise ValueError("equalize_channels=True needs a quantized kv_format ('k8v8')")

    @property
    def k8v8(self) -> bool:
        """Whether the pools hold the k8v8 format (``kv_format="k8v8"``)."""
        return self.kv_format == "k8v8"

    @property
    def k8v16(self) -> bool:
        """Whether the pools hold the k8v16 format (``kv_format="k8v16"``)."""
        return self.kv_format == "k8v16"

    def channel_equalization(self, kv_dtype: torch.dtype | None = None) -> bool:
        """Whether a cache of ``kv_dtype`` pools (default: ``self.kv_dtype``) equalizes channels:
        ``equalize_channels`` when given, else for int8 pools only; never for float pools."""
        if self.k8v8 or self.k8v16:  # K's factors (V has channel scales, or is unscaled)
            return self.equalize_channels is not False
        kv_dtype = self.kv_dtype if kv_dtype is None else kv_dtype
        if not any(kv_dtype is d for d in KV_DTYPES):
            return False
        if self.equalize_channels is not None:
            return self.equalize_channels
        return True  # int8, the one dequantizing pool (issue 45 deleted e4m3's)

    @property
    def sink_tokens(self) -> int:
        """``S``: tokens of the sink, kept forever."""
        return self.sink_chunks * self.chunk_size

    @property
    def window_tokens(self) -> int:
        """``W``: the most recent tokens kept, the current forward's own included."""
        return self.window_chunks * self.chunk_size

    @property
    def max_forward_tokens(self) -> int:
        """Video tokens of the largest forward."""
        return self.max_forward_chunks * self.chunk_size

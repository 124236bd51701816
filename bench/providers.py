"""Who computes each benchmarked kernel: this project's Triton kernels and the baselines.

The attention baselines are torch SDPA with each backend forced (cuDNN, Flash, Efficient; one
that refuses raises with torch's reasons and the sweep reports it skipped), compiled
FlexAttention over the pool with a paged block mask, and ``flash_attn`` when importable. The
copy kernels have a bound besides: a device copy of the same bytes. ``Bench.backend`` names
what actually ran, for the CSV.

Building a provider does all its set-up (layout changes, pre-gathering, staging buffers, block
masks) and returns a ``Bench`` whose ``run`` closure is the timed region alone. ``run`` returns
the kernel's result; ``to_reference_layout`` turns it into the oracle's layout, untimed.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeAlias

import torch
import torch.nn.functional as F
from torch import Tensor

from paged_video import kernels, reference
from paged_video.bench.formats import DEQUANT, dtype_name
from paged_video.bench.results import QUANTIZED_GOALS
from paged_video.bench.workload import EightBitPools, Geometry, QuantizedPools, Workload
from paged_video.kernels.paged_attention import WS_MAX_STAGES
from paged_video.kernels.value_channels import V_HEADROOM, choose_frozen, frozen_channel_scales

# The one-switch formats of the sweep (``PagingConfig(kv_format=...)``), what each stores.
EIGHT_BIT_FORMATS = {"k8v8": "int8 K, e4m3 V per channel", "k8v16": "int8 K, 16-bit V"}
# Largest float64 score tensor the timed oracle provider may build (it is timed whole).
ORACLE_TIMING_BYTES = 1 << 28

Output: TypeAlias = Tensor | tuple[Tensor, ...]


@dataclass(frozen=True)
class Tile:
    """A ``block_m x block_n`` tile override for the Triton attention kernel."""

    block_m: int
    block_n: int

    def __str__(self) -> str:
        return f"{self.block_m}x{self.block_n}"


def _unchanged(output: Output) -> Output:
    return output


def _always_supported(workload: Workload) -> str | None:
    return None


@dataclass
class Bench:
    """A ready-to-time closure, how to compare what it returns, and what it runs (``backend``)."""

    run: Callable[[], Output]
    to_reference_layout: Callable[[Output], Output] = _unchanged
    backend: str = ""


Builder = Callable[[Workload, "Tile | None"], Bench]


@dataclass(frozen=True)
class Quant:
    """A quantized pool format (``dtype``), dequantized, or one of the one-switch formats
    (``kv_format``: ``k8v8``, int8 K per slot and e4m3 V with frozen channel scales; ``k8v16``,
    int8 K and V as stored; ``dtype`` is then K's, int8); ``keys_major``: both scale pools
    stored keys-major (``kernels.keys_major``), which the TMA loop reads (the table rows say
    where a mode takes it)."""

    dtype: torch.dtype
    keys_major: bool = False
    kv_format: str | None = None

    @property
    def mode(self) -> str:
        """The mode's name (``bench.formats``: ``dequant``, or the one-switch format's name)."""
        if self.kv_format is not None:
            return self.kv_format
        return DEQUANT

    def __str__(self) -> str:
        if self.kv_format is not None:
            return f"{self.kv_format} ({EIGHT_BIT_FORMATS[self.kv_format]})"
        layout = ", keys-major" if self.keys_major else ""
        return f"{dtype_name(self.dtype)} {self.mode}{layout}"


@dataclass(frozen=True)
class Provider:
    """One way of computing ``kernel``.

    ``unsupported`` returns why a workload cannot run (or None). ``role`` (see
    ``bench.results.ROLES``): a ``baseline`` or ``bound`` that fails to build or run is reported
    and skipped; one of this project's kernels (or the oracle) that fails gets a ``FAILED`` row
    and fails the sweep at its end (``bench.sweep``). A ``bound`` is timed but not
    checked (it computes something else with the same bytes). ``tunable`` providers take the
    sweep's tile overrides; ``late`` ones (long compiles) run after every other provider of the
    sweep, so a run cut short has measured the rest. ``quant``: the pool format of a
    ``quantized`` provider (this project's kernel over FP8/INT8 codes, checked against the
    dequantizing oracle and rated against the bf16 pool). ``on_request``: run only when a
    sweep names it (the launch table's candidates). ``allowance``: added to the error limit of
    a peer that quantizes inside (sageattention).
    """

    kernel: str
    name: str
    build: Builder
    unsupported: Callable[[Workload], str | None] = _always_supported
    role: str = "ours"
    tunable: bool = False
    late: bool = False
    quant: Quant | None = None
    on_request: bool = False
    allowance: float = 0.0

    @property
    def skippable(self) -> bool:
        """Whether a failure to build or run is a skip (baselines) rather than an error."""
        return self.role in ("baseline", "bound")


def _tile_arguments(tile: Tile | None) -> dict[str, int]:
    return {} if tile is None else {"block_m": tile.block_m, "block_n": tile.block_n}


def _heads_first_queries(workload: Workload) -> Tensor:
    g = workload.geometry
    return workload.q.view(g.batch, g.q_tokens, g.heads, g.head_dim).transpose(1, 2).contiguous()


def _packed_from_heads_first(geometry: Geometry) -> Callable[[Output], Output]:
    g = geometry
    return lambda out: out.transpose(1, 2).reshape(g.batch * g.q_tokens, g.heads, g.head_dim)


def _sequence_view(stage: Tensor, workload: Workload) -> Tensor:
    """``(batch, kv_heads, kv_tokens, head_dim)`` view of rows staged block after block."""
    g = workload.geometry
    rows = stage.view(g.batch, workload.staged_tokens, g.kv_heads, g.head_dim)
    return rows[:, : g.kv_tokens].transpose(1, 2)


def _sdpa(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """SDPA with torch's own backend choice."""
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=q.shape[1] != k.shape[1])


# The SDPA backends forced one at a time: provider name -> ``SDPBackend`` member name.
SDPA_BACKENDS = {
    "sdpa-cudnn": "CUDNN_ATTENTION",
    "sdpa-flash": "FLASH_ATTENTION",
    "sdpa-efficient": "EFFICIENT_ATTENTION",
}
# Backends torch implements on CUDA only (on a CPU it answers "No viable backend").
CUDA_ONLY_SDPA = frozenset({"sdpa-cudnn", "sdpa-efficient"})
SDPA_BEST = "sdpa-best"


def forced_sdpa(name: str) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
    """SDPA restricted to the backend of provider ``name``; a refusal raises ``RuntimeError``
    carrying torch's own reasons (which it otherwise only warns)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, SDPA_BACKENDS[name])

    def run(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                with sdpa_kernel(backend):
                    return _sdpa(q, k, v)
            except RuntimeError as error:
                reasons = [str(w.message).strip() for w in caught if str(w.message).strip()]
                why = "; ".join(reasons) or str(error).strip()
                raise RuntimeError(f"{SDPA_BACKENDS[name]} refused: {why}") from error

    return run


def sdpa_unsupported(name: str, device: torch.device) -> str | None:
    """Why backend ``name`` cannot run on ``device`` before trying it (None: try it)."""
    if name in CUDA_ONLY_SDPA and device.type != "cuda":
        return f"{SDPA_BACKENDS[name]} runs on CUDA only (torch has no CPU kernel for it)"
    return None


def _stage_buffers(workload: Workload) -> tuple[Tensor, Tensor]:
    """NaN-filled staging buffers, so a row the gather misses cannot pass the check."""
    g = workload.geometry
    shape = (g.batch * workload.staged_tokens, g.kv_heads, g.head_dim)
    fill = dict(dtype=workload.k_cache.dtype, device=workload.k_cache.device)
    return torch.full(shape, math.nan, **fill), torch.full(shape, math.nan, **fill)


# --- paged_attention -----------------------------------------------------------------------


def _paged_bench(
    w: Workload,
    k_cache: Tensor,
    v_cache: Tensor,
    tile: Tile | None,
    backend: str,
    **scales: Tensor | None,
) -> Bench:
    """Our paged attention over ``w``'s sequences in the given pools (and their scales): the
    output buffer and the tile keywords made here, outside the timed call."""
    out = torch.empty_like(w.q)
    tiles = _tile_arguments(tile)

    def run() -> Tensor:
        return kernels.paged_attention(
            w.q,
            k_cache,
            v_cache,
            w.block_table,
            w.cu_seqlens_q,
            w.seq_lens_k,
            max_seqlen_q=w.geometry.q_tokens,
            out=out,
            check_values=False,
            **scales,
            **tiles,
        )

    return Bench(run, backend=backend)


def _build_triton_paged(workload: Workload, tile: Tile | None) -> Bench:
    w = workload
    return _paged_bench(w, w.k_cache, w.v_cache, tile, "triton paged_attention")


# This project's kernel at each launch the launch table can choose (``bench choose`` turns
# their rows into the table): provider name -> the launcher's keywords. ``-ahead``: the
# unmasked loop computes each tile's scores one iteration ahead (``scores_ahead``).
LAUNCH_PROVIDERS: dict[str, dict[str, object]] = {
    "triton-cp_async": {"variant": "cp_async", "block_n": 64, "scores_ahead": False},
    "triton-tma": {"variant": "tma", "block_n": 64, "scores_ahead": False},
    "triton-cp_async-n128": {"variant": "cp_async", "block_n": 128, "scores_ahead": False},
    "triton-tma-n128": {"variant": "tma", "block_n": 128, "scores_ahead": False},
    "triton-ws": {"variant": "ws", "block_n": 64, "scores_ahead": False},
    "triton-ws-n128": {"variant": "ws", "block_n": 128, "scores_ahead": False},
    "triton-cp_async-ahead": {"variant": "cp_async", "block_n": 64, "scores_ahead": True},
    "triton-tma-ahead": {"variant": "tma", "block_n": 64, "scores_ahead": True},
    "triton-cp_async-n128-ahead": {"variant": "cp_async", "block_n": 128, "scores_ahead": True},
    "triton-tma-n128-ahead": {"variant": "tma", "block_n": 128, "scores_ahead": True},
}


def launch_backend(settings: dict[str, object]) -> str:
    """The ``backend`` of a launch provider's rows: the settings the launcher used."""
    return (
        f"triton paged_attention variant={settings['variant']} tile={settings['tile']} "
        f"warps={settings['num_warps']} stages={settings['num_stages']} tma={settings['tma']} "
        f"ahead={settings['ahead']}"
    )


def _launch_provider(name: str, launch: dict[str, object]) -> Provider:
    """Our paged attention forced to one launch (variant and key tile); its rows' ``backend``
    names the launch that ran (the pointer loop where the variant does not apply)."""

    def build(workload: Workload, tile: Tile | None) -> Bench:
        w = workload
        g = w.geometry
        tiles = kernels.choose_tiles(
            block_size=w.block_size,
            head_dim=g.head_dim,
            max_seqlen_q=g.q_tokens,
            dtype=w.q.dtype,
            heads_per_kv_head=g.heads // g.kv_heads,
            **launch,
        )
        out = torch.empty_like(w.q)

        def run() -> Tensor:
            return kernels.paged_attention(
                *w.attention_args(),
                max_seqlen_q=g.q_tokens,
                out=out,
                check_values=False,
                **launch,
            )

        ws = tiles["VARIANT"] == "ws"
        settings = {
            "variant": tiles["VARIANT"],
            "tile": f"{tiles['BLOCK_M']}x{tiles['BLOCK_N']}",
            "num_warps": 4 if ws else tiles["num_warps"],
            # The launcher caps the warp-specialized kernel's stages: name what ran.
            "num_stages": min(tiles["num_stages"], WS_MAX_STAGES) if ws else tiles["num_stages"],
            "tma": "on" if tiles["TMA"] else "off",
            "ahead": "on" if tiles["SCORES_AHEAD"] else "off",
        }
        return Bench(run, backend=launch_backend(settings))

    def unsupported(workload: Workload) -> str | None:
        g = workload.geometry
        if launch["variant"] == "ws" and g.heads != g.kv_heads:
            return "the warp-specialized kernel takes one query head per KV head"
        return None

    return Provider("paged_attention", name, build, unsupported, on_request=True)


def _build_reference_paged(workload: Workload, tile: Tile | None) -> Bench:
    w = workload
    return Bench(
        lambda: reference.paged_attention(*w.attention_args(), max_seqlen_q=w.geometry.q_tokens),
        backend="reference float64",
    )


def quantized_pools(workload: Workload, dtype: torch.dtype) -> QuantizedPools:
    """The workload's whole pools (spare blocks too) written as ``dtype`` codes and scales by
    ``kernels.write_slots`` (no K smoothing: attention is the same with it); made once per
    workload and dtype, shared by the providers and the oracle."""
    w = workload
    if dtype not in w.quantized:
        g = w.geometry
        flat = (-1, g.kv_heads, g.head_dim)
        k_codes = torch.empty(w.k_cache.shape, dtype=dtype, device=w.k_cache.device)
        v_codes = torch.empty_like(k_codes)
        fill = dict(dtype=torch.float32, device=w.k_cache.device)
        k_scale = torch.empty(w.k_cache.shape[:-1], **fill)
        v_scale = torch.empty(w.k_cache.shape[:-1], **fill)
        num_slots = w.k_cache.shape[0] * w.k_cache.shape[1]
        slots = torch.arange(num_slots, dtype=torch.int32, device=w.k_cache.device)
        kernels.write_slots(
            w.k_cache.reshape(flat),
            w.v_cache.reshape(flat),
            k_codes.view(flat),
            v_codes.view(flat),
            slots,
            k_scale=k_scale.view(flat[:-1]),
            v_scale=v_scale.view(flat[:-1]),
            check_values=False,
        )
        w.quantized[dtype] = QuantizedPools(k_codes, v_codes, k_scale, v_scale)
    pools = w.quantized[dtype]
    assert isinstance(pools, QuantizedPools)
    return pools


def eight_bit_pools(workload: Workload, kv_format: str) -> EightBitPools:
    """The workload's whole pools written in ``kv_format`` by ``kernels.write_slots`` in one
    write (slot-major; no K smoothing): int8 K codes and scales per slot; for ``k8v8`` e4m3 V
    codes under frozen channel scales chosen from the sequences' V (``kernels.value_channels``,
    its headroom), for ``k8v16`` V as it is. Made once per workload and format, shared by the
    providers and the oracle."""
    w = workload
    if kv_format not in w.quantized:
        g = w.geometry
        device = w.k_cache.device
        num_slots = w.k_cache.shape[0] * w.k_cache.shape[1]
        slots = torch.arange(num_slots, dtype=torch.int32, device=device)
        flat = (-1, g.kv_heads, g.head_dim)
        k_codes = torch.empty(w.k_cache.shape, dtype=torch.int8, device=device)
        k_scale = torch.empty(w.k_cache.shape[:-1], dtype=torch.float32, device=device)
        v_channel_scale = None
        if kv_format == "k8v8":
            v_cache = torch.empty(w.v_cache.shape, dtype=torch.float8_e4m3fn, device=device)
            v_channel_scale = frozen_channel_scales(
                w.v_cache.shape[0], g.kv_heads, g.head_dim, device
            )
            # Chosen from the sequences' V alone, not the spare blocks: the same scales at every
            # block size, so one oracle serves them all.
            logical = w.values.reshape(flat)
            unused = torch.zeros(logical.shape[0], dtype=torch.int32, device=device)
            choose_frozen(v_channel_scale, logical, unused, V_HEADROOM)
            chosen = {"v_channel_scale": v_channel_scale, "v_scale_chosen": torch.tensor(True)}
        else:
            v_cache = w.v_cache.clone()
            chosen = {}
        kernels.write_slots(
            w.k_cache.reshape(flat), w.v_cache.reshape(flat), k_codes, v_cache, slots,
            k_scale=k_scale,
            check_values=False, **chosen,
        )  # fmt: skip
        w.quantized[kv_format] = EightBitPools(k_codes, v_cache, k_scale, v_channel_scale)
    pools = w.quantized[kv_format]
    assert isinstance(pools, EightBitPools)
    return pools


def _eight_bit_paged_provider(name: str, quant: Quant) -> Provider:
    """Our paged attention over the workload's pools in ``quant.kv_format``, in the cache's
    layout (``paging.cache``): K's scales keys-major, k8v8's V codes keys-major."""
    assert quant.kv_format is not None
    kv_format = quant.kv_format

    def build(workload: Workload, tile: Tile | None) -> Bench:
        w = workload
        pools = eight_bit_pools(w, kv_format)
        v_cache = pools.v_cache
        if kv_format == "k8v8":
            v_cache = kernels.keys_major(v_cache)
        k_scale = kernels.keys_major(pools.k_scale)
        scales = {"k_scale": k_scale, "v_channel_scale": pools.v_channel_scale}
        return _paged_bench(
            w, pools.k_cache, v_cache, tile, f"triton paged_attention {quant}", **scales
        )

    def unsupported(workload: Workload) -> str | None:
        device = workload.q.device
        if kv_format == "k8v8" and device.type == "cuda":
            capability = torch.cuda.get_device_capability(device)
            if capability < (8, 9):
                sm = f"sm_{capability[0]}{capability[1]}"
                return f"k8v8's FP8 MMA needs sm_89 or newer, this GPU is {sm}"
        return None

    return Provider(
        "paged_attention", name, build, unsupported, "quantized", tunable=True, quant=quant
    )


def _quantized_paged_provider(name: str, quant: Quant) -> Provider:
    """Our paged attention over the workload's pools quantized to ``quant``."""

    def build(workload: Workload, tile: Tile | None) -> Bench:
        w = workload
        pools = quantized_pools(w, quant.dtype)
        k_scale, v_scale = pools.k_scale, pools.v_scale
        if quant.keys_major:
            k_scale, v_scale = kernels.keys_major(k_scale), kernels.keys_major(v_scale)
        return _paged_bench(
            w, pools.k_cache, pools.v_cache, tile, f"triton paged_attention {quant}",
            k_scale=k_scale, v_scale=v_scale,
        )  # fmt: skip

    return Provider(
        "paged_attention", name, build, role="quantized", tunable=True, quant=quant,
        on_request=name in ON_REQUEST_QUANTIZED,
    )  # fmt: skip


def _reference_unsupported(workload: Workload) -> str | None:
    g = workload.geometry
    scores = 8 * g.batch * g.heads * g.q_tokens * g.kv_tokens
    if scores > ORACLE_TIMING_BYTES:
        return f"the float64 oracle would hold {scores / 2**30:.1f} GiB of scores; timed small only"
    return None


def pregathered(workload: Workload) -> tuple[Tensor, Tensor, Tensor]:
    """Heads-first q and the sequence's K/V gathered into contiguous tensors (untimed)."""
    q = _heads_first_queries(workload)
    rows = workload.block_ids.long()
    k = _sequence_view(workload.k_cache[rows], workload).contiguous()
    v = _sequence_view(workload.v_cache[rows], workload).contiguous()
    return q, k, v


def torch_sdpa_output(workload: Workload) -> Tensor:
    """Torch's SDPA (its own backend choice) on pre-gathered K/V in the workload's dtype, packed
    as the oracle is: the error every attention provider is measured against."""
    q, k, v = pregathered(workload)
    return _packed_from_heads_first(workload.geometry)(_sdpa(q, k, v))


def _forced_sdpa_provider(name: str) -> Provider:
    def build(workload: Workload, tile: Tile | None) -> Bench:
        q, k, v = pregathered(workload)
        sdpa = forced_sdpa(name)
        return Bench(
            lambda: sdpa(q, k, v), _packed_from_heads_first(workload.geometry), SDPA_BACKENDS[name]
        )

    def unsupported(workload: Workload) -> str | None:
        return sdpa_unsupported(name, workload.q.device)

    return Provider("paged_attention", name, build, unsupported, role="baseline")


def _build_sdpa_with_gather(workload: Workload, tile: Tile | None) -> Bench:
    w = workload
    q = _heads_first_queries(w)
    rows = w.block_ids.long()

    def run() -> Tensor:
        k = _sequence_view(w.k_cache[rows], w)
        v = _sequence_view(w.v_cache[rows], w)
        return _sdpa(q, k, v)

    return Bench(run, _packed_from_heads_first(w.geometry), "index + sdpa (torch's choice)")


# FlexAttention's key tile must be a power of two of at least 16.
FLEX_MIN_TILE = 16
# Key block of the paged block mask when the cache block is not a multiple of 16 keys.
FLEX_UNALIGNED_MASK_BLOCK = 128


def flex_mask_block(block_size: int) -> int:
    """Keys per block of the paged block mask for cache blocks of ``block_size``.

    The cache block itself when it is a multiple of 16 (each mask block is then one cache block,
    full or empty); otherwise 128 pool slots, so a mask block may straddle cache blocks and those
    at the boundaries of the sequence's blocks are partial (decided by the mask function).
    """
    return block_size if block_size % FLEX_MIN_TILE == 0 else FLEX_UNALIGNED_MASK_BLOCK


def flex_key_tile(block_size: int) -> int:
    """FlexAttention's key tile for cache blocks of ``block_size``: it divides the mask block."""
    mask_block = flex_mask_block(block_size)
    return min(64, mask_block & -mask_block)


def flex_paged_inputs(workload: Workload) -> tuple[Tensor, Tensor, Tensor, object]:
    """Queries, the whole pool as one key sequence, and a block mask that pages it.

    Key index ``j`` of the flex call is pool slot ``j``; the mask admits the slots holding the
    sequence's keys (non-causal attention does not depend on the keys' order), and its key
    blocks are ``flex_mask_block`` slots, so blocks outside the table are skipped whole.
    """
    from torch.nn.attention.flex_attention import create_block_mask

    w = workload
    g = w.geometry
    device = w.q.device
    num_slots = w.k_cache.shape[0] * w.block_size
    mask_block = flex_mask_block(w.block_size)
    positions = torch.arange(g.kv_tokens, device=device)
    slots = w.block_table.long()[:, positions // w.block_size] * w.block_size
    slots += positions % w.block_size
    # Padded to whole mask blocks, so the mask function never indexes past the end.
    padded_slots = math.ceil(num_slots / mask_block) * mask_block
    slot_position = torch.full((g.batch, padded_slots), -1, dtype=torch.int32, device=device)
    slot_position.scatter_(1, slots, positions.int().expand(g.batch, -1).contiguous())

    def holds_a_key(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return slot_position[b, kv_idx] >= 0

    block_mask = create_block_mask(
        holds_a_key,
        g.batch,
        None,
        g.q_tokens,
        num_slots,
        device=device,
        BLOCK_SIZE=(128, mask_block),
    )

    def pool_as_sequence(cache: Tensor) -> Tensor:
        flat = cache.view(num_slots, g.kv_heads, g.head_dim).permute(1, 0, 2)
        return flat.unsqueeze(0).expand(g.batch, -1, -1, -1)

    q = _heads_first_queries(w)
    return q, pool_as_sequence(w.k_cache), pool_as_sequence(w.v_cache), block_mask


# Compiles one flex graph may make: one per block size (mask shape, key tile) of a sweep. Past
# dynamo's default of 8 it would fall back to eager flex, which materialises every score.
FLEX_RECOMPILES = 64


@functools.cache
def _compiled_flex_attention() -> Callable[..., Tensor]:
    import torch._dynamo
    from torch.nn.attention.flex_attention import flex_attention

    config = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):  # the name changed across versions
        if hasattr(config, name):
            setattr(config, name, max(getattr(config, name), FLEX_RECOMPILES))
    return torch.compile(flex_attention, dynamic=False)


def _build_flex(workload: Workload, tile: Tile | None) -> Bench:
    q, k, v, block_mask = flex_paged_inputs(workload)
    flex_attention = _compiled_flex_attention()
    options = {"BLOCK_N": flex_key_tile(workload.block_size)}
    gqa = workload.geometry.heads != workload.geometry.kv_heads
    return Bench(
        lambda: flex_attention(
            q, k, v, block_mask=block_mask, enable_gqa=gqa, kernel_options=options
        ),
        _packed_from_heads_first(workload.geometry),
        f"flex mask_block={flex_mask_block(workload.block_size)} BLOCK_N={options['BLOCK_N']}",
    )


def _flex_unsupported(workload: Workload) -> str | None:
    if workload.q.device.type != "cuda":
        return "compiled FlexAttention is timed on a GPU only (a CPU compile takes tens of seconds)"
    return None


def _build_flash_attn(workload: Workload, tile: Tile | None) -> Bench:
    from flash_attn import flash_attn_with_kvcache

    w = workload
    g = w.geometry
    q = w.q.view(g.batch, g.q_tokens, g.heads, g.head_dim)
    return Bench(
        lambda: flash_attn_with_kvcache(
            q, w.k_cache, w.v_cache, cache_seqlens=w.seq_lens_k, block_table=w.block_table
        ),
        lambda out: out.reshape(g.batch * g.q_tokens, g.heads, g.head_dim),
        "flash_attn_with_kvcache",
    )


def _flash_attn_unsupported(workload: Workload) -> str | None:
    if importlib.util.find_spec("flash_attn") is None:
        return "flash_attn is not installed"
    if workload.q.device.type != "cuda":
        return "flash_attn needs a GPU"
    if workload.geometry.dtype not in ("fp16", "bf16"):
        return "flash_attn takes fp16 and bf16 only"
    if workload.block_size % 256:
        return f"flash_attn's paged cache needs block_size % 256 == 0, got {workload.block_size}"
    return None


# --- the peers a user would pick beside ours: carried wheels (bench/peer_wheels.sh) ------------


def _importable(module: str) -> bool:
    """Whether ``module`` (dotted: its parents too) can be imported here."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing; a module without a spec
        return False


SAGEATTENTION = "sageattention"
# SageAttention 1.0.6 rounds Q and K to int8 per block of tokens (K smoothed first) and runs
# P V in 16 bits: its max error against the float64 oracle is the int8 rounding's, which the
# bf16 check would refuse. The allowance holds it to attention over the same keys (a lost
# block or a wrong scale errs by far more); `bench accuracy` measures quantized accuracy.
SAGEATTENTION_ALLOWANCE = 2**-4


def _build_sageattention(workload: Workload, tile: Tile | None) -> Bench:
    from sageattention import sageattn

    q, k, v = pregathered(workload)
    return Bench(
        lambda: sageattn(q, k, v, tensor_layout="HND", is_causal=False),
        _packed_from_heads_first(workload.geometry),
        "sageattention 1.0.6 sageattn: int8 Q K^T per block, pre-gathered K/V",
    )


def _sageattention_unsupported(workload: Workload) -> str | None:
    if not _importable(SAGEATTENTION):
        return "sageattention is not installed (bench/peer_wheels.sh downloads its wheel)"
    if workload.q.device.type != "cuda":
        return "sageattention runs on a GPU only (its launcher asserts CUDA tensors)"
    if workload.geometry.dtype not in ("fp16", "bf16"):
        return "sageattention is timed on fp16 and bf16 only"
    return None


FLASH_ATTN_4 = "flash_attn.cute"


def _build_flash_attn_4(workload: Workload, tile: Tile | None) -> Bench:
    from flash_attn.cute import flash_attn_varlen_func

    w = workload
    g = w.geometry
    q = w.q.view(g.batch, g.q_tokens, g.heads, g.head_dim)
    # FA4 reads whole pages by TMA: rows past a sequence's length must be finite (its docs);
    # the workload's pools hold random values everywhere.
    k_pages, v_pages = w.k_cache, w.v_cache
    table = w.block_table.to(torch.int32)
    seq_lens = w.seq_lens_k.to(torch.int32)

    def run() -> Tensor:
        out = flash_attn_varlen_func(
            q, k_pages, v_pages, seqused_k=seq_lens, page_table=table, causal=False
        )
        return out[0] if isinstance(out, tuple) else out

    return Bench(
        run,
        lambda out: out.reshape(g.batch * g.q_tokens, g.heads, g.head_dim),
        f"flash_attn.cute flash_attn_varlen_func, page_table of {w.block_size}-slot pages",
    )


def _flash_attn_4_unsupported(workload: Workload) -> str | None:
    if not _importable(FLASH_ATTN_4):
        return (
            "flash-attn-4 (flash_attn.cute) is not installed (bench/peer_wheels.sh: its wheels"
            " are carried over the two calls)"
        )
    if workload.q.device.type != "cuda":
        return "FlashAttention-4 runs on a GPU only (CuTe DSL kernels)"
    if workload.geometry.dtype not in ("fp16", "bf16"):
        return "FlashAttention-4 takes fp16 and bf16 only"
    return None


# --- staged: gather the visible blocks, then attend over contiguous K/V -----------------------


# Each sequence's staging region is padded to a multiple of this, so the stage can be handed to
# the attention kernel as blocks of this size and take its contiguous-tile path.
STAGE_ALIGN = 256


def _padded_stage(workload: Workload) -> tuple[Callable[[], None], Tensor, Tensor]:
    """Per-sequence staging regions of whole ``STAGE_ALIGN`` blocks (NaN in the padding).

    Returns the gather (one ``gather_blocks`` per sequence) and the K/V regions as
    ``(batch, padded_tokens, kv_heads, head_dim)``.
    """
    w = workload
    g = w.geometry
    padded = math.ceil(w.staged_tokens / STAGE_ALIGN) * STAGE_ALIGN
    shape = (g.batch, padded, g.kv_heads, g.head_dim)
    fill = dict(dtype=w.k_cache.dtype, device=w.k_cache.device)
    k_rows, v_rows = torch.full(shape, math.nan, **fill), torch.full(shape, math.nan, **fill)
    regions = [(w.block_table[seq], k_rows[seq], v_rows[seq]) for seq in range(g.batch)]

    def gather() -> None:
        for block_ids, stage_k, stage_v in regions:
            kernels.gather_blocks(
                w.k_cache, w.v_cache, block_ids, stage_k, stage_v, check_values=False
            )

    return gather, k_rows, v_rows


def _build_staged_triton(workload: Workload, tile: Tile | None) -> Bench:
    w = workload
    g = w.geometry
    gather, k_rows, v_rows = _padded_stage(w)
    blocks = (-1, STAGE_ALIGN, g.kv_heads, g.head_dim)
    k_blocks, v_blocks = k_rows.view(blocks), v_rows.view(blocks)
    device = w.q.device
    stage_table = torch.arange(k_blocks.shape[0], dtype=torch.int32, device=device)
    stage_table = stage_table.view(g.batch, -1)
    out = torch.empty_like(w.q)
    tiles = _tile_arguments(tile)

    def run() -> Tensor:
        gather()
        return kernels.paged_attention(
            w.q,
            k_blocks,
            v_blocks,
            stage_table,
            w.cu_seqlens_q,
            w.seq_lens_k,
            max_seqlen_q=g.q_tokens,
            out=out,
            check_values=False,
            **tiles,
        )

    return Bench(run, backend="triton gather_blocks + paged_attention")


def _build_staged_sdpa(workload: Workload, tile: Tile | None) -> Bench:
    w = workload
    kv_tokens = w.geometry.kv_tokens
    gather, k_rows, v_rows = _padded_stage(w)
    q = _heads_first_queries(w)
    k, v = k_rows[:, :kv_tokens].transpose(1, 2), v_rows[:, :kv_tokens].transpose(1, 2)

    def run() -> Tensor:
        gather()
        return _sdpa(q, k, v)

    return Bench(run, _packed_from_heads_first(w.geometry), "gather_blocks + sdpa (torch's choice)")


# --- gather_blocks ---------------------------------------------------------------------------


def _build_gather_triton(workload: Workload, tile: Tile | None) -> Bench:
    w = workload
    stage_k, stage_v = _stage_buffers(w)

    def run() -> tuple[Tensor, Tensor]:
        kernels.gather_blocks(
            w.k_cache, w.v_cache, w.block_ids, stage_k, stage_v, check_values=False
        )
        return stage_k, stage_v

    return Bench(run, backend="triton gather_blocks")


def _build_gather_torch(workload: Workload, tile: Tile | None) -> Bench:
    w = workload
    stage_k, stage_v = _stage_buffers(w)
    block_shape = (-1, *w.k_cache.shape[1:])
    k_blocks, v_blocks = stage_k.view(block_shape), stage_v.view(block_shape)
    rows = w.block_ids.long()

    def run() -> tuple[Tensor, Tensor]:
        torch.index_select(w.k_cache, 0, rows, out=k_blocks)
        torch.index_select(w.v_cache, 0, rows, out=v_blocks)
        return stage_k, stage_v

    return Bench(run, backend="torch.index_select")


# --- write_slots -----------------------------------------------------------------------------


def _fresh_pools(workload: Workload) -> tuple[Tensor, Tensor]:
    g = workload.geometry
    flat = (-1, g.kv_heads, g.head_dim)
    return workload.k_cache.reshape(flat).clone(), workload.v_cache.reshape(flat).clone()


def _build_write_triton(workload: Workload, tile: Tile | None) -> Bench:
    w = workload
    k_pool, v_pool = _fresh_pools(w)

    def run() -> tuple[Tensor, Tensor]:
        kernels.write_slots(
            w.new_keys, w.new_values, k_pool, v_pool, w.write_slot_mapping, check_values=False
        )
        return k_pool, v_pool

    return Bench(run, backend="triton write_slots")


def _build_write_torch(workload: Workload, tile: Tile | None) -> Bench:
    w = workload
    k_pool, v_pool = _fresh_pools(w)

    def run() -> tuple[Tensor, Tensor]:
        k_pool.index_copy_(0, w.write_slot_mapping, w.new_keys)
        v_pool.index_copy_(0, w.write_slot_mapping, w.new_values)
        return k_pool, v_pool

    return Bench(run, backend="torch.index_copy_")


# --- the bound of the copy kernels: a plain device copy of the same bytes ----------------------


def _copy_bound(copied_bytes: Callable[[Workload], int]) -> Builder:
    """A contiguous ``Tensor.copy_`` reading and writing as many bytes as the kernel must: the
    bandwidth the copy kernels aim for. Its result is not the kernel's and is not checked."""

    def build(workload: Workload, tile: Tile | None) -> Bench:
        source = torch.empty(copied_bytes(workload), dtype=torch.uint8, device=workload.q.device)
        source.random_(0, 255)
        target = torch.empty_like(source)
        return Bench(lambda: target.copy_(source), backend="Tensor.copy_ of the same bytes")

    return build


def _staged_bytes(workload: Workload) -> int:
    """Bytes ``gather_blocks`` copies: every visible block of K and V."""
    g = workload.geometry
    item = workload.k_cache.element_size()
    return 2 * g.batch * workload.staged_tokens * g.kv_heads * g.head_dim * item


def _chunk_bytes(workload: Workload) -> int:
    """Bytes ``write_slots`` copies: the new chunk's K and V."""
    return 2 * workload.new_keys.numel() * workload.new_keys.element_size()


# Our paged attention over quantized pools, by provider name (their goals: QUANTIZED_GOALS).
QUANTIZED_PROVIDERS = {
    "triton-int8": Quant(torch.int8),
    "triton-int8-keys": Quant(torch.int8, keys_major=True),
    "triton-k8v8": Quant(torch.int8, kv_format="k8v8"),
    "triton-k8v16": Quant(torch.int8, kv_format="k8v16"),
}
assert set(QUANTIZED_PROVIDERS) == set(QUANTIZED_GOALS)
# Run only when named (the GPU check's launch probe does): the dequantizing loop over
# keys-major scales, which compiles shorter on Triton 3.6 (the since deleted e4m3 pool per 64
# keys at block 256: 572 by the 64-key pointer loop, 438 by TMA at 128 keys, against 643 over
# slot-major scales), untimed yet; the default sweep keeps its time for the cases it has always
# covered.
ON_REQUEST_QUANTIZED = ("triton-int8-keys",)
BASELINE = "baseline"
PROVIDERS: tuple[Provider, ...] = (
    Provider("paged_attention", "triton", _build_triton_paged, tunable=True),
    Provider(
        "paged_attention", "reference", _build_reference_paged, _reference_unsupported, "oracle"
    ),
    *(_forced_sdpa_provider(name) for name in SDPA_BACKENDS),
    Provider("paged_attention", "sdpa+gather", _build_sdpa_with_gather, role=BASELINE),
    *(
        (_quantized_paged_provider if quant.kv_format is None else _eight_bit_paged_provider)(
            name, quant
        )
        for name, quant in QUANTIZED_PROVIDERS.items()
    ),
    *(_launch_provider(name, launch) for name, launch in LAUNCH_PROVIDERS.items()),
    Provider("paged_attention", "flash_attn", _build_flash_attn, _flash_attn_unsupported, BASELINE),
    Provider(
        "paged_attention",
        "sageattention",
        _build_sageattention,
        _sageattention_unsupported,
        BASELINE,
        allowance=SAGEATTENTION_ALLOWANCE,
    ),
    Provider(
        "paged_attention", "flash-attn-4", _build_flash_attn_4, _flash_attn_4_unsupported, BASELINE
    ),
    Provider("paged_attention", "flex", _build_flex, _flex_unsupported, BASELINE, late=True),
    Provider("staged", "triton", _build_staged_triton, tunable=True),
    Provider("staged", "triton+sdpa", _build_staged_sdpa, role=BASELINE),
    Provider("gather_blocks", "triton", _build_gather_triton),
    Provider("gather_blocks", "torch", _build_gather_torch, role=BASELINE),
    Provider("gather_blocks", "copy", _copy_bound(_staged_bytes), role="bound"),
    Provider("write_slots", "triton", _build_write_triton),
    Provider("write_slots", "torch", _build_write_torch, role=BASELINE),
    Provider("write_slots", "copy", _copy_bound(_chunk_bytes), role="bound"),
)
# ``sdpa-best`` is no provider of its own: the sweep repeats the fastest forced SDPA backend of
# each case under that name. Asking for it runs the three.
PROVIDER_NAMES = (*dict.fromkeys(p.name for p in PROVIDERS), SDPA_BEST)

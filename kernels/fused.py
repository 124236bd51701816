"""The fused write+attend op: one ``torch.library`` custom op per attention layer call.

It writes the current video (and action) K/V into the paged pools with ``write_slots`` and then
attends, either straight over the paged cache or, with history staging, after
``gather_blocks`` restages the window into contiguous buffers. Being one opaque op, a compiled
transformer block stays one graph (``fullgraph=True``).

Why the odd-looking choices:

* The pools of every layer are one stacked tensor and the layer index is a 0-dim CPU tensor,
  so one compiled graph serves every layer: a Python int would be specialised per value.
* The first block to restage is a 0-dim CPU tensor for the same reason (-1: no staging), and
  so is the id of the history the forward stages (``stage_key``).
* What each layer's staging buffers hold is recorded here, by the code that writes them, in
  ``stage_tags`` (int64, CPU, one id per layer): a layer restages from ``stage_from`` only when
  its tag is the forward's ``stage_key``, else from block 0, and its tag becomes the key once
  the restage is done. Attending without staging sets the tag to -1 (nothing reusable), as does
  a call that fails part way, so no later forward keeps rows that nothing filled.
* Quantized pools (docs/quantization.md) hold codes with a float32 scale per (slot, KV head) beside
  them; the staging buffers hold codes too, with stage scales. K smoothing: each layer's mean
  ``k_means[layer]`` (``(num_kv_heads, head_dim)``) is subtracted from K before quantizing. It
  is chosen by the first call that writes video keys to the layer (the mean of that call's
  finite video keys, per KV head) and frozen by ``k_means_chosen[layer]``, a CPU flag like the
  tags: reading it costs no sync, and later calls skip the reduction.
* Channel equalization: each layer's factors ``k_equalizers[layer]``/``v_equalizers[layer]``
  divide K (after the mean) and V before quantizing and are folded back into q and the output
  by attention. The first call that writes video keys chooses them from those rows (after the
  mean), and ``equalizers_chosen[layer]``, a CPU flag, freezes them like the mean; a later call
  whose video rows are many times wider regrows them (``kernels.regrow``: the stored codes of
  that KV head rescaled, the staged copies too, on the device with no sync).
  ``write_slots`` owns both the mean and the factors (``k_smooth_chosen``,
  ``equalizers_chosen``), so a driver that writes the cache without this op agrees. A call that
  writes only some of the forward's video tokens (one rank of a sequence-sharded window) gets
  the single process's slots in ``choice_slots`` and chooses, or regrows, from those rows
  first.
* Every argument is checked before the first write: a refused call leaves the pools, scales,
  means, flags, the staging buffers and the tags as they were, and names the argument as the
  caller wrote it.
* The op's arguments are the five K/V tensors, then ``PoolTensors``, then ``LayerInputs``:
  the schema is built from those two NamedTuples, so the list is written down once.
* Mutable arguments have no default values: older PyTorch strips trailing defaults before its
  mutation handlers index the arguments.
* The op always returns ``(out, lse)``: ``lse`` is the float32 ``(q, H)`` log-sum-exp when
  ``return_lse`` is set and zero-size otherwise. A fixed output list keeps one schema (and one
  compiled graph per value of the flag, which a model does not change); ``write_attend``
  returns ``out`` alone unless asked, so callers that do not ask are unchanged.
* Registration is guarded, so re-importing (or reloading) this module does not raise.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, get_type_hints

import torch
from torch import Tensor

from paged_video._removed import refuse_e4m3_pool, refuse_removed
from paged_video.kernels import _checks
from paged_video.kernels._attention_checks import check_arguments as check_attention_arguments
from paged_video.kernels.gather_blocks import gather_blocks
from paged_video.kernels.paged_attention import paged_attention
from paged_video.kernels.quantize import SCALE_DTYPE, check_scales, is_quantized
from paged_video.kernels.value_channels import is_frozen
from paged_video.kernels.write_slots import choose_unset, regrow_chosen, write_slots

NAMESPACE = "paged_video"
OP_NAME = "write_attend"
QUALIFIED_NAME = f"{NAMESPACE}::{OP_NAME}"
NOTHING_STAGED = -1
KV_ARGS = ("query", "key", "value", "action_key", "action_value")


class PoolTensors(NamedTuple):
    """Every cache tensor the op reads or writes, all mutated (``L`` layers, ``N`` blocks of
    ``B`` slots, ``H`` KV heads, ``D`` head_dim, ``T`` staging rows per layer).

    ``k_pools``/``v_pools`` ``(L, N, B, H, D)``; ``stage_k``/``stage_v`` ``(L, T, H, D)`` (``T``
    may be 0 when staging is off). Quantized pools only, zero-size otherwise:
    ``k_scales``/``v_scales`` ``(L, N, B, H)`` float32; ``stage_k_scales``/``stage_v_scales``
    ``(L, T, H)`` float32; ``k_means`` ``(L, H, D)`` float32 and ``k_means_chosen`` ``(L,)`` bool
    on the CPU (both zero-size when keys are not smoothed); ``k_equalizers``/``v_equalizers``
    ``(L, H, D)`` float32 and ``equalizers_chosen`` ``(L,)`` bool on the CPU (all zero-size
    without channel equalization). The k8v8 format (int8 ``k_pools``, e4m3 ``v_pools``, no
    ``v_scales``) only, zero-size otherwise: ``v_channel_scales`` ``(L, N, H, D)`` float32
    (V's scales per block and channel: frozen ones with block stride 0), ``v_scales_chosen``
    ``(L,)`` bool on the CPU, ``v_saturated`` ``(L,)`` int32 (V elements written saturated).
    """

    k_pools: Tensor
    v_pools: Tensor
    stage_k: Tensor
    stage_v: Tensor
    k_scales: Tensor
    v_scales: Tensor
    stage_k_scales: Tensor
    stage_v_scales: Tensor
    k_means: Tensor
    k_means_chosen: Tensor
    k_equalizers: Tensor
    v_equalizers: Tensor
    equalizers_chosen: Tensor
    v_channel_scales: Tensor
    v_scales_chosen: Tensor
    v_saturated: Tensor

    @classmethod
    def build(
        cls,
        k_pools: Tensor,
        v_pools: Tensor,
        stage_k: Tensor,
        stage_v: Tensor,
        **quantized: Tensor,
    ) -> PoolTensors:
        """The four K/V tensors plus the quantized ones given by name; the others zero-size."""
        unknown = set(quantized) - set(cls._fields[4:])
        if unknown:
            raise TypeError(f"unknown pool tensors {sorted(unknown)}")
        _checks.check_tensor("k_pools", k_pools)

        def empty(name: str) -> Tensor:
            if name in CPU_FLAGS:
                return torch.empty(0, dtype=torch.bool)
            if name == "v_saturated":
                return k_pools.new_empty(0, dtype=torch.int32)
            return k_pools.new_empty(0, dtype=SCALE_DTYPE)

        rest = [quantized[name] if name in quantized else empty(name) for name in cls._fields[4:]]
        return cls(k_pools, v_pools, stage_k, stage_v, *rest)


class LayerInputs(NamedTuple):
    """Per-forward inputs of the fused op, shared by every layer but ``layer``.

    ``key_gap`` is ``(rows, 2)`` or ``(rows, gaps, 2)`` int32 of hidden key ranges, or None;
    ``stage_from`` is the first block-table entry to restage when the layer's staging buffers
    hold the history ``stage_key`` names (any other layer restages all), or -1 to attend
    without staging; ``stage_tags`` is the cache's record of what each layer's buffers hold
    (mutated); ``fp8_mma`` was deleted (issue 45: True raises a ``ValueError`` naming
    ``kv_format="k8v8"``); ``return_lse``
    also returns each query row's log-sum-exp (see ``paged_attention``); ``int8_mma`` was
    deleted (True raises, naming ``kv_format="k8v16"``). ``choice_slots`` (``video_slots``'s
    shape, or None) are the single process's slots of the forward's video tokens where
    ``video_slots`` writes only some of them (one rank of a sequence-sharded window, ``-1`` for
    the others'): a layer's first write chooses what it freezes (the K mean, the factors) from
    the rows these give a slot, so every rank chooses what one process does.
    """

    layer: Tensor
    video_slots: Tensor
    action_slots: Tensor
    block_table: Tensor
    cu_seqlens_q: Tensor
    seq_lens_k: Tensor
    key_gap: Tensor | None
    stage_from: Tensor
    stage_key: Tensor
    stage_tags: Tensor
    max_seqlen_q: int
    softmax_scale: float
    fp8_mma: bool = False
    return_lse: bool = False
    int8_mma: bool = False
    choice_slots: Tensor | None = None


MUTATED_ARGS = (*PoolTensors._fields, "stage_tags")
# Pool tensors that are flags read on the host (as the tags are): they live on the CPU,
# whatever device the pools are on.
CPU_FLAGS = ("k_means_chosen", "equalizers_chosen", "v_scales_chosen")


def _on_device(pools: PoolTensors) -> dict[str, Tensor]:
    """The pool tensors that live on the pools' device: all but ``CPU_FLAGS``."""
    return {name: t for name, t in pools._asdict().items() if name not in CPU_FLAGS}


# Schema types of the fields' annotations, as torch's own schema inference spells them.
_SCHEMA_TYPES = {
    Tensor: "Tensor",
    Tensor | None: "Tensor?",
    int: "SymInt",
    float: "float",
    bool: "bool",
}


def _schema() -> str:
    """The op's schema: the five K/V tensors, then ``PoolTensors``, then ``LayerInputs``."""
    types = dict.fromkeys(KV_ARGS, Tensor) | get_type_hints(PoolTensors)
    types |= get_type_hints(LayerInputs)
    args = []
    for i, (name, hint) in enumerate(types.items()):
        kind = _SCHEMA_TYPES[hint] + (f"(a{i}!)" if name in MUTATED_ARGS else "")
        args.append(f"{kind} {name}")
    return f"({', '.join(args)}) -> (Tensor, Tensor)"


def _split(args: tuple) -> tuple[list[Tensor], PoolTensors, LayerInputs]:
    """The op's flat arguments as the K/V tensors, ``PoolTensors`` and ``LayerInputs``."""
    kv, pools = len(KV_ARGS), len(PoolTensors._fields)
    return list(args[:kv]), PoolTensors(*args[kv : kv + pools]), LayerInputs(*args[kv + pools :])


def _check_scalar(name: str, value: object) -> int:
    """A 0-dim integer CPU tensor (read without a device sync) as an int."""
    _checks.check_tensor(name, value)
    if value.dim() != 0 or value.device.type != "cpu" or value.is_floating_point():
        raise ValueError(
            f"{name} must be a 0-dim integer tensor on the CPU, got shape {tuple(value.shape)} "
            f"{value.dtype} on {value.device}"
        )
    return int(value)


def _check_zero_size(names: tuple[str, ...], pools: PoolTensors, why: str) -> None:
    for name in names:
        tensor = getattr(pools, name)
        if tensor.numel():
            raise ValueError(f"{name} must be zero-size {why}, got shape {tuple(tensor.shape)}")


def _check_quantized_pools(pools: PoolTensors) -> tuple[bool, bool]:
    """Scales, means and factors match the pools (zero-size for float pools); returns whether
    K is smoothed and whether channels are equalized."""
    k_pools, v_pools = pools.k_pools, pools.v_pools
    if not is_quantized(k_pools.dtype):
        _check_zero_size(PoolTensors._fields[4:], pools, f"for {k_pools.dtype} pools")
        return False, False
    check_scales("k_scales", pools.k_scales, "k_pools", k_pools)
    if _k8v8(pools):
        _check_zero_size(("v_scales", "stage_v_scales"), pools, "for k8v8 pools")
        _check_k8v8_state(pools)
    elif _k8v16(pools):
        _check_zero_size(("v_scales", "stage_v_scales", *K8V8_FIELDS), pools, "for k8v16 pools")
    else:
        _check_zero_size(K8V8_FIELDS, pools, f"for {v_pools.dtype} V pools")
        check_scales("v_scales", pools.v_scales, "v_pools", v_pools)
    smoothed = _check_layer_state(pools, ("k_means",), "k_means_chosen", "keys not smoothed")
    equalized = _check_layer_state(
        pools, ("k_equalizers", "v_equalizers"), "equalizers_chosen", "channels not equalized"
    )
    return smoothed, equalized


K8V8_FIELDS = ("v_channel_scales", "v_scales_chosen", "v_saturated")


def _k8v8(pools: PoolTensors) -> bool:
    """Whether the pools hold the k8v8 format: V's channel scales given."""
    return pools.v_channel_scales.numel() > 0


def _k8v16(pools: PoolTensors) -> bool:
    """Whether the pools hold the k8v16 format: int8 K codes, V in a float dtype."""
    return pools.k_pools.dtype == torch.int8 and pools.v_pools.dtype.is_floating_point


def _check_k8v8_state(pools: PoolTensors) -> None:
    """The k8v8 pools' dtypes, V's channel scales, their CPU flags and the saturation counts."""
    if pools.k_pools.dtype != torch.int8 or pools.v_pools.dtype != torch.float8_e4m3fn:
        raise TypeError(
            "v_channel_scales (k8v8) need int8 k_pools and float8_e4m3fn v_pools, got "
            f"{pools.k_pools.dtype} and {pools.v_pools.dtype}"
        )
    num_layers, num_blocks, _, num_kv_heads, head_dim = pools.k_pools.shape
    wanted = (num_layers, num_blocks, num_kv_heads, head_dim)
    _checks.check_dtype("v_channel_scales", pools.v_channel_scales, (SCALE_DTYPE,))
    if tuple(pools.v_channel_scales.shape) != wanted:
        raise ValueError(
            f"v_channel_scales must have shape {wanted} (layers, num_blocks, num_kv_heads, "
            f"head_dim), got {tuple(pools.v_channel_scales.shape)}"
        )
    chosen, counts = pools.v_scales_chosen, pools.v_saturated
    _checks.check_dtype("v_scales_chosen", chosen, (torch.bool,))
    if chosen.shape != (num_layers,) or chosen.device.type != "cpu":
        raise ValueError(
            f"v_scales_chosen must be a CPU tensor of shape ({num_layers},), got "
            f"{tuple(chosen.shape)} on {chosen.device}"
        )
    _checks.check_dtype("v_saturated", counts, (torch.int32,))
    if counts.shape != (num_layers,):
        raise ValueError(f"v_saturated must have shape ({num_layers},), got {tuple(counts.shape)}")


def _check_layer_state(
    pools: PoolTensors, names: tuple[str, ...], flag_name: str, why_empty: str
) -> bool:
    """Per-layer ``(L, H, D)`` float32 tensors ``names`` and their ``(L,)`` CPU bool flag, or
    all zero-size; returns whether they are given."""
    if getattr(pools, names[0]).numel() == 0:
        _check_zero_size((*names[1:], flag_name), pools, f"when {names[0]} is ({why_empty})")
        return False
    num_layers, _, _, num_kv_heads, head_dim = pools.k_pools.shape
    wanted = (num_layers, num_kv_heads, head_dim)
    for name in names:
        tensor = getattr(pools, name)
        _checks.check_dtype(name, tensor, (SCALE_DTYPE,))
        if tensor.shape != wanted:
            raise ValueError(
                f"{name} must have shape {wanted} (layers, num_kv_heads, head_dim), got "
                f"{tuple(tensor.shape)}"
            )
    flag = getattr(pools, flag_name)
    _checks.check_dtype(flag_name, flag, (torch.bool,))
    if flag.shape != (num_layers,) or flag.device.type != "cpu":
        raise ValueError(
            f"{flag_name} must be a CPU tensor of shape ({num_layers},) (one flag per layer), "
            f"got {tuple(flag.shape)} on {flag.device}"
        )
    return True


def _check_staging(
    query: Tensor, pools: PoolTensors, block_table: Tensor, first_block: int
) -> None:
    """The staging buffers (and their scales) fit a one-row forward restaging from
    ``first_block``."""
    k_pools, stage_k, stage_v = pools.k_pools, pools.stage_k, pools.stage_v
    num_layers, _, block_size, num_kv_heads, head_dim = k_pools.shape
    staging = "(layers, tokens, num_kv_heads, head_dim)"
    _checks.check_rank("stage_k", stage_k, 4, staging)
    _checks.check_rank("stage_v", stage_v, 4, staging)
    if stage_v.shape != stage_k.shape:
        raise ValueError(
            f"stage_v shape {tuple(stage_v.shape)} must equal stage_k shape {tuple(stage_k.shape)}"
        )
    width = block_table.shape[1]
    wanted = (num_layers, width * block_size, num_kv_heads, head_dim)
    if stage_k.shape[0] != num_layers or stage_k.shape[2:] != wanted[2:]:
        raise ValueError(f"stage_k must have shape {wanted}, got {tuple(stage_k.shape)}")
    if stage_k.shape[1] < wanted[1]:
        raise ValueError(
            f"stage_k has {stage_k.shape[1]} rows per layer; a block_table of width {width} "
            f"and blocks of {block_size} need {wanted[1]}"
        )
    quantized = is_quantized(k_pools.dtype)
    for name, tensor, pool in (("stage_k", stage_k, k_pools), ("stage_v", stage_v, pools.v_pools)):
        dtype = pool.dtype if quantized else query.dtype  # (k8v8, k8v16: V's own dtype)
        if tensor.dtype != dtype:
            raise TypeError(f"{name} must have the pools' dtype {dtype}, got {tensor.dtype}")
    if quantized:
        check_scales("stage_k_scales", pools.stage_k_scales, "stage_k", stage_k)
    if quantized and not (_k8v8(pools) or _k8v16(pools)):  # (their V has no scale per slot)
        check_scales("stage_v_scales", pools.stage_v_scales, "stage_v", stage_v)
    if _k8v8(pools) and not is_frozen(pools.v_channel_scales[0]):
        raise ValueError(
            "history staging (stage_from >= 0) needs k8v8's frozen v_channel_scales (block "
            "stride 0): per-block scales are not staged"
        )
    if block_table.shape[0] != 1:
        raise ValueError(
            f"block_table must have one row with history staging (stage_from >= 0), got "
            f"{block_table.shape[0]}"
        )
    if first_block > width:
        raise ValueError(f"stage_from must be in -1..{width}, got {first_block}")


def _check_inputs(
    kv: list[Tensor], pools: PoolTensors, inputs: LayerInputs
) -> tuple[int, int, bool, bool]:
    """Check every argument before the first write; returns ``(layer, stage_from, smoothed,
    equalized)``.

    The kernels check their own arguments again, under their own names; by then nothing they
    check can fail, so no call writes half its work.
    """
    query, key, value, action_key, action_value = kv
    k_pools, v_pools = pools.k_pools, pools.v_pools
    layout = "(layers, num_blocks, block_size, num_kv_heads, head_dim)"
    _checks.check_rank("k_pools", k_pools, 5, layout)
    _checks.check_rank("v_pools", v_pools, 5, layout)
    if v_pools.shape != k_pools.shape:
        raise ValueError(
            f"v_pools shape {tuple(v_pools.shape)} must equal k_pools shape {tuple(k_pools.shape)}"
        )
    if k_pools.data_ptr() == v_pools.data_ptr() and k_pools.numel() > 0:
        raise ValueError("k_pools and v_pools must be separate tensors, not the same memory")
    if v_pools.dtype != k_pools.dtype and not (_k8v8(pools) or _k8v16(pools)):
        raise TypeError(f"v_pools must have k_pools' dtype {k_pools.dtype}, got {v_pools.dtype}")
    num_layers, _, _, num_kv_heads, head_dim = k_pools.shape
    layer_index = _check_scalar("layer", inputs.layer)
    if not 0 <= layer_index < num_layers:
        raise ValueError(
            f"layer must be in 0..{num_layers - 1} (the pools' layers), got {layer_index}"
        )
    first_block = _check_scalar("stage_from", inputs.stage_from)
    _check_scalar("stage_key", inputs.stage_key)
    stage_tags = inputs.stage_tags
    _checks.check_rank("stage_tags", stage_tags, 1, "(layers,)")
    _checks.check_dtype("stage_tags", stage_tags, (torch.int64,))
    if stage_tags.shape[0] != num_layers or stage_tags.device.type != "cpu":
        raise ValueError(
            f"stage_tags must be a CPU tensor of shape ({num_layers},), got "
            f"{tuple(stage_tags.shape)} on {stage_tags.device}"
        )
    for name, tensor in zip(KV_ARGS[1:], kv[1:], strict=True):
        _checks.check_rank(name, tensor, 3, "(num_tokens, num_kv_heads, head_dim)")
        _checks.check_dtype(name, tensor, _checks.FLOAT_DTYPES)
        if tensor.shape[1:] != (num_kv_heads, head_dim):
            raise ValueError(
                f"{name} must have shape (num_tokens, {num_kv_heads}, {head_dim}) (the pools' "
                f"num_kv_heads, head_dim), got {tuple(tensor.shape)}"
            )
    for name, tensor, slots_name, slots in (
        ("key", key, "video_slots", inputs.video_slots),
        ("action_key", action_key, "action_slots", inputs.action_slots),
    ):
        _checks.check_rank(slots_name, slots, 1, "(num_tokens,)")
        _checks.check_dtype(slots_name, slots, _checks.INDEX_DTYPES)
        if tensor.shape[0] != slots.shape[0]:
            raise ValueError(
                f"{name} must have one row per entry of {slots_name} ({slots.shape[0]}), "
                f"got {tensor.shape[0]}"
            )
    if inputs.choice_slots is not None:
        _checks.check_rank("choice_slots", inputs.choice_slots, 1, "(num_tokens,)")
        _checks.check_dtype("choice_slots", inputs.choice_slots, _checks.INDEX_DTYPES)
        if inputs.choice_slots.shape != inputs.video_slots.shape:
            raise ValueError(
                f"choice_slots must have video_slots' shape {tuple(inputs.video_slots.shape)}, "
                f"got {tuple(inputs.choice_slots.shape)}"
            )
    for name, tensor, like_name, like in (
        ("value", value, "key", key),
        ("action_value", action_value, "action_key", action_key),
    ):
        if tensor.shape != like.shape:
            raise ValueError(
                f"{name} shape {tuple(tensor.shape)} must equal {like_name} shape "
                f"{tuple(like.shape)}"
            )
    _checks.check_rank("query", query, 3, "(num_tokens, num_heads, head_dim)")
    _checks.check_dtype("query", query, _checks.FLOAT_DTYPES)
    if query.shape[0] != key.shape[0] or query.shape[2] != head_dim:
        raise ValueError(
            f"query must have shape ({key.shape[0]}, num_heads, {head_dim}) (one row per video "
            f"token, the pools' head_dim), got {tuple(query.shape)}"
        )
    if query.shape[1] % num_kv_heads:
        raise ValueError(
            f"query num_heads {query.shape[1]} must be a multiple of num_kv_heads {num_kv_heads}"
        )
    # k8v8's V holds e4m3 codes of channel scales; e4m3 beside per-slot scales was deleted.
    refuse_e4m3_pool("k_pools", k_pools.dtype)
    if not _k8v8(pools):
        refuse_e4m3_pool("v_pools", pools.v_pools.dtype)
    quantized = is_quantized(k_pools.dtype)
    if not quantized and k_pools.dtype != query.dtype:
        raise TypeError(f"k_pools must have query's dtype {query.dtype}, got {k_pools.dtype}")
    smoothed, equalized = _check_quantized_pools(pools)
    refuse_removed(fp8_mma=inputs.fp8_mma, int8_mma=inputs.int8_mma)
    k8v8 = _k8v8(pools)
    v_unscaled = k8v8 or _k8v16(pools)  # (no V scale per slot, no V factors)
    _checks.check_same_device(
        **dict(zip(KV_ARGS, kv, strict=True)),
        **_on_device(pools),
        video_slots=inputs.video_slots,
        choice_slots=inputs.choice_slots,
        action_slots=inputs.action_slots,
        block_table=inputs.block_table,
        cu_seqlens_q=inputs.cu_seqlens_q,
        seq_lens_k=inputs.seq_lens_k,
        key_gap=inputs.key_gap,
    )
    _checks.check_softmax_scale(inputs.softmax_scale)
    k_scale = pools.k_scales[layer_index] if quantized else None
    v_scale = pools.v_scales[layer_index] if quantized and not v_unscaled else None
    check_attention_arguments(
        query,
        k_pools[layer_index],
        v_pools[layer_index],
        inputs.block_table,
        inputs.cu_seqlens_q,
        inputs.seq_lens_k,
        inputs.max_seqlen_q,
        None,
        None,
        inputs.key_gap,
        False,
        k_scale,
        v_scale,
        k_equalizer=pools.k_equalizers[layer_index] if equalized else None,
        v_equalizer=pools.v_equalizers[layer_index] if equalized and not v_unscaled else None,
        v_channel_scale=pools.v_channel_scales[layer_index] if k8v8 else None,
    )
    if first_block >= 0:
        _check_staging(query, pools, inputs.block_table, first_block)
    return layer_index, first_block, smoothed, equalized


def _no_lse(query: Tensor) -> Tensor:
    """The op's second output when the LSE is not asked for: zero-size float32."""
    return query.new_empty((0, query.shape[1]), dtype=torch.float32)


def _with_lse(result: Tensor | tuple[Tensor, Tensor], query: Tensor) -> tuple[Tensor, Tensor]:
    """``paged_attention``'s result as the op's ``(out, lse)``."""
    return result if isinstance(result, tuple) else (result, _no_lse(query))


def _write_attend_impl(*args: object) -> tuple[Tensor, Tensor]:
    kv, pools, inputs = _split(args)
    layer_index, first_block, smoothed, equalized = _check_inputs(kv, pools, inputs)
    query, key, value, action_key, action_value = kv
    stage_tags = inputs.stage_tags
    # 0-dim CPU tensors and the CPU tags: reading them costs no device sync.
    history = int(inputs.stage_key)
    kept = history != NOTHING_STAGED and int(stage_tags[layer_index]) == history
    # Until this layer's restage is done, nothing in its staging buffers is vouched for.
    stage_tags[layer_index] = NOTHING_STAGED
    k_cache, v_cache = pools.k_pools[layer_index], pools.v_pools[layer_index]
    # Scales, the K mean and the factors: None for float pools (and no mean without smoothing,
    # no factors without equalization).
    k_scale = v_scale = stage_k_scale = stage_v_scale = k_smooth = k_smooth_chosen = None
    k_equalizer = v_equalizer = equalizers_chosen = None
    k8v8 = _k8v8(pools)
    v_unscaled = k8v8 or _k8v16(pools)
    # k8v8: V's channel scales (chosen on the layer's first write, as the mean), no V scale per
    # slot or V factors.
    channels = {}
    if k8v8:
        channels = {"v_channel_scale": pools.v_channel_scales[layer_index]}
    if is_quantized(k_cache.dtype):
        k_scale = pools.k_scales[layer_index]
        v_scale = None if v_unscaled else pools.v_scales[layer_index]
        stage_k_scale = pools.stage_k_scales[layer_index] if first_block >= 0 else None
        if first_block >= 0 and not v_unscaled:
            stage_v_scale = pools.stage_v_scales[layer_index]
        if smoothed:
            # write_slots chooses the mean from the first video keys it writes (the CPU flag:
            # no sync) and records it; only that call pays for the reduction.
            k_smooth = pools.k_means[layer_index]
            k_smooth_chosen = pools.k_means_chosen[layer_index]
        if equalized:
            # Likewise the factors, from the same rows (after the mean).
            k_equalizer = pools.k_equalizers[layer_index]
            v_equalizer = None if v_unscaled else pools.v_equalizers[layer_index]
            equalizers_chosen = pools.equalizers_chosen[layer_index]
    # Staged copies of the layer's codes: regrown factors rescale them with the pools'.
    staged = {}
    if first_block >= 0 and is_quantized(k_cache.dtype):
        staged = {"stage_k": pools.stage_k[layer_index], "stage_v": pools.stage_v[layer_index]}
    if inputs.choice_slots is not None:
        # This call writes only some of the forward's video tokens (one rank of a sharded
        # window): whatever a first write freezes is chosen here from all of them, by the rule
        # write_slots follows, so the write below finds the flags set, as on every other rank;
        # a later write's regrowth likewise.
        factors_were_chosen = equalizers_chosen is not None and bool(equalizers_chosen)
        choose_unset(
            key,
            value,
            inputs.choice_slots,
            k_smooth=k_smooth,
            k_smooth_chosen=k_smooth_chosen,
            k_equalizer=k_equalizer,
            v_equalizer=v_equalizer,
            equalizers_chosen=equalizers_chosen,
            v_channel_scale=channels.get("v_channel_scale"),
            v_scale_chosen=pools.v_scales_chosen[layer_index] if k8v8 else None,
        )
        if factors_were_chosen:
            regrow_chosen(
                key,
                value,
                inputs.choice_slots,
                k_pool=k_cache,
                v_pool=v_cache,
                k_smooth=k_smooth,
                k_equalizer=k_equalizer,
                v_equalizer=v_equalizer,
                **staged,
            )
    # Only video keys choose the mean and the factors (and k8v8's V scales); action rows are
    # written with them.
    v_chosen = pools.v_scales_chosen[layer_index] if k8v8 else None
    for k, v, slots, mean_chosen, factors_chosen, channels_chosen in (
        (key, value, inputs.video_slots, k_smooth_chosen, equalizers_chosen, v_chosen),
        (action_key, action_value, inputs.action_slots, None, None, None),
    ):
        write_channels = channels
        if k8v8:
            write_channels = channels | {
                "v_scale_chosen": channels_chosen,
                "v_saturated": pools.v_saturated[layer_index : layer_index + 1],
            }
        write_slots(
            k,
            v,
            k_cache,  # paged pools, in whatever layout the cache has
            v_cache,
            slots,
            k_scale=k_scale,
            v_scale=v_scale,
            k_smooth=k_smooth,
            k_smooth_chosen=mean_chosen,
            k_equalizer=k_equalizer,
            v_equalizer=v_equalizer,
            equalizers_chosen=factors_chosen,
            regrow_factors=inputs.choice_slots is None,
            check_values=False,
            **write_channels,
            **staged,
        )
    attend = {
        "max_seqlen_q": inputs.max_seqlen_q,
        "softmax_scale": inputs.softmax_scale,
        "key_gap": inputs.key_gap,
        "return_lse": inputs.return_lse,
        "k_equalizer": k_equalizer,
        "v_equalizer": v_equalizer,
        "check_values": False,
        **channels,
    }
    table, cu_seqlens_q, seq_lens_k = inputs.block_table, inputs.cu_seqlens_q, inputs.seq_lens_k
    if first_block < 0:
        result = paged_attention(
            query,
            k_cache,
            v_cache,
            table,
            cu_seqlens_q,
            seq_lens_k,
            k_scale=k_scale,
            v_scale=v_scale,
            **attend,
        )
        return _with_lse(result, query)
    layer_k, layer_v = pools.stage_k[layer_index], pools.stage_v[layer_index]
    gather_blocks(
        k_cache,
        v_cache,
        table[0],
        layer_k,
        layer_v,
        k_scale=k_scale,
        v_scale=v_scale,
        stage_k_scale=stage_k_scale,
        stage_v_scale=stage_v_scale,
        first_block=first_block if kept else 0,
        check_values=False,
    )
    stage_tags[layer_index] = history
    # The staged window attended as the pools' blocks, in table order (staged_blocks): the
    # launch, and so the key order and the float32 sums, are the paged call's.
    width, block_size = table.shape[1], k_cache.shape[1]
    if k8v8:
        # The frozen channel scales (block stride 0) serve the staged blocks as the pools'.
        frozen = channels["v_channel_scale"]
        attend["v_channel_scale"] = frozen[:1].expand(width, *frozen.shape[1:])
    result = paged_attention(
        query,
        *(staged_blocks(t, width, block_size) for t in (layer_k, layer_v)),
        torch.arange(width, dtype=torch.int32, device=query.device).unsqueeze(0),
        cu_seqlens_q,
        seq_lens_k,
        k_scale=_apply(stage_k_scale, staged_blocks, width, block_size),
        v_scale=_apply(stage_v_scale, staged_blocks, width, block_size),
        **attend,
    )
    return _with_lse(result, query)


def staged_blocks(stage: Tensor, width: int, block_size: int) -> Tensor:
    """A layer's staging buffer (or its scales), ``(tokens, ...)``, as ``width`` blocks of the
    pools' ``block_size``: entry ``j`` of the identity table is table entry ``j`` restaged.

    Attention over it takes the launch the paged call takes (the block size picks the tile, the
    key path and the pieces a block is cut into, hence the order keys are summed in), so staged
    and unstaged outputs are equal bit for bit. One block of ``width * block_size`` would take
    a launch of its own: 20 keys at 512-key tiles are cut into 16 + 4, two softmax steps where
    blocks of 2 take one (docs/paging.md, "History staging")."""
    return stage[: width * block_size].unflatten(0, (width, block_size))


def _apply(tensor: Tensor | None, method: Callable[..., Tensor], *args: int) -> Tensor | None:
    """``method(tensor, *args)``, or None for None (a float pool's missing scale)."""
    return None if tensor is None else method(tensor, *args)


def _register() -> object:
    """Register the op once per process; later imports reuse the registered one."""
    namespace = getattr(torch.ops, NAMESPACE)
    if hasattr(namespace, OP_NAME):
        return getattr(namespace, OP_NAME).default
    op = torch.library.custom_op(QUALIFIED_NAME, mutates_args=MUTATED_ARGS, schema=_schema())(
        _write_attend_impl
    )

    @op.register_fake
    def _fake(query: Tensor, *args: object) -> tuple[Tensor, Tensor]:
        if not _split((query, *args))[2].return_lse:
            return torch.empty_like(query), _no_lse(query)
        return torch.empty_like(query), query.new_empty(query.shape[:2], dtype=torch.float32)

    return getattr(namespace, OP_NAME).default


write_attend_op = _register()


def write_attend(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    action_key: Tensor,
    action_value: Tensor,
    pools: PoolTensors,
    inputs: LayerInputs,
) -> Tensor | tuple[Tensor, Tensor]:
    """Write this layer's K/V (video, then action) into the pools and attend; returns ``(q, H, D)``.

    ``pools`` holds every cache tensor the op touches (see ``PoolTensors``; a cache's
    ``pool_tensors``), ``inputs`` the forward's plan tensors with this layer's index. With
    ``inputs.return_lse``, returns ``(out, lse)``, ``lse`` float32 ``(q, H)`` as
    ``paged_attention`` gives it.
    """
    kv = (query, key, value, action_key, action_value)
    # By fields, not class: reloading this module makes new NamedTuple classes.
    for name, given, cls in (("pools", pools, PoolTensors), ("inputs", inputs, LayerInputs)):
        if getattr(given, "_fields", None) != cls._fields:
            raise TypeError(f"{name} must be a {cls.__name__}, got {type(given).__name__}")
    # Here: the dispatcher would turn an int into a bool.
    if not isinstance(inputs.return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {type(inputs.return_lse).__name__}")
    named = {**dict(zip(KV_ARGS, kv, strict=True)), **pools._asdict()}
    for name, tensor in named.items():
        _checks.check_tensor(name, tensor)
    # Here, not only in the op: a meta tensor among real ones would dispatch to the fake.
    _checks.check_same_device(**dict(zip(KV_ARGS, kv, strict=True)), **_on_device(pools))
    out, lse = write_attend_op(*kv, *pools, *inputs)
    return (out, lse) if inputs.return_lse else out

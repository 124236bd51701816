"""Exact merge of partial attentions by their log-sum-exp.

Attention of a query over a key set split into disjoint parts is recovered from each part's
output ``o_i`` and log-sum-exp ``lse_i`` (``paged_attention(..., return_lse=True)``): with
``M = max_i lse_i`` and weights ``w_i = exp(lse_i - M)``,
``out = sum_i w_i o_i / sum_i w_i`` and ``lse = M + log(sum_i w_i)``, FlashInfer's
``merge_state`` semantics. A part that saw no key (``lse = -inf``) weighs 0 and its output is
never read (it may hold anything, NaN included). A row whose parts all saw no key gets zeros and
``-inf``, as attention over no key does. Float32 math; the output in the parts' dtype.

One kernel serves both forms: a stack of ``n`` parts, plus optionally one more part in its own
tensors (the two-way form is a stack of one plus one), so no part is copied.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from paged_video.kernels import _checks, torch_path
from paged_video.kernels._runtime import interpreter_active, use_torch_path


@triton.jit
def _add_part(acc, weight_sum, part_ptrs, lse_ptrs, row_max, t_mask, d_mask):
    """Add one part, weighted by ``exp(lse - row_max)`` (0 for a part that saw no key)."""
    lse = tl.load(lse_ptrs, mask=t_mask, other=float("-inf"))
    weight = tl.exp(lse - row_max)
    # An empty part's output is not read: it may be unwritten.
    seen = (lse > float("-inf"))[:, None] & d_mask[None, :]
    part = tl.load(part_ptrs, mask=seen, other=0.0)
    return acc + weight[:, None] * part.to(tl.float32), weight_sum + weight


@triton.heuristics({"HAS_EXTRA": lambda args: args["extra_ptr"] is not None})
@triton.jit
def _merge_states_kernel(
    out_ptr,
    out_lse_ptr,
    parts_ptr,
    parts_lse_ptr,
    extra_ptr,
    extra_lse_ptr,
    num_parts,
    num_tokens,
    stride_o_tok,
    stride_o_head,
    stride_o_dim,
    stride_ol_tok,
    stride_ol_head,
    stride_p_part,
    stride_p_tok,
    stride_p_head,
    stride_p_dim,
    stride_pl_part,
    stride_pl_tok,
    stride_pl_head,
    stride_e_tok,
    stride_e_head,
    stride_e_dim,
    stride_el_tok,
    stride_el_head,
    HEAD_DIM: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_EXTRA: tl.constexpr,
):
    """Program (t, h, d): tokens t*BLOCK_T.. of head h, dimensions d*BLOCK_D..

    Two passes over the parts: the row max of their LSEs, then the weighted sum. The d == 0
    programs store the merged LSE.
    """
    head = tl.program_id(1).to(tl.int64)
    tokens = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    dims = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    t_mask = tokens < num_tokens
    d_mask = dims < HEAD_DIM
    parts_lse = parts_lse_ptr + tokens * stride_pl_tok + head * stride_pl_head
    parts = (
        parts_ptr
        + tokens[:, None] * stride_p_tok
        + head * stride_p_head
        + dims[None, :] * stride_p_dim
    )
    if HAS_EXTRA:
        extra_lse = extra_lse_ptr + tokens * stride_el_tok + head * stride_el_head
        extra = (
            extra_ptr
            + tokens[:, None] * stride_e_tok
            + head * stride_e_head
            + dims[None, :] * stride_e_dim
        )

    # Part i's pointers are reached by stepping (64-bit pointers: no int32 product to wrap).
    row_max = tl.full([BLOCK_T], float("-inf"), dtype=tl.float32)
    part_lse = parts_lse
    for _ in range(0, num_parts):
        row_max = tl.maximum(row_max, tl.load(part_lse, mask=t_mask, other=float("-inf")))
        part_lse += stride_pl_part
    if HAS_EXTRA:
        row_max = tl.maximum(row_max, tl.load(extra_lse, mask=t_mask, other=float("-inf")))
    # Rows whose parts all saw nothing keep max -inf: subtract 0 so every weight is exp(-inf).
    row_max = tl.where(row_max == float("-inf"), 0.0, row_max)

    acc = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
    weight_sum = tl.zeros([BLOCK_T], dtype=tl.float32)
    for _ in range(0, num_parts):
        acc, weight_sum = _add_part(acc, weight_sum, parts, parts_lse, row_max, t_mask, d_mask)
        parts += stride_p_part
        parts_lse += stride_pl_part
    if HAS_EXTRA:
        acc, weight_sum = _add_part(acc, weight_sum, extra, extra_lse, row_max, t_mask, d_mask)

    # weight_sum >= 1 when a part saw a key (the largest LSE weighs exp(0)), else 0.
    seen_any = weight_sum > 0.0
    weight_sum = tl.where(seen_any, weight_sum, 1.0)
    out_rows = out_ptr + tokens[:, None] * stride_o_tok + head * stride_o_head
    tl.store(
        out_rows + dims[None, :] * stride_o_dim,
        (acc / weight_sum[:, None]).to(out_ptr.dtype.element_ty),
        mask=t_mask[:, None] & d_mask[None, :],
    )
    if tl.program_id(2) == 0:
        merged = tl.where(seen_any, row_max + tl.log(weight_sum), float("-inf"))
        tl.store(out_lse_ptr + tokens * stride_ol_tok + head * stride_ol_head, merged, mask=t_mask)


def _check_part(name: str, out: Tensor, lse_name: str, lse: Tensor, rank: int) -> None:
    """One part (``rank`` 3) or a stack of parts (``rank`` 4) and its LSE."""
    layout = "(total_q, num_heads, head_dim)" if rank == 3 else "(n, total_q, num_heads, head_dim)"
    _checks.check_rank(name, out, rank, layout)
    _checks.check_dtype(name, out, _checks.FLOAT_DTYPES)
    _checks.check_rank(lse_name, lse, rank - 1, f"{layout[: layout.rfind(',')]})")
    _checks.check_dtype(lse_name, lse, (torch.float32,))
    if lse.shape != out.shape[:-1]:
        raise ValueError(
            f"{lse_name} must have shape {tuple(out.shape[:-1])} ({name}'s without head_dim), "
            f"got {tuple(lse.shape)}"
        )


def _check_outputs(like: Tensor, out: Tensor | None, out_lse: Tensor | None) -> None:
    """``out``/``out_lse`` fit a merge of parts shaped and typed like ``like``."""
    shape, dtype = tuple(like.shape[-3:]), like.dtype
    if out is not None:
        _checks.check_tensor("out", out)
        if tuple(out.shape) != shape or out.dtype != dtype:
            raise ValueError(
                f"out must have the parts' shape {shape} and dtype {dtype}, "
                f"got {tuple(out.shape)} {out.dtype}"
            )
    if out_lse is not None:
        _checks.check_tensor("out_lse", out_lse)
        if tuple(out_lse.shape) != shape[:2] or out_lse.dtype != torch.float32:
            raise ValueError(
                f"out_lse must have shape {shape[:2]} and dtype float32, "
                f"got {tuple(out_lse.shape)} {out_lse.dtype}"
            )


def _check_unshared(inputs: dict[str, Tensor], out: Tensor | None, out_lse: Tensor | None) -> None:
    """The outputs share no memory with the parts or each other: a program could read what
    another one already wrote."""
    written = {"out": out, "out_lse": out_lse}
    for name, tensor in written.items():
        if tensor is None or tensor.numel() == 0:
            continue
        for other_name, other in {**inputs, **written}.items():
            if other_name == name or other is None or other.numel() == 0:
                continue
            if tensor.untyped_storage().data_ptr() == other.untyped_storage().data_ptr():
                raise ValueError(f"{name} must not share memory with {other_name}")


def merge_attention_states(
    out_a: Tensor,
    lse_a: Tensor,
    out_b: Tensor,
    lse_b: Tensor,
    *,
    out: Tensor | None = None,
    out_lse: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Merge two partial attentions over disjoint key sets into the attention over their union.

    ``out_a``/``out_b``: ``(total_q, num_heads, head_dim)``, one float dtype; ``lse_a``/``lse_b``:
    float32 ``(total_q, num_heads)``, as ``paged_attention(..., return_lse=True)`` returns them
    (finite, or ``-inf`` for a row that saw no key). Returns ``(out, lse)``: ``out`` in the
    parts' dtype, ``lse`` float32; a row that both parts saw nothing of gets zeros and ``-inf``.
    ``out``/``out_lse`` receive the result when given (no memory shared with the parts). Any
    strides.
    """
    _check_part("out_a", out_a, "lse_a", lse_a, 3)
    _check_part("out_b", out_b, "lse_b", lse_b, 3)
    if out_b.shape != out_a.shape or out_b.dtype != out_a.dtype:
        raise ValueError(
            f"out_b must have out_a's shape {tuple(out_a.shape)} and dtype {out_a.dtype}, "
            f"got {tuple(out_b.shape)} {out_b.dtype}"
        )
    _check_outputs(out_a, out, out_lse)
    inputs = {"out_a": out_a, "lse_a": lse_a, "out_b": out_b, "lse_b": lse_b}
    _checks.check_same_device(**inputs, out=out, out_lse=out_lse)
    _check_unshared(inputs, out, out_lse)
    return _merge(out_a.unsqueeze(0), lse_a.unsqueeze(0), (out_b, lse_b), out, out_lse)


def merge_stacked_attention_states(
    outs: Tensor,
    lses: Tensor,
    *,
    out: Tensor | None = None,
    out_lse: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Merge ``n`` partial attentions over disjoint key sets, stacked on dimension 0.

    ``outs``: ``(n, total_q, num_heads, head_dim)``, a float dtype; ``lses``: float32
    ``(n, total_q, num_heads)``. Returns ``(out, lse)`` as ``merge_attention_states`` does;
    ``n = 0`` gives zeros and ``-inf`` (attention over no key). Any strides.
    """
    _check_part("outs", outs, "lses", lses, 4)
    _check_outputs(outs, out, out_lse)
    inputs = {"outs": outs, "lses": lses}
    _checks.check_same_device(**inputs, out=out, out_lse=out_lse)
    _check_unshared(inputs, out, out_lse)
    return _merge(outs, lses, None, out, out_lse)


def _merge(
    parts: Tensor,
    parts_lse: Tensor,
    extra: tuple[Tensor, Tensor] | None,
    out: Tensor | None,
    out_lse: Tensor | None,
) -> tuple[Tensor, Tensor]:
    """Merge the stacked ``parts`` and the ``extra`` part (checked arguments)."""
    num_tokens, num_heads, head_dim = parts.shape[1:]
    if out is None:
        out = parts.new_empty((num_tokens, num_heads, head_dim))
    if out_lse is None:
        out_lse = parts_lse.new_empty((num_tokens, num_heads))
    if num_tokens == 0 or num_heads == 0:
        return out, out_lse
    if use_torch_path(parts):
        outs, lses = list(parts.unbind(0)), list(parts_lse.unbind(0))
        if extra is not None:
            outs.append(extra[0])
            lses.append(extra[1])
        torch_path.merge_attention_states(outs, lses, out=out, out_lse=out_lse)
        return out, out_lse
    # Under the interpreter every program is a batch of numpy ops: big tiles are faster.
    block_t = min(256, triton.next_power_of_2(num_tokens)) if interpreter_active() else 16
    block_d = min(256, max(16, triton.next_power_of_2(head_dim)))
    extra_out, extra_lse = extra if extra is not None else (None, None)
    extra_strides = (*extra_out.stride(), *extra_lse.stride()) if extra is not None else (0,) * 5
    # head_dim 0 still merges the LSEs: at least one program along d.
    grid = lambda meta: (
        triton.cdiv(num_tokens, meta["BLOCK_T"]),
        num_heads,
        max(1, triton.cdiv(head_dim, meta["BLOCK_D"])),
    )
    _merge_states_kernel[grid](
        out,
        out_lse,
        parts,
        parts_lse,
        extra_out,
        extra_lse,
        parts.shape[0],
        num_tokens,
        *out.stride(),
        *out_lse.stride(),
        *parts.stride(),
        *parts_lse.stride(),
        *extra_strides,
        HEAD_DIM=head_dim,
        BLOCK_T=block_t,
        BLOCK_D=block_d,
        num_warps=4,
    )
    return out, out_lse

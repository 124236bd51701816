"""Quantized KV storage: which pool dtypes hold codes, their largest code, and scale checks.

A quantized pool holds codes (``int8``) and a float32 scale per
(slot, KV head) beside it, shaped like the pool without its last (head_dim) dimension. A row
``x`` of ``head_dim`` values is stored as ``scale = amax(|x|) / QMAX`` and codes
``round(x / scale)`` (nearest, ties to even, saturating at ``QMAX``); it reads back as
``codes * scale``. A row of zeros has scale 0 and codes 0. The scale is written with the token
and never changes while the token stays in the window (docs/quantization.md).
"""

from __future__ import annotations

import torch
from torch import Tensor

from paged_video.kernels import _checks

# The largest code of each quantized dtype: int8's 127 (symmetric, so -128 is never written).
# (The e4m3 pool was deleted, issue 45: k8v8's e4m3 V has channel scales, E4M3_MAX.)
QMAX: dict[torch.dtype, float] = {torch.int8: 127.0}
QUANT_DTYPES = tuple(QMAX)
# k8v8's V codes and its probabilities: e4m3fn, whose largest finite code is 448 (S.1111.110).
E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
SCALE_DTYPE = torch.float32


def is_quantized(dtype: torch.dtype) -> bool:
    """Whether pools of ``dtype`` hold codes that need scales."""
    return dtype in QMAX


def check_scales(name: str, scale: Tensor | None, pool_name: str, pool: Tensor) -> None:
    """``scale`` must exist exactly when ``pool`` is quantized, float32, shaped ``pool[..., 0]``."""
    if not is_quantized(pool.dtype):
        if scale is not None:
            raise ValueError(f"{name} is only for quantized pools; {pool_name} is {pool.dtype}")
        return
    if scale is None:
        raise ValueError(f"{pool_name} is {pool.dtype} (quantized): {name} must be given")
    _checks.check_tensor(name, scale)
    _checks.check_dtype(name, scale, (SCALE_DTYPE,))
    if scale.shape != pool.shape[:-1]:
        raise ValueError(
            f"{name} must have shape {tuple(pool.shape[:-1])} ({pool_name}'s without head_dim), "
            f"got {tuple(scale.shape)}"
        )

"""Switches deleted once the one-switch formats dominated them (issue 45, docs/quantization.md),
and what replaced each: a caller that still passes one gets a ``ValueError`` naming the new
spelling, never a silently different mode. Imports nothing heavy (``paging`` uses it)."""

from __future__ import annotations

_K8V8 = (
    'kv_format="k8v8" (PagingConfig; to paged_attention: an int8 k_cache with k_scale and an '
    "e4m3 v_cache with v_channel_scale)"
)
_K8V16 = (
    'kv_format="k8v16" (PagingConfig; to paged_attention: an int8 k_cache with k_scale and a '
    "v_cache in q's dtype, no v_scale)"
)
# The deleted switch, and the spelling that replaced it.
REPLACEMENTS = {
    "fp8_mma": _K8V8,
    "int8_mma": _K8V16,
}


def refuse_e4m3_pool(name: str, dtype: object) -> None:
    """Raise a ``ValueError`` where ``dtype`` (of ``name``) is ``torch.float8_e4m3fn`` as the
    deleted e4m3 dequantizing pool's: codes with a float32 scale per (slot, KV head). k8v8
    keeps e4m3 V codes with channel scales; its callers check those before calling this."""
    if str(dtype) == "torch.float8_e4m3fn":
        raise ValueError(
            f"{name}=torch.float8_e4m3fn (the e4m3 dequantizing pool) was deleted (issue 45): "
            f"use {_K8V16}: more accurate on every data kind; or {_K8V8}: the same bytes"
        )


def refuse_removed(**switches: object) -> None:
    """Raise a ``ValueError`` naming the replacement of the first deleted switch set (any value
    but ``False``, its old default)."""
    for name, value in switches.items():
        if value is not False:
            raise ValueError(f"{name} was deleted (issue 45): use {REPLACEMENTS[name]}")

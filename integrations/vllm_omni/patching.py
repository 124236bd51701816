"""Installing the backend into vllm-omni: the seam check, the patches, and putting them back.

vllm-omni 0.30.0 enters AR-Diffusion self-attention through ``ar_diffusion_paged_attention`` in
``vllm_omni.experimental.ar_diffusion.kv_cache.paged_attention``. Its fused write+attend op
(``paged_write_attn``, which DreamZero and LingBot-World call) reaches it through that module's
globals; the ``kv_cache`` package and LingBot-World's transformer import the function object by
name. On a CPU it calls the module attribute ``_reference_paged_attention``; on CUDA it imports
``vllm.vllm_flash_attn.flash_attn_varlen_func`` inside its body and calls it in a paged or a
contiguous form, the latter after ``_stage_window``.

``flash_attn_varlen_func`` itself is left alone: vLLM's attention backends, vllm-omni's dense
diffusion attention and SenseNova's paged decode call it too, and only AR-Diffusion's calls are
ours to take. So the entry point is replaced at every binding of it (its own module's, and any
module's that imported it by name), routing CUDA (not ROCm) tensors to ``backend.ar_attention``
and everything else to vllm-omni's own function, whose CPU seam and staging helper are
replaced in turn. Nothing is patched unless the module is exactly the one this was tested
against: its version, its seam's attributes and signatures, and the source of the functions
involved.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import inspect
import os
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass

import torch

from paged_video.integrations.vllm_omni import ENV_SWITCH, backend

SEAM_MODULE = "vllm_omni.experimental.ar_diffusion.kv_cache.paged_attention"
ENTRY = "ar_diffusion_paged_attention"
CPU_SEAM = "_reference_paged_attention"
STAGING_SEAM = "_stage_window"
GATHER_SWITCH = "contiguous_kv_gather_enabled"
FUSED_OP_IMPL = "_paged_write_attn_impl"
# The functions whose behaviour the backend mirrors or relies on; their source is fingerprinted.
FINGERPRINTED = (ENTRY, CPU_SEAM, STAGING_SEAM, FUSED_OP_IMPL)

# vllm-omni version -> sha256 of the fingerprinted functions' source, as tested.
TESTED_SEAMS: dict[str, str] = {
    "0.30.0": "6b87b0dc4210b828b6b49d51458258d707f1b784afe8d1d7bdd8826b9b18b6eb",
}

_POSITIONAL = inspect.Parameter.POSITIONAL_OR_KEYWORD
_KEYWORD = inspect.Parameter.KEYWORD_ONLY
_NO_DEFAULT = inspect.Parameter.empty
# (name, kind, default) of each seam function's parameters.
EXPECTED_PARAMETERS: dict[str, tuple[tuple[str, object, object], ...]] = {
    ENTRY: (
        *((name, _POSITIONAL, _NO_DEFAULT) for name in ("query", "key_cache", "value_cache")),
        *(
            (name, _KEYWORD, _NO_DEFAULT)
            for name in (
                "block_table",
                "query_start_loc",
                "seq_lens",
                "max_query_len",
                "max_seq_len",
                "softmax_scale",
            )
        ),
        ("causal", _KEYWORD, False),
        ("stage_key", _KEYWORD, None),
        ("stage_value", _KEYWORD, None),
        ("reuse_history", _KEYWORD, False),
        ("current_tokens", _KEYWORD, 0),
        ("stage_first_block", _KEYWORD, 0),
    ),
    CPU_SEAM: (
        *(
            (name, _POSITIONAL, _NO_DEFAULT)
            for name in (
                "query",
                "key_cache",
                "value_cache",
                "block_table",
                "query_start_loc",
                "seq_lens",
                "softmax_scale",
            )
        ),
        ("causal", _KEYWORD, _NO_DEFAULT),
    ),
    STAGING_SEAM: (
        *(
            (name, _POSITIONAL, _NO_DEFAULT)
            for name in (
                "stage_key",
                "stage_value",
                "key_cache",
                "value_cache",
                "block_ids",
                "n_blocks",
                "block_size",
            )
        ),
        ("first_block", _KEYWORD, _NO_DEFAULT),
    ),
    GATHER_SWITCH: (),
}


class UnsupportedVllmOmniError(RuntimeError):
    """The installed vllm-omni is not one whose attention seam this backend was tested with."""


def seam_fingerprint(module: types.ModuleType) -> str:
    """sha256 over the source of the module's fingerprinted functions."""
    digest = hashlib.sha256()
    for name in FINGERPRINTED:
        digest.update(name.encode())
        digest.update(inspect.getsource(module.__dict__[name]).encode())
    return digest.hexdigest()


def _parameters(function: Callable) -> tuple[tuple[str, object, object], ...]:
    return tuple(
        (p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()
    )


def check_seam(module: types.ModuleType, version: object) -> None:
    """Refuse (``UnsupportedVllmOmniError``, one line) unless ``module`` is a tested seam."""

    def refuse(reason: str) -> UnsupportedVllmOmniError:
        tested = ", ".join(TESTED_SEAMS)
        return UnsupportedVllmOmniError(
            f"paged_video.integrations.vllm_omni was tested with vllm-omni {tested}; this is "
            f"vllm-omni {version}, whose {reason}: nothing was patched"
        )

    if version not in TESTED_SEAMS:
        raise refuse("version is not among them")
    for name, expected in EXPECTED_PARAMETERS.items():
        function = module.__dict__.get(name)
        if not callable(function):
            raise refuse(f"{SEAM_MODULE}.{name} is missing")
        if _parameters(function) != expected:
            raise refuse(f"{SEAM_MODULE}.{name} has the signature {inspect.signature(function)}")
    if not callable(module.__dict__.get(FUSED_OP_IMPL)):
        raise refuse(f"{SEAM_MODULE}.{FUSED_OP_IMPL} is missing")
    try:
        fingerprint = seam_fingerprint(module)
    except (OSError, TypeError) as error:
        raise refuse(f"seam source cannot be read ({error})") from None
    if fingerprint != TESTED_SEAMS[version]:
        raise refuse(f"seam source differs from the tested one (sha256 {fingerprint[:12]})")


def _on_our_cuda_path(query: torch.Tensor) -> bool:
    """CUDA tensors on a CUDA build take the backend; ROCm keeps vllm-omni's own path."""
    return query.is_cuda and torch.version.hip is None


if not hasattr(torch.ops.paged_video, "vllm_omni_ar_attention"):
    # One opaque op, as vllm-omni's fused op is, so a compiled DiT block that calls the entry
    # point directly still traces fullgraph; the staging buffers are its declared mutations
    # (required arguments: the dispatcher may drop trailing defaults of mutated inputs).
    @torch.library.custom_op(
        "paged_video::vllm_omni_ar_attention", mutates_args=("stage_key", "stage_value")
    )
    def _ar_attention_op(
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_table: torch.Tensor,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        max_query_len: int,
        max_seq_len: int,
        softmax_scale: float,
        causal: bool,
        gather: bool,
        stage_key: torch.Tensor | None,
        stage_value: torch.Tensor | None,
        reuse_history: bool,
        current_tokens: int,
        stage_first_block: int,
    ) -> torch.Tensor:
        return backend.ar_attention(
            query,
            key_cache,
            value_cache,
            block_table,
            query_start_loc,
            seq_lens,
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            softmax_scale=softmax_scale,
            causal=causal,
            gather=gather,
            stage_key=stage_key,
            stage_value=stage_value,
            reuse_history=reuse_history,
            current_tokens=current_tokens,
            stage_first_block=stage_first_block,
        )

    @_ar_attention_op.register_fake
    def _(
        query,
        key_cache,
        value_cache,
        block_table,
        query_start_loc,
        seq_lens,
        max_query_len,
        max_seq_len,
        softmax_scale,
        causal,
        gather,
        stage_key,
        stage_value,
        reuse_history,
        current_tokens,
        stage_first_block,
    ):
        return torch.empty_like(query)


def make_entry(original: Callable, module: types.ModuleType) -> Callable:
    """``ar_diffusion_paged_attention`` with its CUDA branch on the backend."""

    @functools.wraps(original)
    def ar_diffusion_paged_attention(
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        *,
        block_table: torch.Tensor,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        max_query_len: int,
        max_seq_len: int,
        softmax_scale: float,
        causal: bool = False,
        stage_key: torch.Tensor | None = None,
        stage_value: torch.Tensor | None = None,
        reuse_history: bool = False,
        current_tokens: int = 0,
        stage_first_block: int = 0,
    ) -> torch.Tensor:
        if not _on_our_cuda_path(query):
            return original(
                query,
                key_cache,
                value_cache,
                block_table=block_table,
                query_start_loc=query_start_loc,
                seq_lens=seq_lens,
                max_query_len=max_query_len,
                max_seq_len=max_seq_len,
                softmax_scale=softmax_scale,
                causal=causal,
                stage_key=stage_key,
                stage_value=stage_value,
                reuse_history=reuse_history,
                current_tokens=current_tokens,
                stage_first_block=stage_first_block,
            )
        # The switch is read where vllm-omni reads it, at call time.
        gather = getattr(module, GATHER_SWITCH)() and block_table.shape[0] == 1
        flat = query.reshape(-1, *query.shape[-2:]) if query.dim() == 4 else query
        out = torch.ops.paged_video.vllm_omni_ar_attention(
            flat,
            key_cache,
            value_cache,
            block_table,
            query_start_loc,
            seq_lens,
            int(max_query_len),
            int(max_seq_len),
            float(softmax_scale),
            bool(causal),
            bool(gather),
            stage_key,
            stage_value,
            bool(reuse_history),
            int(current_tokens),
            int(stage_first_block),
        )
        return out.reshape(query.shape)

    return ar_diffusion_paged_attention


def make_cpu_seam(original: Callable) -> Callable:
    """``_reference_paged_attention`` on the backend for CPU and CUDA tensors; other devices
    keep vllm-omni's reference."""

    @functools.wraps(original)
    def _reference_paged_attention(
        query,
        key_cache,
        value_cache,
        block_table,
        query_start_loc,
        seq_lens,
        softmax_scale,
        *,
        causal,
    ):
        if query.device.type not in ("cpu", "cuda"):
            return original(
                query,
                key_cache,
                value_cache,
                block_table,
                query_start_loc,
                seq_lens,
                softmax_scale,
                causal=causal,
            )
        return backend.reference_paged_attention(
            query,
            key_cache,
            value_cache,
            block_table,
            query_start_loc,
            seq_lens,
            softmax_scale,
            causal=causal,
        )

    return _reference_paged_attention


def make_staging_seam(original: Callable) -> Callable:
    """``_stage_window`` on ``gather_blocks`` (``backend.stage_window``), on every device."""

    @functools.wraps(original)
    def _stage_window(
        stage_key,
        stage_value,
        key_cache,
        value_cache,
        block_ids,
        n_blocks,
        block_size,
        *,
        first_block,
    ):
        backend.stage_window(
            stage_key,
            stage_value,
            key_cache,
            value_cache,
            block_ids,
            n_blocks,
            block_size,
            first_block=first_block,
        )

    return _stage_window


@dataclass
class _Installation:
    """What ``install`` changed, to be put back by ``uninstall``."""

    module: types.ModuleType
    version: str
    originals: dict[str, Callable]
    replacements: dict[str, Callable]
    env_before: str | None = None
    set_env: bool = False


_installation: _Installation | None = None


def _module_namespaces() -> list[dict]:
    return [m.__dict__ for m in list(sys.modules.values()) if isinstance(m, types.ModuleType)]


def is_installed() -> bool:
    return _installation is not None


def install(*, propagate: bool = True) -> None:
    """Route vllm-omni's AR-Diffusion attention to this project's kernels (idempotent).

    Raises ``UnsupportedVllmOmniError`` (one line, naming the version) and patches nothing when
    the installed vllm-omni is not a tested one. ``propagate`` sets ``PAGED_VIDEO_VLLM_OMNI=1``
    so that vllm-omni's worker processes install it too (through the package's
    ``vllm_omni.general_plugins`` entry point).
    """
    global _installation
    if _installation is not None:
        return
    vllm_omni = importlib.import_module("vllm_omni")
    module = importlib.import_module(SEAM_MODULE)
    version = getattr(vllm_omni, "__version__", None)
    check_seam(module, version)
    originals = {name: module.__dict__[name] for name in (ENTRY, CPU_SEAM, STAGING_SEAM)}
    replacements = {
        ENTRY: make_entry(originals[ENTRY], module),
        CPU_SEAM: make_cpu_seam(originals[CPU_SEAM]),
        STAGING_SEAM: make_staging_seam(originals[STAGING_SEAM]),
    }
    installation = _Installation(module, str(version), originals, replacements)
    for name in (CPU_SEAM, STAGING_SEAM):
        setattr(module, name, replacements[name])
    for namespace in _module_namespaces():
        for name, value in list(namespace.items()):
            if value is originals[ENTRY]:
                namespace[name] = replacements[ENTRY]
    if propagate:
        installation.env_before = os.environ.get(ENV_SWITCH)
        installation.set_env = True
        os.environ[ENV_SWITCH] = "1"
    _installation = installation


def uninstall() -> None:
    """Put back every object ``install`` replaced (a no-op when not installed).

    Modules imported since ``install`` that bound the replaced entry point by name get
    vllm-omni's function back too.
    """
    global _installation
    installation = _installation
    if installation is None:
        return
    module, originals = installation.module, installation.originals
    replaced = {id(function): name for name, function in installation.replacements.items()}
    foreign = [
        name for name in (CPU_SEAM, STAGING_SEAM) if id(module.__dict__.get(name)) not in replaced
    ]
    for name in (CPU_SEAM, STAGING_SEAM):
        if name not in foreign:
            setattr(module, name, originals[name])
    entry = installation.replacements[ENTRY]
    for namespace in _module_namespaces():
        for name, value in list(namespace.items()):
            if value is entry:
                namespace[name] = originals[ENTRY]
    if installation.set_env:
        if installation.env_before is None:
            os.environ.pop(ENV_SWITCH, None)
        else:
            os.environ[ENV_SWITCH] = installation.env_before
    _installation = None
    if foreign:
        raise RuntimeError(
            f"{SEAM_MODULE}.{', '.join(foreign)} was replaced by someone else after install(); "
            "left as found, everything else restored"
        )

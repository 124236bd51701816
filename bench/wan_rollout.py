"""Time per generated block of an autoregressive Wan rollout: paged cache against a plain one.

``python -m paged_video.bench.wan_rollout`` builds a random-weight diffusers
``WanTransformer3DModel`` of the
Wan 2.1 1.3B shape (30 layers, 12 heads of 128, bf16, 1560 tokens per 832x480 latent frame,
3 frames per block, sink 9 and window 9 frames, both CFG branches) and generates ``--blocks``
blocks with the stock attention call (``dispatch_attention_fn``) over a plain per-layer KV
cache, the kept history concatenated with the block's K/V at every forward and re-concatenated
(then cut to the window) at every commit; then again with ``models.wan_paged.PagedWanRollout``
(this project's fused write+attend op over the paged pools, exact window), once per format.
Each block runs ``--steps`` denoising forwards and one committing forward. It prints, per
provider, the median time per generated block once the window is full (and the first block's),
and the largest difference between the two rollouts' latents (bf16: a sanity check, not an
accuracy figure).

``--kv-format`` runs the paged rollout once per pool format given, as the cache's one switch
spells them (``PagingConfig(kv_format=...)``, docs/quantization.md): ``bf16`` keeps the pools
unquantized in the model's dtype (bf16 at the 1.3B shape, float32 with ``--tiny``: the header
and the ``pool`` column print the dtype really used); ``k8v8`` (the fast format: both products
on 8-bit tensor cores), ``k8v16`` (the accurate one) and ``int8`` (the dequantizing pool)
quantize them, K smoothed and equalized as the format implies. Each row also gives the cache's
pool bytes (K/V pools, scales, smoothing means and channel scales) and its latents' difference
from the plain rollout (for quantized pools: the quantization's effect, not a bug check).
``--kv-dtype`` is the flag's older name; the deleted formats' spellings (``e4m3``, ...) are
refused naming the new ones.

Each row gives frames per second once the window is full (frames per block over the median
time per block from then on), printed (and written) as its rollout ends, the plain one first, so
a run cut short keeps the rows it finished; then two anchors: Self-Forcing 17 FPS and LongLive
20.7 FPS, Wan 2.1 1.3B on one H100 as their papers report (their own pipelines: VAE decoding
and their step counts included; a bound to read ours against, not the same measurement).
``--out DIR`` writes the rows to ``DIR/rollout.csv``.

``--tiny`` runs a 2-layer model in seconds on a CPU so the script is known to work; its
timings are not GPU figures. Needs the ``diffusers`` extra.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from paged_video.bench.formats import UNQUANTIZED, choice, dtype_name
from paged_video.paging import PagingConfig
from paged_video.paging.config import KV_FORMATS

try:
    from paged_video.models.wan_paged import (
        PagedWanRollout,
        apply_rotary,
        rope_at_frame,
        wan_qkv,
    )
except ImportError as error:  # no diffusers: one line for the command, the error for importers
    if __name__ == "__main__":
        raise SystemExit(f"error: {error}") from None
    raise

# Frames per second reported for the Wan 2.1 1.3B shape on one H100 (the papers' own figures).
ANCHORS_FPS = {"Self-Forcing": 17.0, "LongLive": 20.7}
CSV_COLUMNS = (
    "provider", "kv_format", "pool", "pool_mb", "first_block_ms", "steady_block_ms",
    "steady_fps", "blocks_timed", "max_diff_vs_plain", "figures", "device", "shape",
    "frames_per_block", "steps", "block_size",
)  # fmt: skip


@dataclass(frozen=True)
class Shape:
    """Model and rollout geometry; frames are latent frames (one chunk each, patch 1x2x2)."""

    layers: int
    heads: int
    head_dim: int
    ffn_dim: int
    freq_dim: int
    text_dim: int
    text_tokens: int
    channels: int
    height: int
    width: int
    frames_per_block: int
    sink_frames: int
    window_frames: int
    dtype: torch.dtype

    @property
    def tokens_per_frame(self) -> int:
        return (self.height // 2) * (self.width // 2)


WAN_1_3B = Shape(
    layers=30,
    heads=12,
    head_dim=128,
    ffn_dim=8960,
    freq_dim=256,
    text_dim=4096,
    text_tokens=512,
    channels=16,
    height=60,
    width=104,
    frames_per_block=3,
    sink_frames=9,
    window_frames=9,
    dtype=torch.bfloat16,
)
TINY = Shape(
    layers=2,
    heads=2,
    head_dim=32,
    ffn_dim=64,
    freq_dim=32,
    text_dim=16,
    text_tokens=5,
    channels=4,
    height=8,
    width=12,
    frames_per_block=1,
    sink_frames=1,
    window_frames=2,
    dtype=torch.float32,
)


def build_model(shape: Shape, device: torch.device):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    with torch.device(device):
        model = WanTransformer3DModel(
            patch_size=(1, 2, 2),
            num_attention_heads=shape.heads,
            attention_head_dim=shape.head_dim,
            in_channels=shape.channels,
            out_channels=shape.channels,
            text_dim=shape.text_dim,
            freq_dim=shape.freq_dim,
            ffn_dim=shape.ffn_dim,
            num_layers=shape.layers,
            cross_attn_norm=True,
        )
    # As ``from_pretrained(torch_dtype=...)`` loads it: the modules Wan keeps in float32 stay so.
    keep = model._keep_in_fp32_modules
    for name, parameter in model.named_parameters():
        if not any(part in keep for part in name.split(".")):
            parameter.data = parameter.data.to(shape.dtype)
    return model.eval()


class PlainKVCache:
    """Per layer: the kept history's K and V, ``(rows, tokens, heads, head_dim)``."""

    def __init__(self, layers: int, keep: int, sink: int) -> None:
        self.keys: list[Tensor | None] = [None] * layers
        self.values: list[Tensor | None] = [None] * layers
        self.keep = keep  # history tokens the next forward's window keeps after the sink
        self.sink = sink
        self.commit = False

    def store(self, layer: int, key: Tensor, value: Tensor) -> None:
        """Append a committed block, then drop what the window no longer keeps."""
        for kind, new in (("keys", key), ("values", value)):
            old = getattr(self, kind)[layer]
            both = new if old is None else torch.cat([old, new], dim=1)
            if both.shape[1] > self.sink + self.keep:
                both = torch.cat([both[:, : self.sink], both[:, -self.keep :]], dim=1)
            getattr(self, kind)[layer] = both


class PlainKVProcessor:
    """The stock Wan self-attention (projections, RMS norm, rotary, ``dispatch_attention_fn``)
    over the plain cache's history concatenated with the block's own K/V."""

    def __init__(self, cache: PlainKVCache, layer: int) -> None:
        self.cache = cache
        self.layer = layer

    def __call__(
        self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None
    ) -> Tensor:
        from diffusers.models.attention_dispatch import dispatch_attention_fn

        query, key, value = wan_qkv(attn, hidden_states)
        query = apply_rotary(query, *rotary_emb)
        key = apply_rotary(key, *rotary_emb)
        history_k, history_v = self.cache.keys[self.layer], self.cache.values[self.layer]
        all_k = key if history_k is None else torch.cat([history_k, key], dim=1)
        all_v = value if history_v is None else torch.cat([history_v, value], dim=1)
        out = dispatch_attention_fn(
            query, all_k, all_v, attn_mask=None, dropout_p=0.0, is_causal=False
        )
        if self.cache.commit:
            self.cache.store(self.layer, key, value)
        out = attn.to_out[0](out.flatten(2, 3).type_as(query))
        return attn.to_out[1](out)


@torch.no_grad()
def plain_rollout(
    model, shape: Shape, noise: Tensor, text: Tensor, sigmas, guidance: float, on_block
) -> Tensor:
    """The same rollout (Euler steps, CFG as one batch) with a ``PlainKVCache``."""
    c, f = shape.tokens_per_frame, shape.frames_per_block
    cache = PlainKVCache(
        len(model.blocks), keep=(shape.window_frames - f) * c, sink=shape.sink_frames * c
    )
    attention = [block.attn1 for block in model.blocks]
    stock = [attn.processor for attn in attention]
    for layer, attn in enumerate(attention):
        attn.set_processor(PlainKVProcessor(cache, layer))
    latents = noise.clone()
    rows = text.shape[0]
    try:
        for block in range(noise.shape[2] // f):
            x = noise[:, :, block * f : (block + 1) * f]
            hook = model.rope.register_forward_hook(rope_at_frame(block * f))
            try:
                for step, sigma in enumerate([*sigmas, 0.0]):
                    cache.commit = step == len(sigmas)
                    t = torch.full((rows,), 1000.0 * sigma, device=x.device)
                    out = model(x.expand(rows, -1, -1, -1, -1), t, text, return_dict=False)[0]
                    if cache.commit:
                        break
                    flow = out[1:] + guidance * (out[:1] - out[1:])
                    following = sigmas[step + 1] if step + 1 < len(sigmas) else 0.0
                    x = x + (following - sigma) * flow
            finally:
                hook.remove()
                cache.commit = False
            latents[:, :, block * f : (block + 1) * f] = x
            on_block(block)
    finally:
        for attn, processor in zip(attention, stock, strict=True):
            attn.set_processor(processor)
    return latents


class BlockTimer:
    """``on_block`` callback: wall time of each generated block (device synchronised)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.times: list[float] = []
        self.start = 0.0

    def reset(self) -> None:
        self._sync()
        self.times = []
        self.start = time.perf_counter()

    def __call__(self, block: int) -> None:
        self._sync()
        now = time.perf_counter()
        self.times.append(now - self.start)
        self.start = now

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def run(
    shape: Shape,
    *,
    blocks: int,
    steps: int,
    block_size: int,
    device: torch.device,
    kv_formats: tuple[str, ...] = (UNQUANTIZED,),
    warmup: bool = True,
    on_result: Callable[[str, dict[str, object]], None] | None = None,
) -> dict[str, dict[str, object]]:
    """The plain rollout, then one paged rollout per ``kv_formats`` entry, of ``blocks`` blocks.

    Returns per provider (``plain``, ``paged <kv format>``): ``times`` (per block), ``pool``
    (the K and V pools' dtypes), ``pool_bytes`` (paged only) and ``max_diff`` (latents against
    plain). ``on_result(provider, result)`` is called as each rollout ends, so a run cut short
    (a GPU window's stage limit) keeps what it finished.
    """
    model = build_model(shape, device)
    g = torch.Generator(device="cpu").manual_seed(1)
    frames = blocks * shape.frames_per_block
    noise = torch.randn(1, shape.channels, frames, shape.height, shape.width, generator=g)
    text = torch.randn(2, shape.text_tokens, shape.text_dim, generator=g)
    noise, text = noise.to(device, shape.dtype), text.to(device, shape.dtype)
    sigmas = [1.0 - i / steps for i in range(steps)]
    timer = BlockTimer(device)
    results: dict[str, dict[str, object]] = {}

    def finished(provider: str, result: dict[str, object]) -> None:
        results[provider] = result
        if on_result is not None:
            on_result(provider, result)

    if warmup:
        plain_rollout(
            model,
            shape,
            noise[:, :, : shape.frames_per_block],
            text,
            sigmas,
            5.0,
            lambda block: None,
        )
    timer.reset()
    plain_latents = plain_rollout(model, shape, noise, text, sigmas, 5.0, timer)
    finished("plain", {"times": timer.times, "pool": (shape.dtype,) * 2, "max_diff": 0.0})
    for name in kv_formats:
        config = PagingConfig(
            block_size=block_size,
            chunk_size=shape.tokens_per_frame,
            sink_chunks=shape.sink_frames,
            window_chunks=shape.window_frames,
            max_forward_chunks=shape.frames_per_block,
            exact_window=True,  # the same keys as the plain cache: no boundary tokens
            kv_format=name,
        )
        with PagedWanRollout(model, config) as rollout:

            def paged(on_block, count=blocks):
                f = count * shape.frames_per_block
                return rollout.generate(
                    noise[:, :, :f],
                    text[:1],
                    text[1:],
                    frames_per_block=shape.frames_per_block,
                    sigmas=sigmas,
                    guidance_scale=5.0,
                    record_reads=False,
                    on_block=on_block,
                ).latents

            if warmup:  # Triton compiles its kernels on the first launches
                paged(lambda block: None, count=1)
            timer.reset()
            latents = paged(timer)
            diff = (latents.float() - plain_latents.float()).abs().max().item()
            finished(
                f"paged {name}",
                {
                    "times": timer.times,
                    "pool": (rollout.cache.k_pools.dtype, rollout.cache.v_pools.dtype),
                    "pool_bytes": rollout.cache.pool_bytes,
                    "max_diff": diff,
                },
            )
    return results


# --kv-format: a kv_format name; an old spelling (the deleted e4m3 pool's) refused naming the new.
_kv_format = choice(KV_FORMATS)


def _pool_name(k_dtype: torch.dtype, v_dtype: torch.dtype) -> str:
    """``bf16``; ``int8``; ``int8/e4m3`` where K's and V's pools differ (k8v8, k8v16)."""
    k, v = (dtype_name(d).replace("float8_e4m3fn", "e4m3") for d in (k_dtype, v_dtype))
    return k if k == v else f"{k}/{v}"


def steady_fps(times: list[float], full: int, frames_per_block: int) -> tuple[float, int]:
    """Frames per second once the window is full (blocks ``full`` on; the last block where the
    run ends sooner) and how many blocks that median is of."""
    steady = times[full:] or times[-1:]
    return frames_per_block / statistics.median(steady), len(steady)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m paged_video.bench.wan_rollout", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model, seconds on a CPU")
    parser.add_argument("--blocks", type=int, default=None, help="generated blocks (default 10)")
    parser.add_argument("--steps", type=int, default=None, help="denoising forwards per block")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu"
    )
    parser.add_argument(
        "--kv-format",
        "--kv-dtype",
        nargs="+",
        type=_kv_format,
        default=[UNQUANTIZED],
        help=f"paged pool formats, one paged rollout each: {', '.join(KV_FORMATS)} "
        "(bf16: unquantized, in the model's dtype)",
    )
    parser.add_argument("--out", type=Path, default=None, help="folder for rollout.csv")
    args = parser.parse_args(argv)
    shape = TINY if args.tiny else WAN_1_3B
    blocks = args.blocks or (3 if args.tiny else 10)
    steps = args.steps or (1 if args.tiny else 4)
    for name, value in (
        ("--blocks", blocks),
        ("--steps", steps),
        ("--block-size", args.block_size),
    ):
        if value < 1:
            parser.error(f"{name} must be >= 1, got {value}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible (this torch: " + _cuda_build() + ")")
    if not args.tiny and args.device == "cpu":
        parser.error(
            "the Wan 2.1 1.3B shape would take hours on a CPU; --tiny runs a 2-layer model"
        )
    device = torch.device(args.device)
    # The window is full (steady state) once sink + window frames are generated.
    full = -(-(shape.sink_frames + shape.window_frames) // shape.frames_per_block)
    figures = "gpu" if device.type == "cuda" else "cpu (not GPU figures)"
    # Unquantized pools take the model's dtype: say which, so "bf16" is never read as used.
    unquantized = (
        f"; --kv-format {UNQUANTIZED}: unquantized pools in the model's {dtype_name(shape.dtype)}"
        if UNQUANTIZED in args.kv_format and shape.dtype != torch.bfloat16
        else ""
    )
    print(
        f"Wan rollout, {shape.layers} layers, {shape.heads}x{shape.head_dim} heads, "
        f"{shape.tokens_per_frame} tokens/frame, {shape.frames_per_block} frames/block, "
        f"sink {shape.sink_frames}, window {shape.window_frames}, B={args.block_size}, "
        f"{steps}+1 forwards/block, CFG batch 2, model {dtype_name(shape.dtype)}, "
        f"{device} [{figures}]{unquantized}"
    )
    print(
        "provider  kv_format  pool           pool_MB  first_block_ms  steady_block_ms  "
        "steady_fps  blocks_timed  max_diff_vs_plain",
        flush=True,
    )
    shared = {
        "figures": figures,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "shape": "tiny" if args.tiny else "wan-1.3b",
        "frames_per_block": shape.frames_per_block,
        "steps": steps,
        "block_size": args.block_size,
    }
    csv_path = None
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        csv_path = args.out / "rollout.csv"
        with open(csv_path, "w", newline="") as stream:
            csv.DictWriter(stream, CSV_COLUMNS).writeheader()

    def report(name: str, result: dict[str, object]) -> None:
        """One provider's row, printed and added to the CSV as its rollout ends."""
        times = result["times"]
        fps, timed = steady_fps(times, full, shape.frames_per_block)
        megabytes = f"{result['pool_bytes'] / 1e6:.3f}" if "pool_bytes" in result else "-"
        provider, _, kv = name.partition(" ")
        row = {
            "provider": provider,
            "kv_format": kv or "-",
            "pool": _pool_name(*result["pool"]),
            "pool_mb": megabytes,
            "first_block_ms": f"{times[0] * 1e3:.1f}",
            "steady_block_ms": f"{shape.frames_per_block / fps * 1e3:.1f}",
            "steady_fps": f"{fps:.3g}",
            "blocks_timed": timed,
            "max_diff_vs_plain": f"{result['max_diff']:.3e}",
        }
        print(
            f"{provider:8s}  {row['kv_format']:9s}  {row['pool']:13s}  {megabytes:>7s}  "
            f"{row['first_block_ms']:>14s}  {row['steady_block_ms']:>15s}  "
            f"{row['steady_fps']:>10s}  {timed:12d}  {row['max_diff_vs_plain']:>17s}",
            flush=True,
        )
        if csv_path is not None:
            with open(csv_path, "a", newline="") as stream:
                csv.DictWriter(stream, CSV_COLUMNS).writerow({**row, **shared})

    run(
        shape,
        blocks=blocks,
        steps=steps,
        block_size=args.block_size,
        device=device,
        kv_formats=tuple(dict.fromkeys(args.kv_format)),
        on_result=report,
    )
    anchors = ", ".join(f"{name} {fps:g} FPS" for name, fps in ANCHORS_FPS.items())
    print(f"anchors (Wan 2.1 1.3B, one H100, as their papers report): {anchors}")
    if csv_path is not None:
        print(f"wrote {csv_path}")
    return 0


def _cuda_build() -> str:
    return f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"


if __name__ == "__main__":
    raise SystemExit(main())

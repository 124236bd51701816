"""GPU yardsticks for the paged kernel: dense attention at the shipped geometry without any
paging, so a sweep's figures can be read against what a flash loop on this GPU does at all.

    python -m paged_video.bench.yardsticks [--keys 28032] [--out DIR]

Times (``triton.testing.do_bench``, median) torch SDPA's cuDNN and flash backends, the plain
table-free loop ``bench.reference_loop.anchor_attention_kernel`` and the Triton tutorial's
warp-specialized loop ``tutorial_attention_kernel`` at several tiles, warps and stages, on
contiguous ``(tokens, 40, 128)`` bf16 q/K/V (keys a multiple of 128, as the loops need); and
the plain loop on e4m3 codes of the same tensors (the FP8 anchor, V stored keys-major): what
an FP8 flash loop does on this GPU at all, the bound on the FP8-MMA mode.
Every output is checked against a float32 reference first (the FP8 loop's against attention
over its codes, allowing for its e4m3 probabilities); a wrong one is printed as WRONG and not
timed (the tutorial's loop wrote NaN at 3 stages on Triton 3.6, bench/RESULTS.md).
Prints one line per run and writes ``DIR/yardsticks.csv``.
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from paged_video.bench.providers import forced_sdpa
from paged_video.bench.reference_loop import anchor_attention_kernel, tutorial_attention_kernel
from paged_video.bench.results import provenance
from paged_video.bench.timing import figures_kind

HEADS, HEAD_DIM, QUERIES = 40, 128, 4680
LOG2E = 1.4426950408889634
# (BLOCK_M, BLOCK_N, warps, stages) of each loop's runs.
ANCHOR_LAUNCHES = ((128, 64, 8, 3), (128, 128, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3))
TUTORIAL_LAUNCHES = ((128, 64, 4, 2), (128, 64, 4, 3), (128, 128, 4, 2), (128, 128, 8, 2))
FP8_ANCHOR_LAUNCHES = ((128, 64, 8, 3), (128, 128, 8, 3), (128, 128, 8, 2))
# bf16 inputs against a float32 reference: far below what a wrong loop is off by.
LIMIT = 2e-2
# The FP8 loop rounds each probability to e4m3 (3 mantissa bits): a bound relative to the
# output's largest magnitude, still far below what a wrong loop is off by.
FP8_RELATIVE_LIMIT = 0.15


def reference(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Float32 attention of ``(tokens, heads, dim)`` tensors, one head at a time."""
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for head in range(q.shape[1]):
        scores = (q[:, head].float() @ k[:, head].float().T) / math.sqrt(q.shape[2])
        out[:, head] = torch.softmax(scores, dim=-1) @ v[:, head].float()
    return out


def _anchor(q: Tensor, k: Tensor, v: Tensor, launch: tuple[int, ...]) -> Callable[[], Tensor]:
    """The plain loop; on e4m3 codes (all ``(tokens, heads, dim)``) the FP8 anchor: V copied
    keys-major here, outside the timed closure, probabilities in units of 1/448, bf16 output."""
    block_m, block_n, warps, stages = launch
    fp8 = q.dtype == torch.float8_e4m3fn
    if fp8:
        v = v.permute(1, 2, 0).contiguous().permute(2, 0, 1)
    out = torch.empty(q.shape, dtype=torch.bfloat16 if fp8 else q.dtype, device=q.device)
    grid = (math.ceil(q.shape[0] / block_m), q.shape[1])

    def run() -> Tensor:
        anchor_attention_kernel[grid](
            q, k, v, out, LOG2E / math.sqrt(HEAD_DIM), q.shape[0], k.shape[0],
            *q.stride()[:2], *k.stride()[:2], *v.stride(), *out.stride()[:2],
            BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=HEAD_DIM, BLOCK_D=HEAD_DIM,
            P_UNIT=448.0 if fp8 else 1.0, num_warps=warps, num_stages=stages,
        )  # fmt: skip
        return out

    return run


def _tutorial(q: Tensor, k: Tensor, v: Tensor, launch: tuple[int, ...]) -> Callable[[], Tensor]:
    block_m, block_n, warps, stages = launch
    out = torch.empty_like(q)
    grid = (math.ceil(q.shape[0] / block_m), q.shape[1])

    def run() -> Tensor:
        tutorial_attention_kernel[grid](
            q, k, v, out, LOG2E / math.sqrt(HEAD_DIM), q.shape[0], k.shape[0], q.shape[1],
            BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=HEAD_DIM,
            num_warps=warps, num_stages=stages,
        )  # fmt: skip
        return out

    return run


def fp8_limit(expected: Tensor) -> float:
    """The FP8 loop's allowed max error against ``expected`` (attention over its codes)."""
    return FP8_RELATIVE_LIMIT * expected.abs().max().item()


def _sdpa(q: Tensor, k: Tensor, v: Tensor, name: str) -> Callable[[], Tensor]:
    """The sweep's forced SDPA backend ``name`` on heads-first views of the same tensors."""
    sdpa = forced_sdpa(name)
    heads_first = [x.transpose(0, 1).unsqueeze(0) for x in (q, k, v)]
    return lambda: sdpa(*heads_first)[0].transpose(0, 1)


def runs(
    q: Tensor, k: Tensor, v: Tensor
) -> list[tuple[str, str, Callable[[], Tensor], Tensor, float]]:
    """(name, launch, closure, expected output, allowed max error) of every yardstick; set-up
    stays out of the closures."""
    expected = reference(q, k, v)
    listed = [("sdpa", n, _sdpa(q, k, v, n)) for n in ("sdpa-cudnn", "sdpa-flash")]
    listed += [("anchor", _name(a), _anchor(q, k, v, a)) for a in ANCHOR_LAUNCHES]
    listed += [("tutorial_ws", _name(a), _tutorial(q, k, v, a)) for a in TUTORIAL_LAUNCHES]
    checked = [(*run, expected, LIMIT) for run in listed]
    codes = [x.to(torch.float8_e4m3fn) for x in (q, k, v)]
    expected_fp8 = reference(*(c.float() for c in codes))
    checked += [
        ("anchor_fp8", _name(a), _anchor(*codes, a), expected_fp8, fp8_limit(expected_fp8))
        for a in FP8_ANCHOR_LAUNCHES
    ]
    return checked


def _name(launch: tuple[int, ...]) -> str:
    return "{}x{}w{}s{}".format(*launch)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=28032, help="a multiple of 128")
    parser.add_argument("--out", type=Path, default=Path("out/yardsticks"))
    args = parser.parse_args(argv)
    if args.keys <= 0 or args.keys % 128:
        parser.error(f"--keys must be a positive multiple of 128, got {args.keys}")
    if not torch.cuda.is_available():
        print("yardsticks: no CUDA device", file=sys.stderr)
        return 2
    from triton.testing import do_bench

    from paged_video.kernels.paged_attention import _ensure_allocator

    _ensure_allocator()  # the tutorial loop makes its descriptors on the device
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (
        torch.randn(n, HEADS, HEAD_DIM, generator=gen, device=device, dtype=torch.bfloat16)
        for n in (QUERIES, args.keys, args.keys)
    )
    flops = 4 * HEADS * QUERIES * args.keys * HEAD_DIM
    shared = provenance(device, figures_kind(device))
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "yardsticks.csv", "w", newline="") as stream:
        columns = ["loop", "launch", "keys", "ms", "tflops", "max_error", "outcome", *shared]
        writer = csv.DictWriter(stream, columns)
        writer.writeheader()
        for loop, launch, run, expected, limit in runs(q, k, v):
            row = {"loop": loop, "launch": launch, "keys": args.keys, **shared}
            try:
                error = (run().float() - expected).abs().max().item()
            except Exception as failure:  # a launch this Triton cannot build: say why
                row["outcome"] = f"failed: {type(failure).__name__}: {str(failure)[:120]}"
            else:
                row["max_error"] = error
                if not error <= limit:  # NaN included
                    row["outcome"] = f"WRONG: max error {error:.3g}; not timed"
                else:
                    ms = do_bench(run, warmup=25, rep=100)
                    row.update(ms=round(ms, 4), tflops=round(flops / ms / 1e9), outcome="ok")
            writer.writerow(row)
            figures = f"{row['ms']:7.3f} ms {row['tflops']:4d} TFLOP/s" if "ms" in row else ""
            print(f"{loop:<12} {launch:<16} {figures:<26} {row['outcome']}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

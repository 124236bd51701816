"""vllm-omni's AR-Diffusion attention with FlashAttention and with this project's kernels.

``python -m paged_video.bench.vllm_omni_compare [--csv FILE]`` on a GPU where vllm (with its
``vllm_flash_attn``) and vllm-omni 0.30.0 are installed. One forward of vllm-omni's own entry
point, ``ar_diffusion_paged_attention``, at the Wan 2.1 1.3B shape (12 heads of 128, bf16,
1560-token frame blocks, a chunk of ``--chunk-frames`` frames after ``--history-chunks`` chunks
of history), in its three ways: the paged FlashAttention call, the contiguous gather
(``VLLM_OMNI_AR_DIFFUSION_KV_GATHER=1``) restaging the whole window, and the gather reusing the
staged history (only the current chunk restaged). Each runs as shipped and then with
``paged_video.integrations.vllm_omni.install()``, in the same process on the same inputs; each
output is checked against float32 attention over the gathered keys before it is timed (CUDA
events, median). Prints a table, and writes the rows as CSV with ``--csv``.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys

import torch

from paged_video.integrations import vllm_omni as integration

GATHER_ENV = "VLLM_OMNI_AR_DIFFUSION_KV_GATHER"
DEVICE = "cuda"
MODES = ("paged", "gather", "gather-reuse")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--frame-tokens", type=int, default=1560, help="tokens per frame = block")
    parser.add_argument("--chunk-frames", type=int, default=3)
    parser.add_argument("--history-chunks", type=int, default=6)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--csv", default=None)
    return parser.parse_args(argv)


def make_inputs(args: argparse.Namespace) -> dict[str, object]:
    """One sequence as vllm-omni builds it: the visible history then the current chunk, blocks
    permuted in the pool, the table padded with block 0 by one action-capacity block."""
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    block, chunk_blocks = args.frame_tokens, args.chunk_frames
    video_blocks = (args.history_chunks + 1) * chunk_blocks
    num_blocks = video_blocks + 2
    ids = torch.randperm(num_blocks - 1, device=DEVICE, generator=gen)[:video_blocks] + 1
    table = torch.zeros(1, video_blocks + 1, dtype=torch.int32, device=DEVICE)
    table[0, :video_blocks] = ids.to(torch.int32)
    shape = (num_blocks, block, args.heads, args.head_dim)
    key_cache = torch.randn(shape, device=DEVICE, generator=gen, dtype=torch.bfloat16)
    value_cache = torch.randn(shape, device=DEVICE, generator=gen, dtype=torch.bfloat16)
    rows = chunk_blocks * block
    query = torch.randn(rows, args.heads, args.head_dim, device=DEVICE, generator=gen)
    stage = torch.empty(table.shape[1] * block, args.heads, args.head_dim, device=DEVICE)
    return {
        "query": query.to(torch.bfloat16),
        "key_cache": key_cache,
        "value_cache": value_cache,
        "block_table": table,
        "query_start_loc": torch.tensor([0, rows], dtype=torch.int32, device=DEVICE),
        "seq_lens": torch.tensor([video_blocks * block], dtype=torch.int32, device=DEVICE),
        "max_query_len": rows,
        "max_seq_len": table.shape[1] * block,
        "softmax_scale": args.head_dim**-0.5,
        "stage": (stage.to(torch.bfloat16), stage.to(torch.bfloat16)),
        "current_tokens": rows,
        "history_blocks": args.history_chunks * chunk_blocks,
    }


def expected(inputs: dict[str, object]) -> torch.Tensor:
    """Float32 attention over the sequence's keys, gathered through the table."""
    block = inputs["key_cache"].shape[1]
    length = int(inputs["seq_lens"][0])
    ids = inputs["block_table"][0, : length // block].long()
    k = inputs["key_cache"][ids].flatten(0, 1).float().transpose(0, 1)
    v = inputs["value_cache"][ids].flatten(0, 1).float().transpose(0, 1)
    q = inputs["query"].float().transpose(0, 1)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=inputs["softmax_scale"])
    return out.transpose(0, 1)


def call(module, inputs: dict[str, object], mode: str) -> torch.Tensor:
    os.environ[GATHER_ENV] = "0" if mode == "paged" else "1"
    staging = {}
    if mode == "gather-reuse":
        stage_key, stage_value = inputs["stage"]
        staging = {
            "stage_key": stage_key,
            "stage_value": stage_value,
            "reuse_history": True,
            "current_tokens": inputs["current_tokens"],
            "stage_first_block": inputs["history_blocks"],
        }
    return module.ar_diffusion_paged_attention(
        inputs["query"],
        inputs["key_cache"],
        inputs["value_cache"],
        block_table=inputs["block_table"],
        query_start_loc=inputs["query_start_loc"],
        seq_lens=inputs["seq_lens"],
        max_query_len=inputs["max_query_len"],
        max_seq_len=inputs["max_seq_len"],
        softmax_scale=inputs["softmax_scale"],
        causal=False,
        **staging,
    )


def time_ms(function, iters: int, warmup: int) -> float:
    for _ in range(warmup):
        function()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        function()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def run(args: argparse.Namespace) -> list[dict[str, object]]:
    from vllm_omni.experimental.ar_diffusion.kv_cache import paged_attention as module

    inputs = make_inputs(args)
    want = expected(inputs)
    # Stage the whole window once, as the block's first forward does, for the reuse mode.
    stage_key, stage_value = inputs["stage"]
    module._stage_window(
        stage_key, stage_value, inputs["key_cache"], inputs["value_cache"],
        inputs["block_table"][0].long(), inputs["block_table"].shape[1],
        inputs["key_cache"].shape[1], first_block=0,
    )  # fmt: skip
    q_rows, keys = inputs["max_query_len"], int(inputs["seq_lens"][0])
    flops = 4 * q_rows * keys * args.heads * args.head_dim
    rows = []
    for backend in ("flash-attn", "paged_video"):
        if backend == "paged_video":
            integration.install(propagate=False)
        for mode in MODES:
            out = call(module, inputs, mode).float()
            error = (out - want).abs().max().item() / want.abs().max().item()
            if not error < 2e-2:  # bf16 output rounding is ~4e-3 of the largest value
                raise SystemExit(f"{backend} {mode}: error {error:.3e} of max |out| vs float32")
            ms = time_ms(lambda mode=mode: call(module, inputs, mode), args.iters, args.warmup)
            rows.append(
                {
                    "backend": backend,
                    "mode": mode,
                    "ms": round(ms, 4),
                    "tflops": round(flops / ms / 1e9, 1),
                    "max_err": f"{error:.2e}",
                }
            )
    integration.uninstall()
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("vllm_omni_compare: needs a CUDA GPU", file=sys.stderr)
        return 2
    rows = run(args)
    fa = {row["mode"]: row["ms"] for row in rows if row["backend"] == "flash-attn"}
    print(
        f"Wan 1.3B AR-Diffusion attention: {args.heads} heads x {args.head_dim}, bf16, blocks of "
        f"{args.frame_tokens}, q {args.chunk_frames * args.frame_tokens}, "
        f"{args.history_chunks} history chunks, on {torch.cuda.get_device_name()}"
    )
    print("| backend | mode | ms (median) | TFLOP/s | max err / max abs (fp32) | vs flash-attn |")
    print("| --- | --- | --- | --- | --- | --- |")
    for row in rows:
        ratio = fa[row["mode"]] / row["ms"]
        print(
            f"| {row['backend']} | {row['mode']} | {row['ms']} | {row['tflops']} | "
            f"{row['max_err']} | {ratio:.2f}x |"
        )
    if args.csv:
        with open(args.csv, "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())

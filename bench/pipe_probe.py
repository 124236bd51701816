"""``python -m paged_video.bench.pipe_probe``: which pipe an int32 -> float32 conversion takes on
the GPU, beside ``exp2``'s (``MUFU.EX2``, 16 results per clock per SM on Hopper).

k8v8's hot loop converts its int32 scores to float32 (``I2FP.F32.S32``) next to the softmax's
``MUFU.EX2``. If the conversion shares that narrow pipe, the loop is bound by it, and an integer
trick would pay more than its instruction count says: ``s + 0x4B400000`` (an integer add; |s| <
2**22) read as float32 is exactly ``12582912.0 + s``, and subtracting ``12582912.0`` is exact,
so ``float(s)`` becomes an integer add and a float add (``bits``).

Micro-kernels, one per instruction mix, each program holding a float32 tile ``x`` and an int32
tile ``n`` in registers and repeating ``REPS`` times, per element (``a = -0.5``, so ``x * a`` is
exact, ``b = 0.25``, ``k`` an int flipping low bits of ``n``):

    ffma       x = fma(x, a, b)
    exp2       x = exp2(fma(x, a, b))
    i2f        n = n ^ k;  x = fma(x, a, float(n))
    exp2+i2f   n = n ^ k;  x = exp2(fma(x, a, float(n)))
    bits       n = n ^ k;  x = fma(x, a, bitcast(n + 0x4B400000) - 12582912.0)
    exp2+bits  n = n ^ k;  x = exp2(fma(x, a, bitcast(n + 0x4B400000) - 12582912.0))

Each mix's output is checked against the same arithmetic in torch (float32; exactly where no
``exp2`` is involved, and ``bits`` against ``i2f``'s kernel bit for bit) before it is timed. A
pair whose time is near the sum of its parts' shares their pipe; near the larger part, it does
not. ``--sass`` compiles every mix for sm_90a on a CPU and counts its loop's instructions per
element and repetition (``sass_counts``). ``--out DIR`` writes ``pipe_probe.csv`` (long format:
one row per mix, with the device, versions, commit and timestamp).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import functools
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
import triton
import triton.language as tl

from paged_video.bench import sass
from paged_video.bench.results import provenance, sig3
from paged_video.bench.timing import TimingSettings, figures_kind, measure

# mix: (exp2 applied, how n becomes float: "" none, "i2f" the conversion, "bits" the trick), in
# the order they run: the question's answer (exp2, i2f, exp2+i2f) before the trick's.
MIXES = {
    "ffma": (False, ""),
    "exp2": (True, ""),
    "i2f": (False, "i2f"),
    "exp2+i2f": (True, "i2f"),
    "bits": (False, "bits"),
    "exp2+bits": (True, "bits"),
}
PAIRS = {"exp2+i2f": ("exp2", "i2f"), "exp2+bits": ("exp2", "bits")}
A, B = -0.5, 0.25
# n ^ K stays in [-2**21, 2**21) (K < 2**20 flips low bits only); with exp2, n is 0 or 1 (K = 1)
# so that exp2's argument stays in [-1, 1].
WIDE_N, K_WIDE, K_EXP2 = 1 << 21, 0x5A5A5, 1
BLOCK_M, BLOCK_N, NUM_WARPS = 128, 64, 8
# Two programs per SM: every mix's programs resident at once (up to 128 registers a thread), so
# no mix pays a partial last wave; 16 warps per SM, 32 independent chains a thread.
PRESETS = {
    "cuda": {"reps": 4096, "programs_per_sm": 2},
    "cpu": {"reps": 8, "programs": 2},
}
COLUMNS = ("mix", "ms", "element_ops_per_s", "vs_exp2", "vs_ffma", "reading", "reps", "elements")
# The GPU's exp2 is approximate (ex2.approx, 2 ulp); a wrong kernel misses by far more.
EXP2_RTOL = 1e-5


@triton.jit
def _mix_kernel(
    x_ptr,
    n_ptr,
    out_ptr,
    a,
    b,
    k,
    EXP2: tl.constexpr,
    CONVERT: tl.constexpr,
    REPS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    offsets = tl.program_id(0) * BLOCK_M * BLOCK_N + rows
    x = tl.load(x_ptr + offsets)
    n = tl.load(n_ptr + offsets)
    for _ in range(REPS):
        if CONVERT == "":
            t = tl.fma(x, a, b)
        else:
            n = n ^ k  # changes n every repetition: the conversion cannot be hoisted
            if CONVERT == "i2f":
                f = n.to(tl.float32)
            else:
                # 0x4B400000: the bits of 12582912.0 = 1.5 * 2**23, whose ulp is 1
                f = (n + 0x4B400000).to(tl.float32, bitcast=True) - 12582912.0
            t = tl.fma(x, a, f)
        x = tl.math.exp2(t) if EXP2 else t
    tl.store(out_ptr + offsets, x)


def inputs(mix: str, programs: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A mix's starting tiles: x in [0.5, 2), n as its K keeps it (``WIDE_N``, or 0 and 1)."""
    gen = torch.Generator().manual_seed(0)
    size = programs * BLOCK_M * BLOCK_N
    x = torch.rand(size, generator=gen) * 1.5 + 0.5
    wide = MIXES[mix][1] and not MIXES[mix][0]
    n = torch.randint(-WIDE_N if wide else 0, WIDE_N if wide else 2, (size,), generator=gen)
    return x.to(device), n.to(torch.int32).to(device)


def _k(mix: str) -> int:
    return K_EXP2 if MIXES[mix][0] else K_WIDE


def launch(mix: str, x: torch.Tensor, n: torch.Tensor, out: torch.Tensor, reps: int) -> None:
    exp2, convert = MIXES[mix]
    grid = (x.numel() // (BLOCK_M * BLOCK_N),)
    _mix_kernel[grid](
        x, n, out, A, B, _k(mix), EXP2=exp2, CONVERT=convert, REPS=reps,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, num_warps=NUM_WARPS,
    )  # fmt: skip


def reference(mix: str, x: torch.Tensor, n: torch.Tensor, reps: int) -> torch.Tensor:
    """The mix's arithmetic in torch, float32: ``x * a`` is exact, so ``f + a * x`` rounds once
    however it is computed, as the kernel's FFMA does. ``n ^ k`` alternates between two values,
    converted once."""
    exp2, convert = MIXES[mix]
    if convert:
        flipped, kept = (n ^ _k(mix)).to(torch.float32), n.to(torch.float32)
    else:
        flipped = kept = torch.full_like(x, B)
    for rep in range(reps):
        t = torch.add(flipped if rep % 2 == 0 else kept, x, alpha=A)
        x = torch.exp2(t) if exp2 else t
    return x


def check(mix: str, out: torch.Tensor, expected: torch.Tensor, twin: torch.Tensor | None) -> None:
    """Refuse a mix whose kernel did not do its arithmetic: equal to torch's bit for bit without
    ``exp2`` (every operation is exact or one rounding), within ``EXP2_RTOL`` with it (the GPU's
    ``exp2`` is approximate; the recurrence contracts, so its errors do not grow); a ``bits``
    mix also equal to its ``i2f`` twin's kernel bit for bit."""
    exp2 = MIXES[mix][0]
    if exp2:
        close = torch.isclose(out, expected, rtol=EXP2_RTOL, atol=0)
    else:
        close = out.view(torch.int32) == expected.view(torch.int32)
    if not bool(close.all()):
        where = int((~close).nonzero()[0])
        raise RuntimeError(
            f"{mix}: the kernel's output differs from torch's at element {where} "
            f"({out[where].item()!r} against {expected[where].item()!r}); not timed"
        )
    if twin is not None and not torch.equal(out.view(torch.int32), twin.view(torch.int32)):
        raise RuntimeError(f"{mix}: not bit for bit its i2f twin's output; not timed")


def measure_mixes(device: torch.device, reps: int, programs: int) -> Iterator[dict[str, object]]:
    """One row per mix, each checked (``check``) before it is timed, yielded as soon as its
    ratios are known (a run its time limit cuts keeps its rows): milliseconds per launch (the
    median on a GPU, the minimum on a CPU), element-repetitions per second, the time over
    ``exp2``'s and ``ffma``'s, and for a pair on a GPU the reading (``reading``)."""
    settings = TimingSettings(rep_ms=50, warmup_ms=10, cpu_reps=3)
    elements = programs * BLOCK_M * BLOCK_N
    outputs: dict[str, torch.Tensor] = {}
    ms: dict[str, float] = {}
    pending = []
    for mix in MIXES:
        x, n = inputs(mix, programs, device)
        out = torch.full_like(x, float("nan"))
        launch(mix, x, n, out, reps)
        twin = outputs.get(mix.replace("bits", "i2f")) if "bits" in mix else None
        check(mix, out, reference(mix, x, n, reps), twin)
        outputs[mix] = out
        timing = measure(functools.partial(launch, mix, x, n, out, reps), device, settings)
        ms[mix] = timing.headline(device)
        pending.append(mix)
        if "ffma" not in ms or "exp2" not in ms:
            continue
        for done in pending:
            gpu_pair = done in PAIRS and device.type == "cuda"
            yield {
                "mix": done,
                "ms": ms[done],
                "element_ops_per_s": elements * reps / (ms[done] / 1e3),
                "vs_exp2": ms[done] / ms["exp2"],
                "vs_ffma": ms[done] / ms["ffma"],
                "reading": reading(ms, done)[0] if gpu_pair else "",
                "reps": reps,
                "elements": elements,
            }
        pending.clear()


def reading(ms: dict[str, float], pair: str) -> tuple[str, str]:
    """Whether a pair's time lies nearer the sum of its parts' (one pipe serves both: "shared")
    or the larger part's (they overlap: "separate"), and a line saying so."""
    first, second = PAIRS[pair]
    shared = ms[first] + ms[second]
    apart = max(ms[first], ms[second])
    # 0 at the larger part's time, 1 at the sum
    position = (ms[pair] - apart) / (shared - apart) if shared > apart else float("nan")
    verdict = "shared" if position > 0.5 else "separate"
    line = (
        f"{pair}: {sig3(ms[pair])} ms; {first} + {second} = {sig3(shared)} ms (one pipe), "
        f"max = {sig3(apart)} ms (two pipes); at {sig3(position)} of the way to the sum: "
        f"{second} {'shares' if verdict == 'shared' else 'does not share'} {first}'s pipe"
    )
    return verdict, line


TABLE_HEADER = "mix        ms        element-ops/s  / exp2  / ffma"


def table_line(row: dict[str, object]) -> str:
    return (
        f"{row['mix']:9}  {sig3(row['ms']):>8}  {float(row['element_ops_per_s']):13.3e}  "
        f"{sig3(row['vs_exp2']):>6}  {sig3(row['vs_ffma']):>5}"
    )


# ---------------------------------------------------------------- the loops' SASS

_REGISTER = re.compile(r"\bU?R\d+\b")
_COUNTER_ADD = re.compile(r"^U?(IADD3|VIADD|IADD)\b")
_STEP = re.compile(r",\s*-?(0x[0-9a-f]+)\s*(,\s*U?RZ\s*)?$")
# Per-thread opcodes counted, by prefix (the uniform datapath's U* are the loop's counter).
CATEGORIES = {
    "MUFU.EX2": ("MUFU.EX2",),
    "I2F": ("I2F",),
    "FFMA": ("FFMA",),
    "FADD": ("FADD",),
    "FMUL": ("FMUL",),
    "IADD": ("IADD", "VIADD"),  # IADD3 too
    "LOP3": ("LOP3",),
}


def unroll_factor(loop: sass.Loop) -> int:
    """Repetitions one pass of the loop runs: the step of the counter its back branch tests
    (LLVM unrolls the short loops; ``UIADD3 UR4, UR4, -0x8, URZ`` is 8)."""
    back = [i for i in loop.instructions if i.opcode.startswith("BRA") and i.guard]
    if len(back) != 1:
        raise ValueError(f"loop at {loop.header:#x}: {len(back)} conditional branches, not one")
    predicate = back[0].guard.lstrip("@!")
    tests = [i for i in loop.instructions if i.operands.startswith(predicate + ",")]
    tested = {r for i in tests for r in _REGISTER.findall(i.operands.split(",", 1)[1])}
    for i in loop.instructions:
        dest, *_ = i.operands.split(",")
        step = _STEP.search(i.operands)
        if _COUNTER_ADD.match(i.opcode) and dest.strip() in tested and step:
            return abs(int(step.group(1), 16))
    raise ValueError(f"loop at {loop.header:#x}: no counter step found")


def the_loop(text: str) -> sass.Loop:
    """The one loop of a mix kernel's SASS (the repetitions)."""
    loops = sass.find_loops(sass.parse_sass(text))
    if len(loops) != 1:
        raise ValueError(f"{len(loops)} loops in the kernel, not one")
    return loops[0]


def loop_counts(loop: sass.Loop, elements_per_thread: int) -> dict[str, float]:
    """The counted opcodes per element and repetition (``all``: every instruction of the loop,
    its counter and branch too)."""
    per = elements_per_thread * unroll_factor(loop)
    counts = {name: loop.count(*prefixes) / per for name, prefixes in CATEGORIES.items()}
    return counts | {"all": loop.size / per}


def _sass_worker(reps: int) -> None:
    """Compile every mix for sm_90a; print one JSON line: Triton's version, each loop's counts,
    its unroll factor and its conversion opcodes."""
    from triton.backends.compiler import GPUTarget

    from paged_video.bench.compile_report import _compile, _tool

    target = GPUTarget("cuda", 90, 32)
    report: dict[str, object] = {"triton": triton.__version__}
    counts, unroll, conversions = {}, {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        for mix, (exp2, convert) in MIXES.items():
            x, n = inputs(mix, 1, torch.device("cpu"))
            kwargs = dict(EXP2=exp2, CONVERT=convert, REPS=reps, BLOCK_M=BLOCK_M,
                          BLOCK_N=BLOCK_N, num_warps=NUM_WARPS)  # fmt: skip
            kernel, _ = _compile(_mix_kernel, (x, n, x, A, B, _k(mix)), kwargs, target)
            cubin.write_bytes(kernel.asm["cubin"])
            command = [_tool("cuobjdump"), "-sass", str(cubin)]
            loop = the_loop(
                subprocess.run(command, capture_output=True, text=True, check=True).stdout
            )
            counts[mix] = loop_counts(loop, BLOCK_M * BLOCK_N // (32 * NUM_WARPS))
            unroll[mix] = unroll_factor(loop)
            conversions[mix] = sorted(
                {i.opcode for i in loop.instructions if i.opcode.startswith("I2F")}
            )
    report.update(counts=counts, unroll=unroll, conversions=conversions)
    print(json.dumps(report))


def sass_counts(
    python: str = sys.executable, reps: int = PRESETS["cuda"]["reps"]
) -> dict[str, object]:
    """Every mix's loop counts (``loop_counts``) compiled for sm_90a by ``python``'s Triton, in
    a child process (compiling needs ``TRITON_INTERPRET=0`` before triton is imported)."""
    from paged_video.bench.compile_report import compile_environment

    env, root = compile_environment()
    done = subprocess.run(
        [python, "-m", "paged_video.bench.pipe_probe", "--sass-worker", "--reps", str(reps)],
        capture_output=True, text=True, env=env, cwd=root, timeout=600,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"compiling the mixes ({python}) failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def format_counts(report: dict[str, object]) -> str:
    names = (*CATEGORIES, "all")
    lines = [f"Triton {report['triton']}, sm_90a, per element and repetition:"]
    lines.append("mix        " + "  ".join(f"{n:>8}" for n in names))
    for mix, counts in report["counts"].items():
        lines.append(f"{mix:9}  " + "  ".join(f"{sig3(counts[n]):>8}" for n in names))
    unroll = ", ".join(f"{mix} {u}" for mix, u in report["unroll"].items())
    opcodes = sorted({op for ops in report["conversions"].values() for op in ops})
    lines.append(f"repetitions per loop pass: {unroll}; conversion: {', '.join(opcodes) or '-'}")
    return "\n".join(lines)


# ---------------------------------------------------------------- command line


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m paged_video.bench.pipe_probe")
    parser.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default=None,
        help="cuda when a GPU is visible, else cpu (Triton's interpreter)",
    )
    parser.add_argument("--out", type=Path, help="folder for pipe_probe.csv")
    parser.add_argument(
        "--reps", type=int, help="repetitions per element (default: 4096 on a GPU, 8 on a CPU)"
    )
    parser.add_argument(
        "--sass",
        action="store_true",
        help="compile every mix for sm_90a (no GPU needed) and count its loop",
    )
    parser.add_argument(
        "--python",
        default=sys.executable,
        help="with --sass: compile with this interpreter's Triton",
    )
    parser.add_argument("--sass-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.reps is not None and args.reps < 1:
        parser.error(f"--reps must be at least 1, got {args.reps}")
    if args.sass_worker:
        _sass_worker(args.reps or PRESETS["cuda"]["reps"])
        return 0
    if args.sass:
        print(format_counts(sass_counts(args.python, args.reps or PRESETS["cuda"]["reps"])))
        return 0
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        parser.error("--device cpu runs Triton's interpreter: set TRITON_INTERPRET=1")
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        programs = PRESETS["cuda"]["programs_per_sm"] * sms
    else:
        programs = PRESETS["cpu"]["programs"]
    reps = args.reps or PRESETS[device.type]["reps"]
    figures = figures_kind(device)
    print(
        f"instruction mixes, {programs} programs of {BLOCK_M}x{BLOCK_N}, {NUM_WARPS} warps, "
        f"{reps} repetitions ({figures}):"
    )
    print(TABLE_HEADER)
    with contextlib.ExitStack() as stack:
        writer = None
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            stream = stack.enter_context(open(args.out / "pipe_probe.csv", "w", newline=""))
            shared = provenance(device, figures)
            writer = csv.DictWriter(stream, fieldnames=(*COLUMNS, *shared))
            writer.writeheader()
        ms = {}
        for row in measure_mixes(device, reps, programs):
            print(table_line(row), flush=True)
            ms[str(row["mix"])] = float(row["ms"])
            if writer is not None:
                writer.writerow(row | shared)
                stream.flush()
    if device.type == "cuda":
        for pair in PAIRS:
            print(reading(ms, pair)[1])
    else:
        print("figures are not speeds (Triton's interpreter): no reading")
    if args.out is not None:
        print(f"wrote {args.out / 'pipe_probe.csv'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""``python -m paged_video.bench compile``: what the GPU would run, read on a CPU.

Compiles the launch configurations that ``paged_attention``, ``write_slots`` and
``gather_blocks`` would use at given geometries for a named target (default ``cuda:90``, built
as sm_90a) with Triton's own ahead-of-time path (``triton.compile`` on an ``ASTSource`` with an
explicit ``GPUTarget``), assembles the PTX with the ``ptxas`` in Triton's wheel (``-v``) and
disassembles it with its ``cuobjdump -sass``. One row per configuration: registers, spills,
shared memory, K/V shared-memory buffers, the ``cp.async`` wait depth in the key loop, TMA and
mbarrier use, the MMA kind, and the SASS instructions and integer divisions in the hottest loop.
``paged_attention`` rows come with a ``reference`` row: the plain table-free loop of
``bench/reference_loop.py`` compiled with the same tiles, warps and stages.

The launch arguments are the launchers' own: each launcher is called on empty CPU tensors of
the geometry with its kernel swapped for a recorder, so tiles, strides and specialisations are
what a GPU call would get. Compiling needs ``TRITON_INTERPRET=0`` before triton is imported
(under the interpreter ``@triton.jit`` gives functions that cannot be compiled), so the work
runs in child processes started with that environment.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import datetime
import importlib
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

KERNEL_NAMES = ("paged_attention", "write_slots", "gather_blocks")
# paged_attention's K/V storage: the query dtype ("same"), e4m3 or int8 codes with scales
# (dequantized before bf16/fp16 MMAs), e4m3 codes with FP8 MMAs (``fp8_mma=True``), or int8
# codes with an int8 Q K^T MMA (``int8_mma=True``).
KV_MODES = ("same", "fp8", "int8", "fp8_mma", "int8_mma")
# The shipped model: 40 heads of 128, bf16, 4680 queries (3 frames of 1560) per forward.
SHIPPED_BLOCK_SIZES = (16, 24, 64, 256, 520, 1560)
SHIPPED = {
    "block_sizes": SHIPPED_BLOCK_SIZES,
    "head_dims": (128,),
    "dtypes": ("bf16",),
    "heads": 40,
    "gqa_group": 1,
    "max_seqlen_q": 4680,
}
MEASURE_COLUMNS = (
    "registers",
    "spill_stores",
    "spill_loads",
    "shared_bytes",
    "kv_buffers",
    "wait_depth",
    "tma",
    "mbarriers",
    "mma",
    "loop_instructions",
    "loop_divisions",
    "mma_loops",
)
CONFIG_COLUMNS = (
    "kernel",
    "path",
    "block_size",
    "tile",
    "num_warps",
    "num_stages",
    "heads",
    "kv_heads",
    "head_dim",
    "dtype",
    "max_seqlen_q",
    "variant",
)
PROVENANCE_COLUMNS = ("target", "ptxas", "triton", "commit", "timestamp")
COLUMNS = (*CONFIG_COLUMNS, *MEASURE_COLUMNS, *PROVENANCE_COLUMNS)

Row = dict[str, object]


@dataclasses.dataclass(frozen=True)
class Config:
    """One launch to compile: a kernel at one geometry (``block_m``/``block_n`` override tiles;
    ``causal``, ``key_limits``, ``gaps`` key gaps per row and ``kv_mode`` (one of
    ``KV_MODES``) select the attention variant)."""

    kernel: str
    block_size: int
    head_dim: int
    dtype: str
    heads: int
    kv_heads: int
    max_seqlen_q: int
    block_m: int | None = None
    block_n: int | None = None
    causal: bool = False
    key_limits: bool = False
    gaps: int = 0
    kv_mode: str = "same"


def configs_for(
    *,
    kernels: Sequence[str] = KERNEL_NAMES,
    block_sizes: Sequence[int] = SHIPPED_BLOCK_SIZES,
    head_dims: Sequence[int] = (128,),
    dtypes: Sequence[str] = ("bf16",),
    heads: int = 40,
    gqa_group: int = 1,
    max_seqlen_q: int = 4680,
    causal: bool = False,
    key_limits: bool = False,
    gaps: int = 0,
    kv_modes: Sequence[str] = ("same",),
) -> list[Config]:
    """Every (kernel, dtype, head_dim, block size, K/V mode); ``write_slots`` ignores the block
    size and only ``paged_attention`` takes K/V modes other than ``same``."""
    for mode in kv_modes:
        if mode not in KV_MODES:
            raise ValueError(f"kv_modes: {mode!r} is not one of {', '.join(KV_MODES)}")
    configs = []
    for kernel in kernels:
        modes = kv_modes if kernel == "paged_attention" else ("same",)
        for dtype in dtypes:
            for head_dim in head_dims:
                sizes = block_sizes[:1] if kernel == "write_slots" else block_sizes
                for block_size, kv_mode in itertools.product(sizes, modes):
                    configs.append(
                        Config(
                            kernel,
                            block_size,
                            head_dim,
                            dtype,
                            heads,
                            heads // gqa_group,
                            max_seqlen_q,
                            causal=causal,
                            key_limits=key_limits,
                            gaps=gaps,
                            kv_mode=kv_mode,
                        )
                    )
    return configs


def parse_target(text: str) -> tuple[str, int]:
    """``cuda:90`` -> ``("cuda", 90)``."""
    backend, _, arch = text.partition(":")
    if backend != "cuda" or not arch.isdigit():
        raise ValueError(f"target must look like cuda:90, got {text!r}")
    return backend, int(arch)


def compile_rows(configs: Sequence[Config], target: str = "cuda:90", workers: int = 2) -> list[Row]:
    """Compile every configuration in up to ``workers`` child processes; rows in config order.

    Reference rows repeated by several block sizes with the same launch settings are kept once.
    """
    parse_target(target)
    configs = list(configs)
    if not configs:
        return []
    workers = max(1, min(workers, len(configs)))
    shares = [configs[i::workers] for i in range(workers)]
    env = dict(os.environ, TRITON_INTERPRET="0")
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    repo = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [repo, env.get("PYTHONPATH")]))
    children = [
        subprocess.Popen(
            [sys.executable, "-m", "paged_video.bench.compile_report", "--worker", target],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=repo,
        )
        for _ in shares
    ]
    results: list[list[list[Row]]] = []
    for child, share in zip(children, shares, strict=True):
        stdout, stderr = child.communicate(json.dumps([dataclasses.asdict(c) for c in share]))
        if child.returncode != 0:
            raise RuntimeError(f"compile worker failed ({child.returncode}):\n{stderr[-4000:]}")
        results.append(json.loads(stdout.strip().splitlines()[-1]))
    by_config = {}
    for share, rows in zip(shares, results, strict=True):
        by_config.update(zip(share, rows, strict=True))
    out: list[Row] = []
    seen_reference = set()
    for config in configs:
        for row in by_config[config]:
            if row["kernel"] == "reference":
                key = tuple(row[c] for c in CONFIG_COLUMNS if c not in ("path", "block_size"))
                if key in seen_reference:
                    continue
                seen_reference.add(key)
            out.append(row)
    return out


# ---------------------------------------------------------------- worker side (no interpreter)


class _Recorder:
    """Stands in for a kernel: ``kernel[grid](*args, **kwargs)`` records the call."""

    def __init__(self) -> None:
        self.calls: list[tuple[tuple, dict]] = []

    def __getitem__(self, grid: object) -> Callable[..., None]:
        def record(*args: object, **kwargs: object) -> None:
            self.calls.append((args, kwargs))

        return record


@contextlib.contextmanager
def _recording(module_name: str, kernel_name: str) -> Iterator[tuple[object, _Recorder]]:
    """Swap a launcher module's kernel for a recorder and let CPU tensors reach the launch."""
    module = importlib.import_module(module_name)
    real = getattr(module, kernel_name)
    recorder = _Recorder()
    saved = module.use_torch_path
    setattr(module, kernel_name, recorder)
    module.use_torch_path = lambda tensor: False
    try:
        yield real, recorder
    finally:
        setattr(module, kernel_name, real)
        module.use_torch_path = saved


def _launches(config: Config) -> list[tuple[str, object, tuple, dict]]:
    """``(kernel, jit function, args, kwargs)`` of the launches one configuration makes."""
    import torch

    from paged_video import kernels
    from paged_video.bench.reference_loop import reference_attention_kernel
    from paged_video.bench.workload import DTYPES

    dtype = DTYPES[config.dtype]
    d, bs = config.head_dim, config.block_size
    empty = lambda *shape, dt=dtype: torch.empty(*shape, dtype=dt)  # touches no memory
    if config.kernel == "paged_attention":
        kv_dtype = {"same": dtype, "int8": torch.int8, "int8_mma": torch.int8}.get(
            config.kv_mode, torch.float8_e4m3fn
        )
        scales = {}
        if config.kv_mode != "same":
            scales = {
                "k_scale": empty(2, bs, config.kv_heads, dt=torch.float32),
                "v_scale": empty(2, bs, config.kv_heads, dt=torch.float32),
                "fp8_mma": config.kv_mode == "fp8_mma",
                "int8_mma": config.kv_mode == "int8_mma",
            }
        with _recording("paged_video.kernels.paged_attention", "_paged_attention_kernel") as (
            real,
            rec,
        ):
            kernels.paged_attention(
                empty(config.max_seqlen_q, config.heads, d),
                empty(2, bs, config.kv_heads, d, dt=kv_dtype),
                empty(2, bs, config.kv_heads, d, dt=kv_dtype),
                torch.zeros(1, 2, dtype=torch.int32),
                torch.tensor([0, config.max_seqlen_q], dtype=torch.int32),
                torch.tensor([2 * bs], dtype=torch.int32),
                max_seqlen_q=config.max_seqlen_q,
                block_m=config.block_m,
                block_n=config.block_n,
                causal=config.causal,
                key_limits=(
                    torch.zeros(config.max_seqlen_q, dtype=torch.int32)
                    if config.key_limits
                    else None
                ),
                key_gap=torch.zeros(1, config.gaps, 2, dtype=torch.int32) if config.gaps else None,
                check_values=False,
                **scales,
            )
        args, kwargs = rec.calls[0]
        launches = [("paged_attention", real, args, kwargs)]
        tiles = {k: kwargs[k] for k in ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")}
        keys = 64 * tiles["BLOCK_N"]
        ref_args = (
            empty(config.max_seqlen_q, config.heads, d),
            empty(keys, config.heads, d),
            empty(keys, config.heads, d),
            empty(config.max_seqlen_q, config.heads, d),
            1.0,
            config.max_seqlen_q,
            keys,
            config.heads * d,
            d,
            config.heads * d,
            d,
            config.heads * d,
            d,
            config.heads * d,
            d,
        )
        ref_kwargs = dict(tiles, HEAD_DIM=d, BLOCK_D=kwargs["BLOCK_D"])
        launches.append(("reference", reference_attention_kernel, ref_args, ref_kwargs))
        return launches
    if config.kernel == "write_slots":
        tokens = config.max_seqlen_q
        with _recording("paged_video.kernels.write_slots", "_write_slots_kernel") as (real, rec):
            kernels.write_slots(
                empty(tokens, config.kv_heads, d),
                empty(tokens, config.kv_heads, d),
                empty(2 * bs, config.kv_heads, d),
                empty(2 * bs, config.kv_heads, d),
                torch.zeros(tokens, dtype=torch.int64),
                check_values=False,
            )
    elif config.kernel == "gather_blocks":
        with _recording("paged_video.kernels.gather_blocks", "_gather_blocks_kernel") as (
            real,
            rec,
        ):
            kernels.gather_blocks(
                empty(2, bs, config.kv_heads, d),
                empty(2, bs, config.kv_heads, d),
                torch.zeros(2, dtype=torch.int32),
                empty(2 * bs, config.kv_heads, d),
                empty(2 * bs, config.kv_heads, d),
                check_values=False,
            )
    else:
        raise ValueError(f"unknown kernel {config.kernel!r}")
    args, kwargs = rec.calls[0]
    return [(config.kernel, real, args, kwargs)]


def _compile(fn: object, args: tuple, kwargs: dict, target: object) -> object:
    """Triton's AOT path with the specialisation a real launch would get."""
    import triton
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.autotuner import Heuristics
    from triton.runtime.jit import create_function_from_signature

    kwargs = dict(kwargs)
    while isinstance(fn, Heuristics):
        named = dict(zip(fn.fn.arg_names, args, strict=False)) | kwargs
        for name, rule in fn.values.items():
            kwargs[name] = rule(named)
        fn = fn.fn
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(
        backend, kwargs, bound, specialization, options
    )
    return triton.compile(
        ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__
    )


def _tool(name: str) -> Path:
    import triton

    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name


def find_ptxas() -> list[Path]:
    """The ``ptxas`` binaries in Triton's wheel, the classic one first."""
    return [p for p in (_tool("ptxas"), _tool("ptxas-blackwell")) if p.is_file()]


def _assemble(ptx: str, arch: str, workdir: Path) -> tuple[str, str, Path]:
    """Assemble with the first wheel ``ptxas`` that accepts the PTX: (name+version, log, cubin)."""
    source = workdir / "kernel.ptx"
    source.write_text(ptx)
    cubin = workdir / "kernel.cubin"
    errors = []
    for ptxas in find_ptxas():
        cmd = [str(ptxas), "-v", "-lineinfo", f"--gpu-name={arch}", str(source), "-o", str(cubin)]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode == 0:
            version = subprocess.run([str(ptxas), "--version"], capture_output=True, text=True)
            release = re.search(r"release (\d+\.\d+)", version.stdout)
            label = f"{ptxas.name} {release.group(1) if release else '?'}"
            return label, result.stdout + result.stderr, cubin
        errors.append(f"{ptxas.name}: {result.stderr.strip()[:300]}")
    raise RuntimeError("no ptxas in Triton's wheel accepted the PTX: " + "; ".join(errors))


_SASS_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")


def parse_sass(text: str) -> list[tuple[int, str, str]]:
    """``(address, opcode, operands)`` of every instruction of ``cuobjdump -sass`` output."""
    return [
        (int(m.group(1), 16), m.group(3), m.group(4).strip())
        for m in map(_SASS_LINE.search, text.splitlines())
        if m
    ]


def sass_loops(instructions: list[tuple[int, str, str]]) -> list[tuple[int, int]]:
    """``(first, last)`` addresses of each loop: a branch back to an earlier address."""
    loops = []
    for address, opcode, operands in instructions:
        if opcode.startswith("BRA"):
            target = re.match(r"`?\(?0x([0-9a-f]+)", operands)
            if target and int(target.group(1), 16) < address:
                loops.append((int(target.group(1), 16), address))
    return loops


# Integer division and modulo by a value unknown at compile time: the float-reciprocal
# emulation starts with a round-toward-+inf conversion of the divisor.
_DIVISION = re.compile(r"^I2F(\.[A-Z0-9]+)*\.RP$")


def analyse_sass(text: str) -> dict[str, object]:
    """MMA kind and the hottest loop: among loops holding MMA instructions, the innermost and
    cheapest one (where the key tiles that need no mask run). NOPs are not counted."""
    instructions = parse_sass(text)
    opcodes = [op for _, op, _ in instructions]
    # wgmma on 16-bit (HGMMA), FP8 (QGMMA) and/or int8 (IGMMA) operands.
    gmma = [
        kind
        for prefix, kind in (("HGMMA", "wgmma"), ("QGMMA", "wgmma.fp8"), ("IGMMA", "wgmma.s8"))
        if any(op.startswith(prefix) for op in opcodes)
    ]
    if gmma:
        mma = "+".join(gmma)
    elif any(op.startswith("HMMA") for op in opcodes):
        mma = "mma.sync"
    else:
        mma = "none"
    loops = []
    for first, last in sass_loops(instructions):
        body = [(op, args) for a, op, args in instructions if first <= a <= last and op != "NOP"]
        if any(op.startswith(("HGMMA", "HMMA", "QGMMA", "IGMMA", "IMMA")) for op, _ in body):
            loops.append((first, last, body))
    innermost = [
        loop
        for loop in loops
        if not any(o is not loop and loop[0] <= o[0] and o[1] <= loop[1] for o in loops)
    ]
    measures: dict[str, object] = {"mma": mma, "mma_loops": len(loops)}
    if innermost:
        _, _, body = min(innermost, key=lambda loop: len(loop[2]))
        waits = [
            int(m.group(1), 16)
            for op, args in body
            if op == "DEPBAR.LE" and (m := re.search(r"SB0,\s*0x([0-9a-f]+)", args))
        ]
        measures["loop_instructions"] = len(body)
        measures["loop_divisions"] = sum(bool(_DIVISION.match(op)) for op, _ in body)
        measures["wait_depth"] = max(waits) if waits else None
    else:
        measures.update(loop_instructions=None, loop_divisions=None, wait_depth=None)
    return measures


_ALLOC = re.compile(r"ttg\.local_alloc\b[^\n]*?!ttg\.memdesc<((?:\d+x)+)\w+, [^>]*mutable")


def kv_buffers(ttgir: str, block_n: int, head_dim: int) -> int | None:
    """Most stages of a multi-buffered K or V tile allocation (``N x BLOCK_N x D`` either way)."""
    depth = []
    for match in _ALLOC.finditer(ttgir):
        dims = [int(x) for x in match.group(1).rstrip("x").split("x")]
        if len(dims) == 3 and sorted(dims[1:]) == sorted([block_n, head_dim]):
            depth.append(dims[0])
    return max(depth) if depth else None


def analyse(kernel: object, arch: str, tile: tuple[int, int], workdir: Path) -> Row:
    """Every measure of one compiled kernel."""
    ptxas, log, cubin = _assemble(kernel.asm["ptx"], arch, workdir)
    registers = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    sass = subprocess.run(
        [str(_tool("cuobjdump")), "-sass", str(cubin)], capture_output=True, text=True, check=True
    ).stdout
    ptx = kernel.asm["ptx"]
    row: Row = {
        "ptxas": ptxas,
        "registers": int(registers.group(1)) if registers else None,
        "spill_stores": int(spills.group(1)) if spills else None,
        "spill_loads": int(spills.group(2)) if spills else None,
        "shared_bytes": kernel.metadata.shared,
        "kv_buffers": kv_buffers(kernel.asm["ttgir"], tile[1], tile[2]) if tile else None,
        "tma": ptx.count("cp.async.bulk.tensor"),
        "mbarriers": len(set(re.findall(r"mbarrier\.init\S*\s+\[([^\]]+)\]", ptx))),
    }
    row.update(analyse_sass(sass))
    return row


def _worker(target_text: str) -> None:
    """Compile the configurations read as JSON on stdin; print one JSON list of rows per config."""
    from triton.backends.compiler import GPUTarget

    backend, arch = parse_target(target_text)
    target = GPUTarget(backend, arch, 32)
    sm = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
    configs = [Config(**c) for c in json.loads(sys.stdin.read())]
    stamp = _provenance(target_text)
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for config in configs:
            rows = []
            for name, fn, args, kwargs in _launches(config):
                kernel = _compile(fn, args, kwargs, target)
                tile = None
                if "BLOCK_N" in kwargs:
                    d = kwargs.get("BLOCK_D")
                    tile = (kwargs["BLOCK_M"], kwargs["BLOCK_N"], d)
                row: Row = {
                    "kernel": name,
                    "path": _path_label(name, kwargs),
                    "block_size": config.block_size if name != "reference" else "",
                    "tile": f"{tile[0]}x{tile[1]}" if tile else _tile_label(kwargs),
                    "num_warps": kwargs.get("num_warps", 4),
                    "num_stages": kwargs.get("num_stages", 3),
                    "heads": config.heads,
                    "kv_heads": config.kv_heads if name != "reference" else config.heads,
                    "head_dim": config.head_dim,
                    "dtype": config.dtype,
                    "max_seqlen_q": config.max_seqlen_q,
                    "variant": _variant(config) if name == "paged_attention" else "",
                }
                row.update(analyse(kernel, sm, tile, Path(tmp)))
                row.update(stamp, ptxas=row["ptxas"])
                rows.append(row)
            out.append(rows)
    print(json.dumps(out))


def _variant(config: Config) -> str:
    parts = [
        name for name, on in (("causal", config.causal), ("key_limits", config.key_limits)) if on
    ]
    if config.gaps:
        parts.append(f"gaps={config.gaps}")
    if config.kv_mode != "same":
        parts.append(f"kv={config.kv_mode}")
    return "+".join(parts) or "plain"


def _path_label(name: str, kwargs: dict) -> str:
    if name == "reference":
        return "contiguous K/V"
    if "KV_PATH" in kwargs:
        return str(kwargs["KV_PATH"])
    if "CONTIGUOUS_TILES" in kwargs:
        return "contiguous" if kwargs["CONTIGUOUS_TILES"] else "per-row"
    return "-"


def _tile_label(kwargs: dict) -> str:
    sizes = [f"{k}={v}" for k, v in kwargs.items() if k.startswith("BLOCK_")]
    return " ".join(sizes)


def _provenance(target: str) -> Row:
    import triton

    from paged_video.bench.results import git_commit

    return {
        "target": target,
        "triton": triton.__version__,
        "commit": git_commit(),
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


# ---------------------------------------------------------------- command line


SHORT_COLUMNS = (
    ("kernel", "kernel"),
    ("path", "path"),
    ("variant", "variant"),
    ("block", "block_size"),
    ("tile", "tile"),
    ("w/s", None),
    ("regs", "registers"),
    ("spill", None),
    ("smem", "shared_bytes"),
    ("kv_buf", "kv_buffers"),
    ("wait", "wait_depth"),
    ("tma", "tma"),
    ("mma", "mma"),
    ("loop_instr", "loop_instructions"),
    ("loop_div", "loop_divisions"),
)


def format_rows(rows: Sequence[Row]) -> str:
    """The report as an aligned plain-text table, provenance first."""
    if not rows:
        return "no configurations"
    first = rows[0]
    head = (
        f"target {first['target']} ({first['ptxas']}), triton {first['triton']}, "
        f"commit {str(first['commit'])[:12]}, {first['timestamp']}"
    )
    table = [[title for title, _ in SHORT_COLUMNS]]
    for row in rows:
        cells = []
        for title, column in SHORT_COLUMNS:
            if title == "w/s":
                value = f"{row['num_warps']}/{row['num_stages']}"
            elif title == "spill":
                value = f"{row['spill_stores']}/{row['spill_loads']}"
            else:
                value = row[column]
            cells.append("-" if value is None or value == "" else str(value))
        table.append(cells)
    widths = [max(len(line[i]) for line in table) for i in range(len(table[0]))]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in table
    ]
    return "\n".join([head, *lines])


def write_csv(rows: Sequence[Row], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as stream:
        writer = csv.DictWriter(stream, fieldnames=COLUMNS, extrasaction="raise")
        writer.writeheader()
        for row in rows:
            writer.writerow({c: "" if row.get(c) is None else row.get(c) for c in COLUMNS})


def add_parser(
    commands: argparse._SubParsersAction, ints: Callable, choices: Callable
) -> argparse.ArgumentParser:
    """Declare the ``compile`` subcommand (``ints``/``choices`` are the CLI's list parsers)."""
    parser = commands.add_parser(
        "compile",
        help="compile the kernels for a GPU target on the CPU and report registers, spills, "
        "pipelining and the key loop's SASS",
        description="Defaults are the shipped geometry. Lists are comma-separated.",
    )
    parser.add_argument("--target", default="cuda:90", help="backend:arch, e.g. cuda:90 (sm_90a)")
    parser.add_argument("--kernels", type=choices(KERNEL_NAMES), default=KERNEL_NAMES)
    parser.add_argument("--block-sizes", type=ints, default=SHIPPED["block_sizes"])
    parser.add_argument("--head-dims", type=ints, default=SHIPPED["head_dims"])
    parser.add_argument("--dtypes", type=choices(("bf16", "fp16", "fp32")), default=("bf16",))
    parser.add_argument("--heads", type=int, default=SHIPPED["heads"])
    parser.add_argument("--gqa-group", type=int, default=1, help="query heads per KV head")
    parser.add_argument("--max-seqlen-q", type=int, default=SHIPPED["max_seqlen_q"])
    parser.add_argument("--causal", action="store_true", help="paged_attention: causal")
    parser.add_argument("--key-limits", action="store_true", help="paged_attention: key_limits")
    parser.add_argument("--gaps", type=int, default=0, help="paged_attention: key gaps per row")
    parser.add_argument(
        "--kv-modes",
        type=choices(KV_MODES),
        default=("same",),
        help="paged_attention: K/V in the query dtype (same), e4m3 or int8 codes dequantized "
        "before 16-bit MMAs (fp8, int8), e4m3 with FP8 MMAs (fp8_mma), or int8 with an int8 "
        "Q K^T MMA (int8_mma)",
    )
    parser.add_argument("--workers", type=int, default=2, help="compile processes")
    parser.add_argument("--out", type=Path, default=Path("out/compile.csv"), help="CSV path")
    return parser


def run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """Run the ``compile`` subcommand."""
    try:
        parse_target(args.target)
    except ValueError as error:
        parser.error(f"--target: {error}")
    if not find_ptxas():
        parser.error("no ptxas in Triton's wheel (triton/backends/nvidia/bin)")
    if args.heads < 1 or args.gqa_group < 1 or args.heads % args.gqa_group:
        parser.error(f"--gqa-group {args.gqa_group} must divide --heads {args.heads}")
    configs = configs_for(
        kernels=args.kernels,
        block_sizes=args.block_sizes,
        head_dims=args.head_dims,
        dtypes=args.dtypes,
        heads=args.heads,
        gqa_group=args.gqa_group,
        max_seqlen_q=args.max_seqlen_q,
        causal=args.causal,
        key_limits=args.key_limits,
        gaps=max(0, args.gaps),
        kv_modes=args.kv_modes,
    )
    rows = compile_rows(configs, args.target, workers=max(1, args.workers))
    print(format_rows(rows))
    write_csv(rows, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] != ["--worker"] or len(sys.argv) != 3:
        raise SystemExit(
            "usage: python -m paged_video.bench.compile_report --worker TARGET  (internal)"
        )
    _worker(sys.argv[2])

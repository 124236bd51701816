"""``python -m paged_video.bench compile``: what the GPU would run, read on a CPU.

Compiles the launches ``paged_attention``, ``write_slots``, ``gather_blocks`` and ``regrow``
(``kernels.regrow``: a write's check and the codes' rescale) would make at given geometries
for a named target (default ``cuda:90``, built as sm_90a) with Triton's own ahead-of-time path
(``triton.compile`` on an ``ASTSource`` with an explicit ``GPUTarget``), and reads the cubin
Triton itself built, ptxas flags and all: registers and stack from ``cuobjdump -res-usage``,
everything else from its ``cuobjdump -sass`` (``bench/sass.py``), both the tools of the same
Triton wheel. Spills are the bytes of the SASS's local stores and loads,
checked against the ``ptxas -v`` log of Triton's own build.

Each launch of ``paged_attention`` comes with two yardsticks from ``bench/reference_loop.py``
compiled by the same Triton: the ``anchor`` (a plain int32-offset flash loop, at the launch's
tiles, warps and stages) and ``tutorial_ws`` (the shape of Triton's fused-attention tutorial:
tensor descriptors, a warp-specialized loop). ``vs_anchor`` / ``vs_tutorial`` divide the
launch's hot loop by theirs. A quantized launch also brings the pass that runs before it
(``query_codes`` for k8v8 and k8v16, ``value_units`` for the dequantizing modes), a row of its
own.

The launch arguments are the launchers' own: each launcher is called on empty CPU tensors of
the geometry with its kernels swapped for recorders, so tiles, strides and specialisations are
what a GPU call would get, and ``Config.launch`` passes extra keywords to the launcher (a kernel
variant, a tile size). The compiles run in child processes of one or more Python interpreters
(``pythons``): each reports with its own Triton, so one report puts the Triton of the GPU image
beside a newer one. Compiling needs ``TRITON_INTERPRET=0`` before triton is imported (under
the interpreter ``@triton.jit`` gives functions that cannot be compiled), which the children
get.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import datetime
import importlib
import inspect
import io
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from paged_video.bench import sass

KERNEL_NAMES = ("paged_attention", "write_slots", "gather_blocks", "regrow")
# paged_attention's K/V storage: the query dtype ("same"), int8 codes with scales (dequantized
# before bf16/fp16 MMAs; the e4m3 pool's fp8 modes were deleted, issue 45). ``_keys``: the mode
# over keys-major pools (``kernels.keys_major``, ``PagingConfig(keys_major=True)``): the scale
# pools. ``k8v8``: int8 K (an
# int8 Q K^T MMA) and keys-major e4m3 V of frozen channel scales (an FP8 P V MMA), ``k8v8_keys``
# with K's scales keys-major too, ``k8v8_blocks`` with V's scales per block as well. ``k8v16``: int8
# K and V in the query dtype (a 16-bit P V MMA), ``k8v16_keys`` with K's scales keys-major.
KV_MODES = (
    "same",
    "int8",
    "int8_keys",
    "k8v8",
    "k8v8_keys",
    "k8v8_blocks",
    "k8v16",
    "k8v16_keys",
)
YARDSTICKS = ("anchor", "tutorial_ws")
# The K/V modes weighed against the FP8 anchor (the anchor kernel on e4m3 codes, an ``anchor``
# row whose ``kv_mode`` says ``FP8_ANCHOR``) rather than the 16-bit one.
FP8_ANCHOR_MODES = ("k8v8", "k8v8_keys", "k8v8_blocks")
FP8_ANCHOR = "k8v8"
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
CONFIG_COLUMNS = (
    "kernel",
    "path",
    "variant",
    "features",
    "kv_mode",
    "block_size",
    "tile",
    "num_warps",
    "num_stages",
    "heads",
    "kv_heads",
    "head_dim",
    "dtype",
    "max_seqlen_q",
)
MEASURE_COLUMNS = (
    "registers",
    "spill_stores",
    "spill_loads",
    "stack_bytes",
    "shared_bytes",
    "kv_buffers",
    "wait_depth",
    "mma",
    "tma_loads",
    "global_access_bytes",
    "mbarriers",
    "setmaxnreg",
    "partitions",
    "partition_warps",
    "partition_roles",
    "consumer_warps",
    "key_loops",
    "loop_instructions",
    "masked_loop_instructions",
    "producer_loop_instructions",
    "loop_int64_ops",
    "loop_global_loads",
    "loop_mbarrier_ops",
    "loop_divisions",
    "loop_exponentials",
    "loop_int_to_float",
    "loop_barriers",
    "loop_shared_stores",
    "loop_shuffles",
    "loop_serial_instructions",
    "loop_register_a_mmas",
    "wgmma_serialized",
    "wgmma_injected_waits",
    "sass_instructions",
    "vs_anchor",
    "vs_tutorial",
    "error",
)
PROVENANCE_COLUMNS = ("target", "triton", "ptxas", "commit", "timestamp")
COLUMNS = (*CONFIG_COLUMNS, *MEASURE_COLUMNS, *PROVENANCE_COLUMNS)
_WORKER_MODULE = "paged_video.bench.compile_report"

Row = dict[str, object]
LaunchOptions = tuple[tuple[str, object], ...]


@dataclasses.dataclass(frozen=True)
class Config:
    """One launch to compile: a kernel at one geometry. ``causal``, ``key_limits``, ``gaps``
    (key gaps per row) and ``kv_mode`` (one of ``KV_MODES``) select the attention's features;
    ``launch`` holds extra keywords for the ``paged_attention`` launcher, as ``(name, value)``
    pairs (e.g. ``(("block_n", 128),)``): a kernel variant is one such set."""

    kernel: str
    block_size: int
    head_dim: int
    dtype: str
    heads: int
    kv_heads: int
    max_seqlen_q: int
    causal: bool = False
    key_limits: bool = False
    gaps: int = 0
    kv_mode: str = "same"
    launch: LaunchOptions = ()


def variant_label(launch: LaunchOptions) -> str:
    """``default`` for the launcher's own choice, else the options: ``variant=tma`` shows as
    ``tma``, others as ``name=value``, joined by ``+``."""
    parts = [str(v) if k == "variant" else f"{k}={v}" for k, v in launch]
    return "+".join(parts) or "default"


def features_label(config: Config) -> str:
    """``plain``, or the masking features: ``causal+key_limits``, ``gaps=1``..."""
    parts = [name for name in ("causal", "key_limits") if getattr(config, name)]
    if config.gaps:
        parts.append(f"gaps={config.gaps}")
    return "+".join(parts) or "plain"


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
    launches: Sequence[dict[str, object]] = ({},),
) -> list[Config]:
    """Every (kernel, dtype, head_dim, block size, K/V mode, launch options); only
    ``paged_attention`` takes K/V modes other than ``same`` and launch options."""
    for mode in kv_modes:
        if mode not in KV_MODES:
            raise ValueError(f"kv_modes: {mode!r} is not one of {', '.join(KV_MODES)}")
    option_sets = [tuple(options.items()) for options in launches] or [()]
    configs = []
    for kernel in kernels:
        attention = kernel == "paged_attention"
        modes = kv_modes if attention else ("same",)
        sizes = block_sizes
        for dtype, head_dim, block_size, kv_mode, launch in itertools.product(
            dtypes, head_dims, sizes, modes, option_sets if attention else [()]
        ):
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
                    launch=launch,
                )
            )
    return configs


def parse_target(text: str) -> tuple[str, int]:
    """``cuda:90`` -> ``("cuda", 90)``."""
    backend, _, arch = text.partition(":")
    if backend != "cuda" or not arch.isdigit():
        raise ValueError(f"target must look like cuda:90, got {text!r}")
    return backend, int(arch)


def parse_launch(text: str) -> dict[str, object]:
    """``variant=tma,block_n=128`` -> ``{"variant": "tma", "block_n": 128}``: integers,
    ``true``/``false`` and ``none`` are converted, anything else stays a string."""
    options: dict[str, object] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = item.partition("=")
        if not sep or not name.isidentifier():
            raise ValueError(f"expected NAME=VALUE[,NAME=VALUE...], got {text!r}")
        words = {"true": True, "false": False, "none": None}
        if re.fullmatch(r"-?\d+", value):
            options[name] = int(value)
        else:
            options[name] = words.get(value.lower(), value)
    return options


# Attention-kernel settings a GPU probe forces (``bench.launch_probe``'s ``+wide`` and ``+bits``)
# and no launcher keyword takes: a ``--launch`` option of that name (``SCORE_BITS=true``) sets
# it in the kernel's launch.
PROBE_SETTINGS = ("WIDE_SCALES", "SCORE_BITS")


def check_launch_options(options: dict[str, object]) -> None:
    """Refuse a launch option the ``paged_attention`` launcher does not take (by name), but a
    probe setting (``PROBE_SETTINGS``, a bool)."""
    from paged_video.kernels import paged_attention

    parameters = inspect.signature(paged_attention).parameters
    fixed = {"q", "k_cache", "v_cache", "block_table", "cu_seqlens_q", "seq_lens_k"}
    fixed |= {"max_seqlen_q", "causal", "key_limits", "key_gap", "check_values"}
    fixed |= {"k_scale", "v_scale", "fp8_mma", "int8_mma", "out", "v_channel_scale"}
    for name, value in options.items():
        if name in PROBE_SETTINGS:
            if not isinstance(value, bool):
                raise ValueError(f"{name} is true or false, got {value!r}")
            continue
        if name not in parameters:
            raise ValueError(f"paged_attention takes no keyword {name!r}")
        if name in fixed:
            raise ValueError(f"{name!r} is set by the report's own options, not a launch option")


# ---------------------------------------------------------------- the interpreters


def resolve_python(python: str) -> str:
    """An interpreter's path: a path as given, or a bare name looked up on ``PATH``."""
    found = python if os.sep in python else shutil.which(python)
    path = Path(found or python)
    if not path.is_file() or not os.access(path, os.X_OK):
        raise ValueError(f"{python}: not an executable file")
    return str(path.absolute())


def probe_python(python: str) -> str:
    """The Triton version a Python interpreter brings (with its wheel's cuobjdump), or a
    one-line ``ValueError`` saying why it cannot compile."""
    path = Path(resolve_python(python))
    code = (
        "import os, triton; from triton import knobs; "
        "tool = knobs.nvidia.cuobjdump; "
        "print(triton.__version__ if tool and os.path.isfile(tool.path) else 'no-cuobjdump')"
    )
    try:
        result = subprocess.run(
            [str(path), "-c", code],
            capture_output=True,
            text=True,
            env=dict(os.environ, TRITON_INTERPRET="0"),
            timeout=300,
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        raise ValueError(f"{python}: cannot run ({error})") from None
    version = result.stdout.strip().splitlines()[-1:] if result.returncode == 0 else []
    if not version:
        last = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise ValueError(f"{python}: cannot import triton ({last})")
    if version[0] == "no-cuobjdump":
        raise ValueError(f"{python}: Triton's wheel has no cuobjdump (triton/backends/nvidia/bin)")
    return version[0]


def venv_python(venv: Path) -> str:
    """The interpreter of a virtual environment folder."""
    for candidate in (venv / "bin" / "python", venv / "Scripts" / "python.exe"):
        if candidate.is_file():
            return str(candidate)
    raise ValueError(f"{venv}: no bin/python in it (not a virtual environment)")


def _project_root() -> str:
    """The folder holding the ``paged_video`` package (a clone's root when run from one)."""
    import paged_video

    return str(Path(paged_video.__file__).resolve().parents[1])


def compile_environment() -> tuple[dict[str, str], str]:
    """The environment of a child that compiles for the GPU (Triton's compiler, not its
    interpreter; FP fusion as Triton's default unless set; this project importable from the
    clone) and the folder it runs in."""
    env = dict(os.environ, TRITON_INTERPRET="0")
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    root = _project_root()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    return env, root


def _shares(configs: Sequence[Config], workers: int) -> list[list[Config]]:
    """Configurations split between workers, those differing only in block size together (a
    worker compiles each yardstick once)."""
    groups: dict[tuple, list[Config]] = {}
    for config in configs:
        key = dataclasses.astuple(dataclasses.replace(config, block_size=0))
        groups.setdefault(key, []).append(config)
    shares: list[list[Config]] = [[] for _ in range(min(workers, len(groups)) or 1)]
    for group in sorted(groups.values(), key=len, reverse=True):
        min(shares, key=len).extend(group)
    return [share for share in shares if share]


def _run_workers(python: str, shares: Sequence[Sequence[Config]], target: str) -> list[list[Row]]:
    """One child per share, all at once; rows per configuration, in share order."""
    env, root = compile_environment()
    env["TRITON_DUMP_PTXAS_LOG"] = "1"
    with tempfile.TemporaryDirectory(prefix="compile-report-") as tmp:
        children = []
        for n, share in enumerate(shares):
            # A fresh cache: Triton runs its ptxas, whose log checks the spills read from SASS.
            env_n = dict(env, TRITON_CACHE_DIR=os.path.join(tmp, f"cache{n}"))
            # Files, not pipes, take the output: a child never waits for the parent to read.
            stdout = open(os.path.join(tmp, f"out{n}"), "w+")  # noqa: SIM115 - closed below
            stderr = open(os.path.join(tmp, f"err{n}"), "w+")  # noqa: SIM115 - closed below
            child = subprocess.Popen(
                [python, "-m", _WORKER_MODULE, "--worker", target],
                stdin=subprocess.PIPE,
                stdout=stdout,
                stderr=stderr,
                text=True,
                env=env_n,
                cwd=root,
            )
            child.stdin.write(json.dumps([dataclasses.asdict(c) for c in share]))
            child.stdin.close()
            children.append((child, stdout, stderr))
        finished = []
        try:
            for child, stdout, stderr in children:
                child.wait()
                with stdout, stderr:
                    stdout.seek(0)
                    stderr.seek(0)
                    finished.append((child.returncode, stdout.read(), stderr.read()))
        finally:  # interrupted: no worker outlives the report
            for child, _, _ in children:
                if child.poll() is None:
                    child.kill()
                    child.wait()
    results = []
    for returncode, output, errors in finished:
        if returncode != 0:
            raise RuntimeError(
                f"compile worker ({python}) failed ({returncode}):\n{errors[-4000:]}"
            )
        results.extend(json.loads(output.strip().splitlines()[-1]))
    return results


def compile_rows(
    configs: Sequence[Config],
    target: str = "cuda:90",
    workers: int = 2,
    pythons: Sequence[str] = (),
) -> list[Row]:
    """Compile every configuration with each Python interpreter's Triton (default: this one),
    up to ``workers`` child processes at a time; rows in config order, each configuration's
    rows of every Triton together, the yardsticks once per Triton and settings."""
    parse_target(target)
    configs = list(configs)
    pythons = list(dict.fromkeys(pythons)) or [sys.executable]
    if not configs:
        return []
    shares = _shares(configs, max(1, workers))
    per_python = []
    for python in pythons:
        rows_by_config = _run_workers(python, shares, target)
        flat = [c for share in shares for c in share]
        per_python.append(dict(zip(flat, rows_by_config, strict=True)))
    stamp = _provenance(target)
    out: list[Row] = []
    seen = set()
    for config in configs:
        for by_config in per_python:
            for row in by_config[config]:
                if row["kernel"] in YARDSTICKS:
                    key = (row["triton"], *(row[c] for c in CONFIG_COLUMNS))
                    if key in seen:
                        continue
                    seen.add(key)
                row.update(stamp)
                out.append(row)
    add_ratios(out)
    return out


def _keys_per_iteration(row: Row) -> int | None:
    match = re.fullmatch(r"\d+x(\d+)", str(row.get("tile")))
    return int(match.group(1)) if match else None


def _yardstick_loop(row: Row) -> float | None:
    """A yardstick's instructions per key: its shortest unmasked key loop (with one loop per
    consumer partition, the best a consumer does) over its tile's keys. Ratios against it
    never flatter the kernel."""
    sizes = [int(s) for s in str(row.get("key_loops") or "").split(",") if s.isdigit()]
    keys = _keys_per_iteration(row)
    return min(sizes) / keys if sizes and keys else None


def add_ratios(rows: Sequence[Row]) -> None:
    """``vs_anchor`` / ``vs_tutorial``: a row's hot-loop instructions per key over the
    yardstick's, of the same Triton (the anchor at the same tile, warps and stages, the
    tutorial at its own settings: a 128-key loop is weighed against twice a 64-key loop). The
    k8v8 launches' anchor is the FP8 one (``FP8_ANCHOR_MODES``)."""
    # Warp-specialized launches are weighed against an anchor with as many warps doing MMAs.
    settings = ("head_dim", "dtype", "tile", "consumer_warps", "num_stages")
    anchors, tutorials = {}, {}
    for row in rows:
        if row["kernel"] == "anchor":
            key = (row["triton"], row.get("kv_mode") or "", *(row[c] for c in settings))
            anchors[key] = _yardstick_loop(row)
        elif row["kernel"] == "tutorial_ws":
            tutorials[(row["triton"], row["head_dim"], row["dtype"])] = _yardstick_loop(row)
    for row in rows:
        if row["kernel"] in YARDSTICKS:
            row["vs_anchor"] = row["vs_tutorial"] = None
            continue
        loop, keys = row.get("loop_instructions"), _keys_per_iteration(row)
        per_key = loop / keys if loop and keys else None
        fp8 = FP8_ANCHOR if row.get("kv_mode") in FP8_ANCHOR_MODES else ""
        anchor = anchors.get((row["triton"], fp8, *(row[c] for c in settings)))
        tutorial = tutorials.get((row["triton"], row["head_dim"], row["dtype"]))
        row["vs_anchor"] = round(per_key / anchor, 3) if per_key and anchor else None
        row["vs_tutorial"] = round(per_key / tutorial, 3) if per_key and tutorial else None


def _provenance(target: str) -> Row:
    return {
        "target": target,
        "commit": _commit(),
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def _commit() -> str:
    """``git rev-parse HEAD``, with ``+dirty`` when tracked files differ from it."""
    from paged_video.bench.results import git_commit

    commit = git_commit()
    try:
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).resolve().parent,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return commit
    return f"{commit}+dirty" if status.strip() and commit != "unknown" else commit


# ---------------------------------------------------------------- worker side (no interpreter)


class _Recorder:
    """Stands in for a kernel: ``kernel[grid](*args, **kwargs)`` records the call."""

    def __init__(self, name: str, calls: list) -> None:
        self.name, self.calls = name, calls

    def __getitem__(self, grid: object) -> Callable[..., None]:
        def record(*args: object, **kwargs: object) -> None:
            self.calls.append((self.name, args, kwargs))

        return record


@contextlib.contextmanager
def _recording(module_name: str) -> Iterator[tuple[dict, list]]:
    """Swap every Triton kernel of a launcher module for a recorder and let CPU tensors reach
    the launch: yields ({name: real kernel}, [(name, args, kwargs) per launch])."""
    from triton.runtime.jit import KernelInterface

    module = importlib.import_module(module_name)
    real = {n: v for n, v in vars(module).items() if isinstance(v, KernelInterface)}
    calls: list = []
    saved = getattr(module, "use_torch_path", None)
    for name in real:
        setattr(module, name, _Recorder(name, calls))
    if saved is not None:
        module.use_torch_path = lambda tensor: False
    try:
        yield real, calls
    finally:
        for name, kernel in real.items():
            setattr(module, name, kernel)
        if saved is not None:
            module.use_torch_path = saved


@dataclasses.dataclass
class _Launch:
    """One compile: the row's labels, the jit function and a launch's arguments."""

    kernel: str
    fn: object
    args: tuple
    kwargs: dict
    labels: dict


def _paged_launches(config: Config) -> list[_Launch]:
    import torch

    from paged_video import kernels
    from paged_video.bench.workload import DTYPES
    from paged_video.kernels import pool_layout

    dtype = DTYPES[config.dtype]
    d, bs = config.head_dim, config.block_size
    empty = lambda *shape, dt=dtype: torch.empty(*shape, dtype=dt)  # touches no memory
    kv_dtype = dtype if config.kv_mode == "same" else torch.int8
    scales = {}
    if config.kv_mode != "same":
        scales = {
            "k_scale": empty(2, bs, config.kv_heads, dt=torch.float32),
            "v_scale": empty(2, bs, config.kv_heads, dt=torch.float32),
        }
    v_cache = empty(2, bs, config.kv_heads, d, dt=kv_dtype)
    k8v8 = config.kv_mode.startswith("k8v8")
    if k8v8:
        kv_dtype = torch.int8
        v_cache = pool_layout.empty_keys_major(2, bs, config.kv_heads, d, dtype=torch.float8_e4m3fn)
        k_scale = empty(2, bs, config.kv_heads, dt=torch.float32)
        if config.kv_mode != "k8v8":
            k_scale = pool_layout.empty_keys_major(2, bs, config.kv_heads, dtype=torch.float32)
        channels = empty(1, config.kv_heads, d, dt=torch.float32).expand(2, -1, -1)
        if config.kv_mode == "k8v8_blocks":
            channels = empty(2, config.kv_heads, d, dt=torch.float32)
        scales = {"k_scale": k_scale, "v_channel_scale": channels}
    elif config.kv_mode.startswith("k8v16"):
        kv_dtype = torch.int8
        v_cache = empty(2, bs, config.kv_heads, d)
        k_scale = empty(2, bs, config.kv_heads, dt=torch.float32)
        if config.kv_mode == "k8v16_keys":
            k_scale = pool_layout.empty_keys_major(2, bs, config.kv_heads, dtype=torch.float32)
        scales = {"k_scale": k_scale}
    elif config.kv_mode.endswith("_keys"):
        for name in ("k_scale", "v_scale"):
            scales[name] = pool_layout.empty_keys_major(2, bs, config.kv_heads, dtype=torch.float32)
    # The warp-specialized variant merges two partial attentions (recorded, left out of the
    # report: no attention kernel); k8v8 and k8v16 first round the query rows, the dequantizing
    # modes take their probability unit (rows of their own, ``query_codes`` and
    # ``value_units``, so the GPU image's Triton is known to build them too).
    with (
        _recording("paged_video.kernels.paged_attention") as (real, calls),
        _recording("paged_video.kernels.merge_states"),
        _recording("paged_video.kernels.query_codes") as (codes_real, codes_calls),
        _recording("paged_video.kernels.value_units") as (units_real, units_calls),
    ):
        kernels.paged_attention(
            empty(config.max_seqlen_q, config.heads, d),
            empty(2, bs, config.kv_heads, d, dt=kv_dtype),
            v_cache,
            torch.zeros(1, 2, dtype=torch.int32),
            torch.tensor([0, config.max_seqlen_q], dtype=torch.int32),
            torch.tensor([2 * bs], dtype=torch.int32),
            max_seqlen_q=config.max_seqlen_q,
            causal=config.causal,
            key_limits=(
                torch.zeros(config.max_seqlen_q, dtype=torch.int32) if config.key_limits else None
            ),
            key_gap=torch.zeros(1, config.gaps, 2, dtype=torch.int32) if config.gaps else None,
            check_values=False,
            **scales,
            **{k: v for k, v in config.launch if k not in PROBE_SETTINGS},
        )
    if not calls:
        raise RuntimeError("paged_attention launched no Triton kernel of its module")
    forced = {k: v for k, v in config.launch if k in PROBE_SETTINGS}
    launches = []
    for name, args, kwargs in calls:
        label = "paged_attention" if len(calls) == 1 else f"paged_attention/{name}"
        if forced and name == "_paged_attention_kernel":
            kwargs = {**kwargs, **forced}
        launches.append(_Launch(label, real[name], args, kwargs, {}))
    for label, real_kernels, recorded in (
        ("query_codes", codes_real, codes_calls),
        ("value_units", units_real, units_calls),
    ):
        for name, args, kwargs in recorded:
            launches.append(_Launch(label, real_kernels[name], args, kwargs, {}))
    first = calls[0][2]
    if {"BLOCK_M", "BLOCK_N"} <= first.keys() and {"BLOCK_D", "HEAD_DIM"} & first.keys():
        launches.append(_anchor_launch(config, first))
        if config.kv_mode in FP8_ANCHOR_MODES:
            launches.append(_anchor_launch(config, first, fp8=True))
    if d & (d - 1) == 0 and d >= 16 and config.dtype in ("bf16", "fp16"):
        launches.append(_tutorial_launch(config))
    return launches


def _anchor_launch(config: Config, paged_kwargs: dict, *, fp8: bool = False) -> _Launch:
    """The anchor at the launch's tiles; ``fp8``: the FP8 anchor (e4m3 q/K, keys-major e4m3 V,
    bf16 output), labelled ``FP8_ANCHOR``: the k8v8 modes weigh against it."""
    import torch

    from paged_video.bench.reference_loop import anchor_attention_kernel
    from paged_video.bench.workload import DTYPES

    dtype, d, h = DTYPES[config.dtype], config.head_dim, config.heads
    settings = {k: paged_kwargs[k] for k in ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")}
    keys = 64 * settings["BLOCK_N"]
    operand = torch.float8_e4m3fn if fp8 else dtype
    tokens = lambda n, dt=operand: torch.empty(n, h, d, dtype=dt)
    q_len = config.max_seqlen_q
    v = torch.empty(h, d, keys, dtype=operand).permute(2, 0, 1) if fp8 else tokens(keys)
    out = tokens(q_len, torch.bfloat16 if fp8 else dtype)
    args = (tokens(q_len), tokens(keys), v, out, 1.0, q_len, keys)
    args += (h * d, d, h * d, d, *v.stride(), h * d, d)
    block_d = paged_kwargs.get("BLOCK_D", paged_kwargs.get("HEAD_DIM"))
    kwargs = dict(settings, HEAD_DIM=d, BLOCK_D=block_d)
    labels = {"path": "contiguous"}
    if fp8:
        kwargs["P_UNIT"] = 448.0
        labels["kv_mode"] = FP8_ANCHOR
    return _Launch("anchor", anchor_attention_kernel, args, kwargs, labels)


def _tutorial_launch(config: Config) -> _Launch:
    import torch

    from paged_video.bench.reference_loop import TUTORIAL_LAUNCH, tutorial_attention_kernel
    from paged_video.bench.workload import DTYPES

    dtype, d, h = DTYPES[config.dtype], config.head_dim, config.heads
    keys = 64 * TUTORIAL_LAUNCH["BLOCK_N"]
    tokens = lambda n: torch.empty(n, h, d, dtype=dtype)
    q_len = config.max_seqlen_q
    args = (tokens(q_len), tokens(keys), tokens(keys), tokens(q_len), 1.0, q_len, keys, h)
    kwargs = dict(TUTORIAL_LAUNCH, HEAD_DIM=d)
    return _Launch("tutorial_ws", tutorial_attention_kernel, args, kwargs, {"path": "tma+ws"})


def _launches(config: Config) -> list[_Launch]:
    """The compiles of one configuration: its launches, then its yardsticks."""
    import torch

    from paged_video import kernels
    from paged_video.bench.workload import DTYPES

    if config.kernel == "paged_attention":
        return _paged_launches(config)
    dtype = DTYPES[config.dtype]
    d, bs = config.head_dim, config.block_size
    empty = lambda *shape: torch.empty(*shape, dtype=dtype)  # touches no memory
    if config.kernel == "write_slots":
        tokens = config.max_seqlen_q
        # Into the paged pools a cache of this block size holds (slot-major blocks).
        with _recording("paged_video.kernels.write_slots") as (real, calls):
            kernels.write_slots(
                empty(tokens, config.kv_heads, d),
                empty(tokens, config.kv_heads, d),
                empty(2, bs, config.kv_heads, d),
                empty(2, bs, config.kv_heads, d),
                torch.zeros(tokens, dtype=torch.int64),
                check_values=False,
            )
    elif config.kernel == "gather_blocks":
        with _recording("paged_video.kernels.gather_blocks") as (real, calls):
            kernels.gather_blocks(
                empty(2, bs, config.kv_heads, d),
                empty(2, bs, config.kv_heads, d),
                torch.zeros(2, dtype=torch.int32),
                empty(2 * bs, config.kv_heads, d),
                empty(2 * bs, config.kv_heads, d),
                check_values=False,
            )
    elif config.kernel == "regrow":
        # A later write's check over its rows (K smoothed), then the int8 codes of the pools a
        # cache of this block size holds, rescaled (kernels.regrow).
        from paged_video.kernels import regrow

        heads = config.kv_heads
        ones = torch.ones(heads, d)
        with _recording("paged_video.kernels.regrow") as (real, calls):
            tokens = config.max_seqlen_q
            slots = torch.zeros(tokens, dtype=torch.int64)
            regrow.regrown_factors(ones, empty(tokens, heads, d), ones, slots, 0.5)
            codes = torch.empty(2, bs, heads, d, dtype=torch.int8)
            regrow.regrow_codes(codes, ones, ones, torch.zeros(heads, dtype=torch.bool))
    else:
        raise ValueError(f"unknown kernel {config.kernel!r}")
    # A launcher of several kernels (regrow) names each row's.
    named = {n for n, _, _ in calls}
    return [
        _Launch(
            config.kernel if len(named) == 1 else f"{config.kernel}/{n.strip('_')}",
            real[n],
            args,
            kwargs,
            {},
        )
        for n, args, kwargs in calls
    ]


def _compile(fn: object, args: tuple, kwargs: dict, target: object) -> tuple[object, str]:
    """Triton's AOT path with the specialisation a real launch would get: (compiled kernel,
    the ``ptxas -v`` log Triton printed for it, empty if it came from Triton's cache)."""
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
    log = io.StringIO()
    with contextlib.redirect_stdout(log):  # TRITON_DUMP_PTXAS_LOG prints the log
        kernel = triton.compile(
            ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__
        )
    return kernel, log.getvalue()


def check_ptxas_log(log: str, registers: int, spills: tuple[int, int]) -> None:
    """Refuse figures read from the cubin that Triton's own ``ptxas -v`` log contradicts."""
    used = re.findall(r"Used (\d+) registers", log)
    spilled = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    if len(used) > 1 or len(spilled) > 1:
        raise RuntimeError("ptxas log describes more than one kernel")
    if used and int(used[0]) != registers:
        raise RuntimeError(f"cubin has {registers} registers, Triton's ptxas log {used[0]}")
    if spilled and tuple(map(int, spilled[0])) != tuple(spills):
        raise RuntimeError(
            f"SASS spills {spills[0]}/{spills[1]} bytes, Triton's ptxas log "
            f"{spilled[0][0]}/{spilled[0][1]}"
        )


# ptxas's notes on warpgroup MMAs: C7514, it serialized them (a wait after every wgmma, since a
# non-wgmma instruction reads an accumulator while it may be in flight); C7517, it injected a
# wait before such a read.
_WGMMA_SERIALIZED = re.compile(r"\(C7514\)")
_WGMMA_INJECTED_WAIT = re.compile(r"\(C7517\)")


def wgmma_notes(log: str) -> dict[str, object]:
    """What ptxas's log says it did to the warpgroup MMAs: ``wgmma_serialized`` (a wait after
    every MMA: none overlaps anything else) and ``wgmma_injected_waits`` (waits it put in on its
    own); None where the log is empty (a cached kernel)."""
    if "Used " not in log:
        return {"wgmma_serialized": None, "wgmma_injected_waits": None}
    return {
        "wgmma_serialized": bool(_WGMMA_SERIALIZED.search(log)),
        "wgmma_injected_waits": len(_WGMMA_INJECTED_WAIT.findall(log)),
    }


_ALLOC = re.compile(r"ttg\.local_alloc\b[^\n]*?!ttg\.memdesc<((?:\d+x)+)\w+, [^>]*mutable")


def kv_buffers(ttgir: str, block_n: int, head_dim: int) -> int | None:
    """Most stages of a multi-buffered K or V tile allocation (``N x BLOCK_N x D`` either way)."""
    depth = []
    for match in _ALLOC.finditer(ttgir):
        dims = [int(x) for x in match.group(1).rstrip("x").split("x")]
        if len(dims) == 3 and sorted(dims[1:]) == sorted([block_n, head_dim]):
            depth.append(dims[0])
    return max(depth) if depth else None


_LOADS = ("async_tma_copy_global_to_local", "async_copy_global_to_local", "tt.load")
_MMAS = ("warp_group_dot", "tt.dot ", "tc_gen5_mma")


def partitions(ttgir: str) -> dict[str, object]:
    """Warp-specialized partitions from the final TTGIR: how many (the default one included),
    their warps (``4+4+4``, default first) and roles (``load``, ``mma``, ``mma+load``)."""
    module = re.search(r'"ttg\.num-warps" = (\d+)', ttgir)
    starts = [
        m
        for m in re.finditer(
            r"^\s*(default \{|partition\d+\(.*num_warps\((\d+)\))", ttgir, re.MULTILINE
        )
    ]
    if not starts or not starts[0].group(1).startswith("default"):
        return {"partitions": 1, "partition_warps": "", "partition_roles": ""}
    warps, roles = [], []
    for n, match in enumerate(starts):
        end = starts[n + 1].start() if n + 1 < len(starts) else len(ttgir)
        region = ttgir[match.start() : end]
        stop = re.search(r"ttg\.warp_(yield|return)", region)
        region = region[: stop.end()] if stop else region
        warps.append(match.group(2) or (module.group(1) if module else "?"))
        role = [
            name
            for name, ops in (("mma", _MMAS), ("load", _LOADS))
            if any(o in region for o in ops)
        ]
        roles.append("+".join(role) or "other")
    return {
        "partitions": len(starts),
        "partition_warps": "+".join(warps),
        "partition_roles": ",".join(roles),
    }


def _tool(name: str) -> str:
    from triton import knobs

    return getattr(knobs.nvidia, name).path


def analyse(kernel: object, log: str, tile: tuple[int, int] | None, workdir: Path) -> Row:
    """Every measure of one compiled kernel, read from the cubin Triton built."""
    cubin = workdir / "kernel.cubin"
    cubin.write_bytes(kernel.asm["cubin"])
    cuobjdump = _tool("cuobjdump")
    run = lambda *flags: (
        subprocess.run(
            [cuobjdump, *flags, str(cubin)], capture_output=True, text=True, check=True
        ).stdout
    )
    usage = run("-res-usage")
    registers = int(re.search(r"REG:(\d+)", usage).group(1))
    stack = int(re.search(r"STACK:(\d+)", usage).group(1))
    row: Row = sass.analyse(run("-sass"))
    check_ptxas_log(log, registers, (row["spill_stores"], row["spill_loads"]))
    ptx, ttgir = kernel.asm["ptx"], kernel.asm["ttgir"]
    row.update(
        registers=registers,
        stack_bytes=stack,
        shared_bytes=kernel.metadata.shared,
        kv_buffers=kv_buffers(ttgir, *tile) if tile else None,
        mbarriers=len(re.findall(r"\bmbarrier\.init", ptx)),
        **partitions(ttgir),
        **wgmma_notes(log),
    )
    row["consumer_warps"] = _consumer_warps(row, kernel.metadata.num_warps)
    return row


def _consumer_warps(row: Row, num_warps: int) -> int:
    """Warps running the MMAs: all of them, or the MMA partitions' of a warp-specialized one."""
    if row["partitions"] == 1:
        return num_warps
    pairs = zip(
        str(row["partition_warps"]).split("+"), str(row["partition_roles"]).split(","), strict=True
    )
    return sum(int(warps) for warps, role in pairs if "mma" in role)


def _labels(config: Config, launch: _Launch) -> Row:
    kwargs = launch.kwargs
    yardstick = launch.kernel in YARDSTICKS
    if "BLOCK_M" in kwargs and "BLOCK_N" in kwargs:
        tile = f"{kwargs['BLOCK_M']}x{kwargs['BLOCK_N']}"
    else:
        tile = " ".join(f"{k}={v}" for k, v in kwargs.items() if k.startswith("BLOCK_"))
    path = launch.labels.get("path") or str(kwargs.get("KV_PATH", "-"))
    attention = config.kernel == "paged_attention" and not yardstick
    return dict.fromkeys(MEASURE_COLUMNS) | {
        "kernel": launch.kernel,
        "path": path,
        "variant": variant_label(config.launch) if attention else "",
        "features": features_label(config) if attention else "",
        "kv_mode": config.kv_mode if attention else launch.labels.get("kv_mode", ""),
        "block_size": "" if yardstick else config.block_size,
        "tile": tile,
        "num_warps": kwargs.get("num_warps", 4),
        "num_stages": kwargs.get("num_stages", 3),
        "heads": config.heads,
        "kv_heads": config.heads if yardstick else config.kv_heads,
        "head_dim": config.head_dim,
        "dtype": config.dtype,
        "max_seqlen_q": config.max_seqlen_q,
    }


def _one_line(error: Exception) -> str:
    first = (str(error).strip().splitlines() or [""])[0]
    return f"{type(error).__name__}: {first}"[:300]


def _worker(target_text: str) -> None:
    """Compile the configurations read as JSON on stdin; print one JSON list of rows per config.

    A launch that does not compile gives a row with its one-line ``error``, not a failed run."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas

    backend, arch = parse_target(target_text)
    target = GPUTarget(backend, arch, 32)
    ptxas = get_ptxas(arch)
    stamp = {"triton": triton.__version__, "ptxas": f"{Path(ptxas.path).name} {ptxas.version}"}
    configs = []
    for raw in json.loads(sys.stdin.read()):
        raw["launch"] = tuple(tuple(pair) for pair in raw["launch"])
        configs.append(Config(**raw))
    done: dict[tuple, Row] = {}  # yardsticks compiled once per worker
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for config in configs:
            rows = []
            try:
                launches = _launches(config)
            except Exception as error:  # the launcher refused the configuration: one row says so
                row = _labels(config, _Launch(config.kernel, None, (), {}, {}))
                row.update(stamp, error=_one_line(error), tile="-")
                out.append([row])
                continue
            consumer_warps = None
            for launch in launches:
                if launch.kernel == "anchor" and consumer_warps:
                    # Each anchor warp then holds as many query rows as a consumer warp.
                    launch.kwargs["num_warps"] = consumer_warps
                row = _labels(config, launch)
                key = tuple(row.items())
                if launch.kernel in YARDSTICKS and key in done:
                    rows.append(dict(done[key]))
                    continue
                d = launch.kwargs.get("BLOCK_D", launch.kwargs.get("HEAD_DIM"))
                tile = (launch.kwargs["BLOCK_N"], d) if "BLOCK_N" in launch.kwargs else None
                try:
                    kernel, log = _compile(launch.fn, launch.args, launch.kwargs, target)
                    row.update(analyse(kernel, log, tile, Path(tmp)), error="")
                except Exception as error:  # recorded in the row, one line
                    row.update(error=_one_line(error))
                row.update(stamp)
                done[key] = row
                rows.append(row)
                if launch.kernel.startswith("paged_attention") and consumer_warps is None:
                    consumer_warps = row["consumer_warps"]
            out.append(rows)
    print(json.dumps(out))


# ---------------------------------------------------------------- command line


SHORT_COLUMNS = (
    ("triton", "triton"),
    ("kernel", "kernel"),
    ("path", "path"),
    ("variant", "variant"),
    ("kv", "kv_mode"),
    ("block", "block_size"),
    ("tile", "tile"),
    ("w/s", None),
    ("regs", "registers"),
    ("spill", None),
    ("smem", "shared_bytes"),
    ("kv_buf", "kv_buffers"),
    ("wait", "wait_depth"),
    ("mma", "mma"),
    ("tma", "tma_loads"),
    ("st/ld B", "global_access_bytes"),
    ("ws", None),
    ("loop", "loop_instructions"),
    ("masked", "masked_loop_instructions"),
    ("prod", "producer_loop_instructions"),
    ("int64", "loop_int64_ops"),
    ("ldg", "loop_global_loads"),
    ("div", "loop_divisions"),
    ("bar", "loop_barriers"),
    ("sts", "loop_shared_stores"),
    ("serial", "loop_serial_instructions"),
    ("ex2", "loop_exponentials"),
    ("i2f", "loop_int_to_float"),
    ("/anchor", "vs_anchor"),
    ("/tutorial", "vs_tutorial"),
)


def _cell(row: Row, title: str, column: str | None) -> str:
    if title == "w/s":
        value = f"{row['num_warps']}/{row['num_stages']}"
    elif title == "spill":
        value = f"{row.get('spill_stores')}/{row.get('spill_loads')}"
    elif title == "ws":
        value = row.get("partition_warps") or ""
    else:
        value = row.get(column)
    return "-" if value is None or value == "" or value == "None/None" else str(value)


def format_rows(rows: Sequence[Row]) -> str:
    """The report as an aligned plain-text table, provenance first, a row's errors after it."""
    if not rows:
        return "no configurations"
    first = rows[0]
    versions = ", ".join(dict.fromkeys(f"triton {r['triton']} ({r['ptxas']})" for r in rows))
    head = f"target {first['target']}, {versions}, commit {first['commit']}, {first['timestamp']}"
    table = [[title for title, _ in SHORT_COLUMNS]]
    errors = []
    for row in rows:
        table.append([_cell(row, title, column) for title, column in SHORT_COLUMNS])
        if row.get("error"):
            errors.append(
                f"  triton {row['triton']} {row['kernel']} block {row['block_size']} "
                f"{row['variant']} {row['kv_mode']}: {row['error']}"
            )
    widths = [max(len(line[i]) for line in table) for i in range(len(table[0]))]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in table
    ]
    if errors:
        lines += ["not compiled:", *errors]
    narrow = [
        f"  triton {r['triton']} {r['kernel']} block {r['block_size']}: {r['global_access_bytes']}"
        for r in rows
        if r["kernel"] in COPY_KERNELS and not r.get("error") and not full_width(r)
    ]
    if narrow:
        lines += ["copy kernels with global accesses under 16 bytes (stores/loads):", *narrow]
    return "\n".join([head, *lines])


# The copy kernels: at copy speed only with every store and the widest load 16 bytes.
COPY_KERNELS = ("write_slots", "gather_blocks")


def full_width(row: Row) -> bool:
    """Whether a row's plain global stores are all 16 bytes and its widest load is (the copy
    kernels' data; their index loads may be narrower)."""
    stores, _, loads = str(row.get("global_access_bytes") or "").partition("/")
    return stores == "16" and loads.split("+")[0] == "16"


def format_summary(rows: Sequence[Row]) -> str:
    """A markdown table of the attention launches with each Triton side by side: registers /
    spill bytes (stores), the hot loop, the masked loop, 64-bit integer ops, and the ratios."""
    versions = list(dict.fromkeys(str(r["triton"]) for r in rows))
    launches: dict[tuple, dict[str, Row]] = {}
    for row in rows:
        if row["kernel"].startswith("paged_attention"):
            key = (
                row["kernel"],
                row["variant"],
                row["features"],
                row["kv_mode"],
                row["block_size"],
            )
            launches.setdefault(key, {})[str(row["triton"])] = row
    yardsticks = [r for r in rows if r["kernel"] in YARDSTICKS]
    head = ["kv", "block", "variant"]
    for version in versions:
        head += [
            f"path / tile {version}",
            f"regs/spill {version}",
            f"loop (masked) {version}",
            f"bar/sts {version}",
            f"int64 {version}",
            f"/anchor {version}",
            f"/tutorial {version}",
        ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (_, variant, features, kv_mode, block), by_version in launches.items():
        label = variant if features == "plain" else f"{variant} {features}"
        cells = [kv_mode, str(block), label]
        for version in versions:
            row = by_version.get(version)
            if row is None or row.get("error"):
                cells += ["not compiled" if row else "-"] + ["-"] * 6
                continue
            cells += [
                f"{row['path']} {row['tile']}",
                f"{row['registers']}/{row['spill_stores']}",
                f"{row['loop_instructions']} ({row['masked_loop_instructions']})",
                f"{row['loop_barriers']}/{row['loop_shared_stores']}",
                str(row["loop_int64_ops"]),
                _cell(row, "", "vs_anchor"),
                _cell(row, "", "vs_tutorial"),
            ]
        lines.append("| " + " | ".join(cells) + " |")
    notes = [
        f"{r['kernel']}{' ' + r['kv_mode'] if r.get('kv_mode') else ''} (triton {r['triton']}, "
        f"{r['tile']}, {r['num_warps']}/{r['num_stages']}): "
        f"key loops {r['key_loops']}, int64 {r['loop_int64_ops']}"
        + (
            f", producer loop {r['producer_loop_instructions']}, partitions "
            f"{r['partition_warps']} ({r['partition_roles']}), setmaxnreg {r['setmaxnreg']}"
            if r.get("partitions", 1) and int(r.get("partitions") or 1) > 1
            else ""
        )
        for r in yardsticks
        if not r.get("error")
    ]
    return "\n".join(lines + [""] + notes)


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
        help="compile the kernels for a GPU target on the CPU and report, from the cubin Triton "
        "builds, registers, spills, pipelining, TMA, warp specialization and the key loops' SASS",
        description="Defaults are the shipped geometry. Lists are comma-separated.",
    )
    parser.add_argument("--target", default="cuda:90", help="backend:arch, e.g. cuda:90 (sm_90a)")
    parser.add_argument(
        "--kernels",
        type=choices(KERNEL_NAMES),
        default=KERNEL_NAMES,
        help=f"kernels to compile (default: all): {', '.join(KERNEL_NAMES)}",
    )
    parser.add_argument(
        "--block-sizes",
        type=ints,
        default=SHIPPED["block_sizes"],
        help="tokens per cache block (default: the shipped sizes)",
    )
    parser.add_argument(
        "--head-dims", type=ints, default=SHIPPED["head_dims"], help="channels per head"
    )
    parser.add_argument(
        "--dtypes",
        type=choices(("bf16", "fp16", "fp32")),
        default=("bf16",),
        help="attention dtypes to compile: bf16 (default), fp16, fp32",
    )
    parser.add_argument("--heads", type=int, default=SHIPPED["heads"], help="query heads")
    parser.add_argument("--gqa-group", type=int, default=1, help="query heads per KV head")
    parser.add_argument(
        "--max-seqlen-q",
        type=int,
        default=SHIPPED["max_seqlen_q"],
        help="queries per sequence the launch is compiled for",
    )
    parser.add_argument("--causal", action="store_true", help="paged_attention: causal")
    parser.add_argument("--key-limits", action="store_true", help="paged_attention: key_limits")
    parser.add_argument("--gaps", type=int, default=0, help="paged_attention: key gaps per row")
    parser.add_argument(
        "--kv-modes",
        type=choices(KV_MODES),
        default=("same",),
        help="paged_attention: K/V in the query dtype (same), int8 codes dequantized before "
        "16-bit MMAs (int8); a _keys suffix: the mode over keys-major pools, as "
        "PagingConfig(keys_major=True) lays them out (the scales); k8v8: "
        "int8 K and keys-major e4m3 V with frozen channel scales (k8v8_keys: K's scales "
        "keys-major, k8v8_blocks: V's scales per block too; k8v16: int8 K and V in the query "
        "dtype, k8v16_keys: K's scales keys-major)",
    )
    parser.add_argument(
        "--launch",
        action="append",
        metavar="NAME=VALUE[,...]",
        help="paged_attention: extra launcher keywords, one kernel variant per --launch "
        "(repeat it to compare variants; e.g. --launch block_n=32); default: the launcher's own",
    )
    parser.add_argument(
        "--python",
        action="append",
        default=[],
        metavar="PATH",
        help="compile with this Python interpreter's Triton; repeat for several Tritons side by "
        "side (default: this interpreter)",
    )
    parser.add_argument(
        "--triton-venv",
        action="append",
        default=[],
        type=Path,
        metavar="DIR",
        help="like --python, with the interpreter of a virtual environment (DIR/bin/python)",
    )
    parser.add_argument("--workers", type=int, default=2, help="compile processes at a time")
    parser.add_argument("--markdown", action="store_true", help="also print the markdown summary")
    parser.add_argument(
        "--out", type=Path, default=Path("out"), help="folder for compile.csv (created)"
    )
    return parser


def _out_error(out: Path) -> str | None:
    """Why ``out`` cannot become the report's folder, without creating anything."""
    if out.exists():
        if not out.is_dir():
            return "is a file; --out takes a folder (compile.csv goes inside)"
        return None if os.access(out, os.W_OK | os.X_OK) else "folder is not writable"
    parent = out.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        return f"cannot be created: {parent} is a file"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"cannot be created: {parent} is not writable"
    return None


def run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """Run the ``compile`` subcommand: every argument is checked before anything compiles."""
    try:
        parse_target(args.target)
    except ValueError as error:
        parser.error(f"--target: {error}")
    if args.heads < 1 or args.gqa_group < 1 or args.heads % args.gqa_group:
        parser.error(f"--gqa-group {args.gqa_group} must divide --heads {args.heads}")
    if (reason := _out_error(args.out)) is not None:
        parser.error(f"--out {args.out}: {reason}")
    launches = []
    for text in args.launch or [""]:
        try:
            options = parse_launch(text)
            check_launch_options(options)
        except ValueError as error:
            parser.error(f"--launch {text!r}: {error}")
        launches.append(options)
    pythons = []
    for python in args.python:
        try:
            pythons.append(resolve_python(python))
        except ValueError as error:
            parser.error(f"--python {error}")
    for venv in args.triton_venv:
        try:
            pythons.append(venv_python(venv))
        except ValueError as error:
            parser.error(f"--triton-venv {error}")
    pythons = list(dict.fromkeys(pythons)) or [sys.executable]
    for python in pythons:
        try:
            probe_python(python)
        except ValueError as error:
            parser.error(f"--python {error}")
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
        launches=launches,
    )
    try:
        rows = compile_rows(configs, args.target, workers=max(1, args.workers), pythons=pythons)
    except RuntimeError as error:
        parser.exit(1, f"{parser.prog}: {error}\n")
    print(format_rows(rows))
    if args.markdown:
        print()
        print(format_summary(rows))
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "compile.csv"
    write_csv(rows, path)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] != ["--worker"] or len(sys.argv) != 3:
        raise SystemExit(f"usage: python -m {_WORKER_MODULE} --worker TARGET  (internal)")
    _worker(sys.argv[2])

"""The sweep: every (geometry, block size, kernel, provider, tile) is checked, then timed.

A result that disagrees with the oracle is never timed. A wrong result of this project's kernel
(or the oracle), or an error it raises, gets a skipped row naming it, the other runs go on (a
GPU window is too short to lose its other figures), and the sweep then raises
``WrongResultError`` naming every such run, so a wrong or failing kernel never produces a figure
nor a passing run; a baseline is skipped with the error in its reason.
"Disagrees" is anchored on torch's own error: an attention result may be off the float64 oracle
by at most twice what torch's SDPA is off in the same dtype, plus a small floor
(``accuracy_limit``).

Rows are written as they are measured. The ceilings (a large matmul per dtype, a large copy)
are measured at the start and again at the end; the run's noise verdict (``noise_verdict``) is
then written into every row. Providers marked ``late`` (compiled FlexAttention) run after all
the others, and ``time_limit_s`` stops starting new runs, so a run cut short has the rest.
"""

from __future__ import annotations

import itertools
import math
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from torch import Tensor

from paged_video import reference
from paged_video.bench.extras import MissingExtraError, require
from paged_video.bench.providers import (
    PROVIDERS,
    SDPA_BACKENDS,
    SDPA_BEST,
    Output,
    Provider,
    Quant,
    Tile,
    eight_bit_pools,
    quantized_pools,
    torch_sdpa_output,
)
from paged_video.bench.results import (
    ATTENTION_KERNELS,
    GEOMETRY_COLUMNS,
    KERNELS,
    CsvWriter,
    Row,
    headline_ms,
    noise_verdict,
    provenance,
    write_rows,
)
from paged_video.bench.timing import (
    Ceiling,
    Timing,
    TimingSettings,
    copy_ceiling,
    figures_kind,
    matmul_ceiling,
    measure,
)
from paged_video.bench.workload import (
    DTYPES,
    ORACLE_CHUNK_BYTES,
    Geometry,
    Workload,
    dequantized_sequences,
    make_workload,
    oracle_attention,
    oracle_pools,
    oracle_stage,
)
from paged_video.reference.attention import gather_sequence
from paged_video.reference.eight_bit_attention import K8V8_FORMAT, Codes, attend_codes

# An attention result passes when its error (relative to the oracle's largest magnitude) is at
# most TORCH_ERROR_FACTOR times torch SDPA's error in the same dtype plus this floor: about one
# rounding step of the dtype at the output's largest value (fp32: room for the interpreter's
# different summation order). The copy kernels must be exact.
TORCH_ERROR_FACTOR = 2.0
ERROR_FLOOR = {"fp32": 1e-5, "fp16": 5e-4, "bf16": 4e-3}
# Quantized providers are checked against the dequantizing oracle (float64 on the codes they
# read), so the storage's rounding is not in the limit.
# The one-switch formats are checked against their own arithmetic: k8v16 against float64
# attention over its int8-rounded query rows and dequantized keys (nothing else rounds: the
# bf16 pool's limit); k8v8 against its float64 emulation (``reference.eight_bit_attention``:
# int8 query rows, exact int32 Q K^T, P = exp(s - rowmax) * 448 rounded to e4m3, V codes times
# their frozen channel scales). The kernel rounds P per key tile after a running row max, the
# emulation after the final one: where the row max rises in a later tile, single
# probabilities differ by up to 2**-4 of themselves (small preset: 3e-7 at blocks 8-128 but 24,
# 0.021 at 24; a GPU's 13-bit P V accumulator adds to it). The allowance is twice that bound,
# 2**-3.
K8V8_ALLOWANCE = 0.125


# The skip reason of a run of ours whose result disagreed with the oracle.
WRONG_RESULT = "WRONG RESULT"
RUN_FAILED = "FAILED"


class WrongResultError(AssertionError):
    """A provider's result disagrees with the oracle: it must not be timed. ``result``: the
    sweep's rows when it ran to its end (the wrong runs among its skipped ones)."""

    def __init__(self, message: str, result: SweepResult | None = None) -> None:
        super().__init__(message)
        self.result = result


@dataclass(frozen=True)
class SweepConfig:
    """What to run. ``providers`` names the providers to keep (None: all that apply)."""

    geometries: tuple[Geometry, ...]
    block_sizes: tuple[int, ...]
    kernels: tuple[str, ...] = KERNELS
    providers: tuple[str, ...] | None = None
    tiles: tuple[Tile | None, ...] = (None,)
    device: str = "cpu"
    seed: int = 0
    timing: TimingSettings = field(default_factory=TimingSettings)
    time_limit_s: float | None = None


@dataclass(frozen=True)
class Skip:
    kernel: str
    provider: str
    block_size: int
    reason: str


@dataclass
class SweepResult:
    """``rows``: the ceilings and the measured rows; ``skipped``: what did not run, and why (the
    CSV has a row for each too, with its ``skipped`` reason)."""

    rows: list[Row]
    skipped: list[Skip]
    csv_path: Path


def accuracy_limit(
    kernel: str, dtype: str, torch_error: float | None, quant: Quant | None = None
) -> float:
    """Largest error a ``kernel`` result in ``dtype`` may have: ``2 * torch_error + floor`` for
    attention (``torch_error``: torch SDPA's error on the same inputs; plus
    ``rounding_allowance``), 0 for the copies."""
    if kernel not in ATTENTION_KERNELS:
        return 0.0
    if torch_error is None or not math.isfinite(torch_error):
        raise ValueError(f"torch_error must be a finite error for {kernel}, got {torch_error}")
    return TORCH_ERROR_FACTOR * torch_error + ERROR_FLOOR[dtype] + rounding_allowance(quant)


def rounding_allowance(quant: Quant | None) -> float:
    """What a quantized mode's limit adds for roundings its oracle cannot repeat: k8v8's
    probabilities, rounded per key tile; 0 for the rest."""
    if quant is not None and quant.kv_format == "k8v8":
        return K8V8_ALLOWANCE
    return 0.0


def max_error(actual: Output, expected: Output) -> float:
    """Largest ``|actual - expected|`` over ``max |expected|``; inf for NaN or a shape mismatch."""
    actual_parts = actual if isinstance(actual, tuple) else (actual,)
    expected_parts = expected if isinstance(expected, tuple) else (expected,)
    if len(actual_parts) != len(expected_parts):
        return math.inf
    worst = 0.0
    for got, want in zip(actual_parts, expected_parts, strict=True):
        if got.shape != want.shape:
            return math.inf
        want64 = want.to(torch.float64)
        scale = max(float(want64.abs().max()), 1e-30)
        error = float((got.to(torch.float64) - want64).abs().max()) / scale
        if not math.isfinite(error):
            return math.inf
        worst = max(worst, error)
    return worst


def bytes_moved(kernel: str, workload: Workload, quant: Quant | None = None) -> int:
    """Bytes a kernel must read and write at least: attention reads q, K, V (codes and their
    float32 scales from a quantized pool) and writes out; staging reads and writes every
    visible block; a slot write reads and writes the chunk."""
    g = workload.geometry
    item = torch.empty((), dtype=g.torch_dtype).element_size()
    kv_token = g.kv_heads * g.head_dim * item
    attention = 2 * g.batch * g.q_tokens * g.heads * g.head_dim * item
    k_token = v_token = kv_token if quant is None else g.kv_heads * (g.head_dim + 4)
    if quant is not None and quant.kv_format == "k8v8":
        v_token = g.kv_heads * g.head_dim  # its channel scales: per layer, not per token
    elif quant is not None and quant.kv_format == "k8v16":
        v_token = kv_token
    attention += g.batch * g.kv_tokens * (k_token + v_token)
    staging = 2 * 2 * g.batch * workload.staged_tokens * kv_token
    chunk_write = 2 * 2 * g.batch * g.q_tokens * kv_token
    return {
        "paged_attention": attention,
        "staged": staging + attention,
        "gather_blocks": staging,
        "write_slots": chunk_write,
    }[kernel]


class _Oracles:
    """Expected results and torch's error; both serve every block size of one geometry."""

    def __init__(self) -> None:
        self._cache: dict[tuple[object, ...], Output] = {}
        self._torch_error: dict[Geometry, float] = {}

    def torch_error(self, kernel: str, workload: Workload) -> float | None:
        """Error of torch SDPA in the workload's dtype (None for the copy kernels)."""
        if kernel not in ATTENTION_KERNELS:
            return None
        geometry = workload.geometry
        if geometry not in self._torch_error:
            expected = self.expected(kernel, workload)
            self._torch_error = {geometry: max_error(torch_sdpa_output(workload), expected)}
        return self._torch_error[geometry]

    def expected(self, kernel: str, workload: Workload, quant: Quant | None = None) -> Output:
        """The oracle's result; for a ``quant`` provider the dequantizing oracle's (float64 on
        the codes it reads), which serves
        every block size as well: each token is quantized alone."""
        geometry, block_size = workload.geometry, workload.block_size
        attention = kernel in ATTENTION_KERNELS
        key = ("attention", geometry, quant) if attention else (kernel, geometry, block_size)
        if key not in self._cache:
            self._cache = {
                old: value
                for old, value in self._cache.items()
                if old[1] == geometry and (old[0] == "attention" or old[2] == block_size)
            }
            if attention and quant is not None:
                self._cache[key] = _dequantizing_oracle(workload, quant)
            elif attention:
                self._cache[key] = oracle_attention(workload)
            elif kernel == "gather_blocks":
                self._cache[key] = oracle_stage(workload)
            else:
                self._cache[key] = oracle_pools(workload)
        return self._cache[key]


def _dequantizing_oracle(workload: Workload, quant: Quant) -> Output:
    """Float64 attention over the dequantized pools; a one-switch format's: its own arithmetic
    (``eight_bit_oracle``)."""
    if quant.kv_format is not None:
        return eight_bit_oracle(workload, quant.kv_format)
    keys, values = dequantized_sequences(workload, quantized_pools(workload, quant.dtype))
    return oracle_attention(workload, keys=keys, values=values)


# The k8v8 format's arithmetic as the kernel does it (the row sums of the rounded probabilities,
# by MMA), P V's accumulator exact (the interpreter's float32; the GPU's FP8 MMA keeps ~22 bits,
# inside the allowance).
K8V8_EMULATION = replace(K8V8_FORMAT, acc_bits=None)


def eight_bit_oracle(workload: Workload, kv_format: str) -> Tensor:
    """Float64 ``(total_q, heads, head_dim)`` on the workload's device: k8v16 as float64
    attention over the int8-rounded query rows, the dequantized keys and V as stored; k8v8 as
    its emulation over the pool's own codes and frozen channel scales
    (``reference.eight_bit_attention.attend_codes``), per sequence, KV head and slice
    of queries so the float64 scores stay under ``ORACLE_CHUNK_BYTES``."""
    w = workload
    g = w.geometry
    pools = eight_bit_pools(w, kv_format)
    q_rows = reference.quantize.round_rows(w.q, torch.int8)
    sequences = range(g.batch)
    k_codes = [gather_sequence(pools.k_cache, w.block_table[s], g.kv_tokens) for s in sequences]
    k_scales = [gather_sequence(pools.k_scale, w.block_table[s], g.kv_tokens) for s in sequences]
    if kv_format == "k8v16":
        keys = torch.stack(
            [reference.quantize.dequantize(c, s) for c, s in zip(k_codes, k_scales, strict=True)]
        )
        return oracle_attention(w, q=q_rows, keys=keys, values=w.values)
    assert pools.v_channel_scale is not None
    channel_scale = pools.v_channel_scale[0]
    group = g.heads // g.kv_heads
    q_codes, q_scale = reference.quantize.quantize(w.q, torch.int8)
    # P V's partial sums, per k-step of 32 keys and channel, dominate: keep them in the budget.
    per_query = group * (g.kv_tokens + 31) // 32 * g.head_dim * 8 * 4
    rows = max(1, ORACLE_CHUNK_BYTES // per_query)
    # On the workload's device: the shipped geometry's emulation takes minutes on a CPU (3 s a
    # slice of 298 queries on one core, 640 slices), longer than a GPU check's stage, and its
    # result is compared with the kernel's there.
    out = torch.empty(w.q.shape, dtype=torch.float64, device=w.q.device)
    for seq in sequences:
        # The e4m3 codes gathered as bytes (no float8 indexing needed on the device).
        v_bytes = gather_sequence(pools.v_cache.view(torch.uint8), w.block_table[seq], g.kv_tokens)
        v_codes = v_bytes.view(pools.v_cache.dtype)
        ks, kc = k_scales[seq], k_codes[seq]
        for head in range(g.kv_heads):
            heads = slice(head * group, (head + 1) * group)
            keys = Codes(kc[:, head : head + 1], ks[:, head : head + 1])
            values = Codes(v_codes[:, head : head + 1], channel_scale[head : head + 1])
            for start in range(0, g.q_tokens, rows):
                lo = seq * g.q_tokens + start
                hi = seq * g.q_tokens + min(start + rows, g.q_tokens)
                queries = Codes(q_codes[lo:hi, heads], q_scale[lo:hi, heads])
                out[lo:hi, heads] = attend_codes(queries, keys, values, K8V8_EMULATION)
    return out


def selected_providers(config: SweepConfig, providers: Sequence[Provider]) -> list[Provider]:
    """The providers the config names (``sdpa-best`` names the forced SDPA backends; none
    named: all but those run ``on_request`` only), late ones last."""
    names = config.providers
    if names is not None and SDPA_BEST in names:
        names = (*names, *SDPA_BACKENDS)
    chosen = [
        p
        for p in providers
        if p.kernel in config.kernels
        and (p.name in names if names is not None else not p.on_request)
    ]
    return sorted(chosen, key=lambda p: p.late)


def _tiles_for(provider: Provider, config: SweepConfig) -> tuple[Tile | None, ...]:
    return config.tiles if provider.tunable else (None,)


@dataclass(frozen=True)
class Checked:
    """A provider that passed the check: its timing, what ran, its error and the limit."""

    timing: Timing
    backend: str
    error: float | None
    torch_error: float | None
    limit: float | None


def _check_then_time(
    provider: Provider,
    tile: Tile | None,
    workload: Workload,
    oracles: _Oracles,
    device: torch.device,
    settings: TimingSettings,
) -> Checked | str:
    """The provider checked, then timed; or why a baseline could not run or was wrong. Raises
    on a wrong result of ours. A ``bound`` is timed unchecked."""
    try:
        bench = provider.build(workload, tile)
        output = bench.to_reference_layout(bench.run())
    except Exception as error:
        if not provider.skippable:
            raise
        return f"failed: {type(error).__name__}: {_first_line(error)}"
    backend = bench.backend or provider.name
    if provider.role == "bound":
        return Checked(measure(bench.run, device, settings), backend, None, None, None)
    expected = oracles.expected(provider.kernel, workload, provider.quant)
    torch_error = oracles.torch_error(provider.kernel, workload)
    error = max_error(output, expected)
    limit = accuracy_limit(provider.kernel, workload.geometry.dtype, torch_error, provider.quant)
    limit += provider.allowance
    if not error <= limit:
        anchor = "" if torch_error is None else f" (torch SDPA's error {torch_error:.3g})"
        wrong = f"max error {error:.3g} > limit {limit:.3g}{anchor}; not timed"
        if provider.skippable:
            return f"wrong result: {wrong}"
        raise WrongResultError(
            f"{provider.kernel}/{provider.name} (block_size={workload.block_size}, tile={tile}, "
            f"{workload.geometry}) disagrees with the oracle: {wrong}"
        )
    return Checked(measure(bench.run, device, settings), backend, error, torch_error, limit)


def _first_line(error: Exception) -> str:
    """The first line of an error's message (300 characters at most)."""
    lines = str(error).strip().splitlines()
    return lines[0][:300] if lines else ""


def _failure(provider: Provider, workload: Workload, error: Exception) -> str:
    """One line naming a run of ours that raised, and what it raised."""
    return (
        f"{provider.kernel}/{provider.name} (block_size={workload.block_size}) raised "
        f"{type(error).__name__}: {_first_line(error)}"
    )


def _ceiling_row(ceiling: Ceiling, phase: str, shared: Row) -> Row:
    return {
        "kernel": "ceiling",
        "provider": ceiling.name,
        "phase": phase,
        "dtype": ceiling.dtype,
        "p50_ms": ceiling.timing.p50_ms,
        "p20_ms": ceiling.timing.p20_ms,
        "p80_ms": ceiling.timing.p80_ms,
        "min_ms": ceiling.timing.min_ms,
        "tflops": ceiling.tflops,
        "gbps": ceiling.gbps,
        **shared,
    }


def _measured_row(
    provider: Provider,
    tile: Tile | None,
    workload: Workload,
    checked: Checked,
    roofs: tuple[dict[str, float], float],
    shared: Row,
) -> Row:
    g = workload.geometry
    timing = checked.timing
    matmul_tflops, copy_gbps = roofs
    seconds = timing.headline(workload.k_cache.device) / 1e3
    tflops = g.attention_flops() / seconds / 1e12 if provider.kernel in ATTENTION_KERNELS else None
    gbps = bytes_moved(provider.kernel, workload, provider.quant) / seconds / 1e9
    return {
        "kernel": provider.kernel,
        "provider": provider.name,
        "backend": checked.backend,
        "role": provider.role,
        "block_size": workload.block_size,
        "tile": str(tile) if tile else ("auto" if provider.tunable else ""),
        "chunk_size": g.chunk_size,
        "frames": g.frames,
        "sink_chunks": g.sink_chunks,
        "window_chunks": g.window_chunks,
        "batch": g.batch,
        "heads": g.heads,
        "kv_heads": g.kv_heads,
        "head_dim": g.head_dim,
        "dtype": g.dtype,
        "q_tokens": g.q_tokens,
        "kv_tokens": g.kv_tokens,
        "p50_ms": timing.p50_ms,
        "p20_ms": timing.p20_ms,
        "p80_ms": timing.p80_ms,
        "min_ms": timing.min_ms,
        "tflops": tflops,
        "gbps": gbps,
        "tflops_vs_matmul": None if tflops is None else tflops / matmul_tflops[g.dtype],
        "gbps_vs_copy": gbps / copy_gbps,
        "max_error": checked.error,
        "torch_error": checked.torch_error,
        "error_limit": checked.limit,
        **shared,
    }


def _skipped_row(
    kernel: str, name: str, role: str, workload: Workload, reason: str, shared: Row
) -> Row:
    g = workload.geometry
    return {
        "kernel": kernel,
        "provider": name,
        "role": role,
        "block_size": workload.block_size,
        **{column: getattr(g, column) for column in GEOMETRY_COLUMNS},
        "q_tokens": g.q_tokens,
        "kv_tokens": g.kv_tokens,
        "skipped": reason,
        **shared,
    }


def _best_sdpa_row(rows: Sequence[Row]) -> Row | None:
    """``sdpa-best``: the fastest forced SDPA backend among ``rows`` (one case), naming it."""
    forced = [r for r in rows if r["provider"] in SDPA_BACKENDS]
    if not forced:
        return None
    fastest = min(forced, key=headline_ms)
    return {**fastest, "provider": SDPA_BEST, "backend": fastest["provider"], "role": "best-of"}


def _measure_ceilings(
    dtypes: Sequence[str], device: torch.device, settings: TimingSettings
) -> list[Ceiling]:
    ceilings = [matmul_ceiling(d, DTYPES[d], device, settings) for d in dtypes]
    return [*ceilings, copy_ceiling(device, settings)]


def _runs(
    config: SweepConfig, chosen: Sequence[Provider]
) -> Iterator[tuple[Geometry, int, list[tuple[Provider, Tile | None]]]]:
    """The cases in order, each with its (provider, tile) runs: the early providers over every
    case, then the late ones over every case."""
    for phase in (False, True):
        runs = [(p, tile) for p in chosen if p.late == phase for tile in _tiles_for(p, config)]
        if runs:
            for geometry, block_size in itertools.product(config.geometries, config.block_sizes):
                yield geometry, block_size, runs


class _NoBar:
    """What the sweep calls on a progress bar, doing nothing (``--no-progress``, or no tqdm)."""

    def __enter__(self) -> _NoBar:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def set_postfix_str(self, text: str) -> None:
        return None

    def update(self) -> None:
        return None


def _progress_bar(total: int, progress: bool) -> object:
    """tqdm's bar over ``total`` runs when asked for; without tqdm (the ``bench`` extra) the
    sweep runs without one and says so in one line."""
    if not progress:
        return _NoBar()
    try:
        tqdm = require("tqdm", "progress bars").tqdm
    except MissingExtraError as missing:
        print(f"note: no progress bar: {missing}", file=sys.stderr)
        return _NoBar()
    return tqdm(total=total, unit="run")


def run_sweep(
    config: SweepConfig,
    csv_path: str | Path,
    *,
    providers: Sequence[Provider] = PROVIDERS,
    progress: bool = True,
) -> SweepResult:
    """Run the sweep, writing the long-format CSV to ``csv_path`` as rows are measured; when
    it ends, the CSV is rewritten with the noise verdict in every row. Raises
    ``WrongResultError`` (carrying the result) at the end when a run of ours was wrong or
    raised."""
    started = time.monotonic()
    device = torch.device(config.device)
    shared = provenance(device, figures_kind(device))
    chosen = selected_providers(config, providers)
    csv_path = Path(csv_path)
    csv_path.parent.mkdir(parents=True, exist_ok=True)
    result = SweepResult(rows=[], skipped=[], csv_path=csv_path)
    dtypes = list(dict.fromkeys(g.dtype for g in config.geometries))
    written: list[Row] = []
    wrong: list[str] = []
    with open(csv_path, "w", newline="") as stream:
        writer = CsvWriter(stream)

        def record(row: Row) -> None:
            writer.write(row)
            written.append(row)
            result.rows.append(row)

        def record_skip(kernel: str, name: str, role: str, workload: Workload, why: str) -> None:
            row = _skipped_row(kernel, name, role, workload, why, shared)
            writer.write(row)
            written.append(row)
            result.skipped.append(Skip(kernel, name, workload.block_size, why))

        ceilings = _measure_ceilings(dtypes, device, config.timing)
        for ceiling in ceilings:
            record(_ceiling_row(ceiling, "start", shared))
        roofs = ({c.dtype: c.tflops for c in ceilings if c.tflops}, ceilings[-1].gbps or math.nan)

        oracles = _Oracles()
        cases = list(_runs(config, chosen))
        with _progress_bar(sum(len(runs) for *_, runs in cases), progress) as bar:
            for geometry, block_size, runs in cases:
                workload = make_workload(geometry, block_size, device=device, seed=config.seed)
                case_rows: list[Row] = []
                for provider, tile in runs:
                    bar.set_postfix_str(f"{provider.kernel}/{provider.name} B={block_size}")
                    reason = provider.unsupported(workload)
                    elapsed = time.monotonic() - started
                    if reason is None and config.time_limit_s and elapsed > config.time_limit_s:
                        reason = (
                            f"not run: the sweep's time limit ({config.time_limit_s:g} s) ran out"
                        )
                    if reason is None:
                        try:
                            outcome = _check_then_time(
                                provider, tile, workload, oracles, device, config.timing
                            )
                        except WrongResultError as error:
                            wrong.append(str(error))
                            outcome = f"{WRONG_RESULT}: {error}"
                        except Exception as error:  # ours failed to build or run
                            failed = _failure(provider, workload, error)
                            wrong.append(failed)
                            outcome = f"{RUN_FAILED}: {failed}"
                        if isinstance(outcome, str):
                            reason = outcome
                        else:
                            row = _measured_row(provider, tile, workload, outcome, roofs, shared)
                            record(row)
                            case_rows.append(row)
                    if reason is not None:
                        record_skip(provider.kernel, provider.name, provider.role, workload, reason)
                    bar.update()
                for kernel in dict.fromkeys(p.kernel for p, _ in runs if p.name in SDPA_BACKENDS):
                    best = _best_sdpa_row([r for r in case_rows if r["kernel"] == kernel])
                    if best is not None:
                        record(best)
                    else:
                        why = "no forced SDPA backend ran (see their reasons)"
                        record_skip(kernel, SDPA_BEST, "best-of", workload, why)
                del workload  # free this case's tensors before the next one is allocated

        for ceiling in _measure_ceilings(dtypes, device, config.timing):
            record(_ceiling_row(ceiling, "end", shared))
    verdict = noise_verdict(result.rows)
    for row in written:
        row["noise"] = verdict
    write_rows(csv_path, written)
    if wrong:
        raise WrongResultError("; ".join(wrong), result)
    return result

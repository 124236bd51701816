#!/usr/bin/env bash
# The GPU check: one command for a lent GPU (sized for an H200), inside 9 minutes (the first
# H200 run took 4), with the machine's own torch and Triton (nothing installed, nothing
# downloaded).
#
#   bench/gpu_check.sh [OUT_DIR]          OUT_DIR defaults to $OUT, else out/gpu_check
#
# 1. versions and the device;
# 2. the shipped-geometry sweep (40 heads, head_dim 128, bf16, q 4680, kv 28080): the shipped
#    block sizes first (16, 1560, then 24, 64, 256, 520, 32, 128), this project's kernels, the
#    forced SDPA backends (sdpa-best) and the other baselines over every block size before
#    compiled FlexAttention; our attention over e4m3 (dequant, fp8-mma) and int8 (dequant,
#    int8-mma) pools, the MMA modes also over keys-major pools, beside the bf16 pool at every
#    block size;
#    every provider checked against
#    the oracle (quantized ones against the dequantizing oracle) before it is timed.
#    --time-limit stops starting runs after SWEEP_BUDGET seconds, so the end-of-run ceilings
#    (the noise check) are still measured; CSV and log in OUT_DIR;
# 3. the launch candidates: this project's kernel at each variant and key tile the launch table
#    can choose (the launch providers: triton-cp_async, triton-tma, both at 128 keys, their
#    scores-ahead loops (-ahead: each tile's Q K^T issued a tile early, under the softmax
#    before it), and triton-ws and triton-ws-n128, the warp-specialized kernel) over
#    blocks 1560, 256, 16, 520, 64, 24 (a block of each table class first: a budget that cuts
#    the last blocks still leaves every class a winner; runs start until LAUNCH_BUDGET
#    seconds); at block 64 triton-tma-n128 and triton-tma-n128-ahead are the loop over tiles
#    of two whole blocks, a descriptor load per block, which a table row reads by pointer:
#    `choose` weighs them there at their triton-cp_async-n128 twins' times;
# 3b. the quantized loop candidates: `bench.launch_probe` times the MMA modes over keys-major
#    pools: FP8-MMA at blocks 1560 (a frame a block) and 256, INT8-MMA at 1560, each its
#    launcher's own choice (the 128-key TMA loop: codes and scales by descriptor), its 64-key
#    pointer loop and its 64-key TMA loop; and the dequantizing modes over keys-major scales at
#    1560, their default against their TMA loop at 128 and 64 keys (OUT_DIR/probe/probe.csv,
#    OUT_DIR/probe_dequant/probe.csv, OUT_DIR/probe_int8/probe.csv);
# 3c. `python -m paged_video.bench choose` prints the winner table against sdpa-best (and the
#    quantized pools' speedup at every block size the sweep reached) and the probes' winners,
#    and rewrites kernels/launch_choices.json (16-bit and quantized rows), copied to OUT_DIR:
#    recording the run is committing that file;
# 4. `python -m paged_video.bench accuracy` at the shipped geometry with all 40 heads, bf16 queries,
#    K smoothing on (the default), every data kind, format, mode (the INT8-MMA one too) with
#    and without channel equalization, each beside its float64 floor (OUT_DIR/accuracy.csv, log
#    in OUT_DIR/accuracy.log, table printed);
# 5. the compile report with this machine's Triton and ptxas at blocks 16 and 1560
#    (OUT_DIR/compile.csv; informative, not part of the exit status);
# 6. the kernel tests on CUDA (they run bf16 there too), log in OUT_DIR/tests.log;
# 7. the plots (speedup.png first), then the ratio table (with the quantized pools' speedup
#    over the bf16 pool and their goals), printed last.
# Each stage has a time limit (SWEEP_TIMEOUT, LAUNCH_TIMEOUT, PROBE_TIMEOUT, ACCURACY_TIMEOUT,
# COMPILE_TIMEOUT, TEST_TIMEOUT seconds); a sweep cut short still leaves the rows it measured in the CSV. BLOCK_SIZES and SWEEP_PROVIDERS
# (comma lists) narrow the sweep. PYTHON picks the interpreter (default python3).
# Exit status: 0 when the sweeps, the choice, the accuracy report and the tests passed, 1
# otherwise, 2 without a GPU.
set -uo pipefail
cd "$(dirname "$0")/.."

out_dir=${1:-${OUT:-out/gpu_check}}
python=${PYTHON:-python3}
block_sizes=${BLOCK_SIZES:-16,1560,24,64,256,520,32,128}
mkdir -p "$out_dir"
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

echo "== versions and device"
"$python" - <<'PY' || { echo "gpu_check: no CUDA device is visible to $python" >&2; exit 2; }
import importlib.util
import platform
import subprocess
import sys

import torch
import triton

commit = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True)
flash_attn = "importable" if importlib.util.find_spec("flash_attn") else "absent"
print(f"python {platform.python_version()}, torch {torch.__version__} (CUDA {torch.version.cuda}),"
      f" triton {triton.__version__}, flash_attn {flash_attn}, commit {commit.stdout.strip()}")
if not torch.cuda.is_available():
    sys.exit(1)
props = torch.cuda.get_device_properties(0)
print(f"device {props.name}, sm_{props.major}{props.minor}, {props.total_memory / 2**30:.0f} GiB,"
      f" {props.multi_processor_count} SMs")
PY
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader \
    2>/dev/null || true

sweep_timeout=${SWEEP_TIMEOUT:-150}
sweep_budget=${SWEEP_BUDGET:-100}
echo "== shipped-geometry sweep, block sizes $block_sizes (runs start until ${sweep_budget}s," \
    "limit ${sweep_timeout}s)"
start=$SECONDS
timeout "$sweep_timeout" "$python" -m paged_video.bench sweep --preset shipped \
    --block-sizes "$block_sizes" ${SWEEP_PROVIDERS:+--providers "$SWEEP_PROVIDERS"} \
    --time-limit "$sweep_budget" --out "$out_dir" --no-plot --no-progress \
    >"$out_dir/sweep.log" 2>&1
sweep_rc=$?
grep -E "^error" "$out_dir/sweep.log" | cut -c1-400 || true  # the skips come with the table
[ "$sweep_rc" -eq 0 ] || tail -n 15 "$out_dir/sweep.log"
echo "== sweep: exit $sweep_rc after $((SECONDS - start))s"

# The table's launches first, each beside its scores-ahead twin (the runs of a block size the
# budget cuts leave that block to the next run).
launch_timeout=${LAUNCH_TIMEOUT:-115}
launch_budget=${LAUNCH_BUDGET:-90}
echo "== launch candidates (runs start until ${launch_budget}s, limit ${launch_timeout}s)"
start=$SECONDS
timeout "$launch_timeout" "$python" -m paged_video.bench sweep --preset shipped \
    --block-sizes 1560,256,16,520,64,24 --kernels paged_attention \
    --providers triton-tma-n128,triton-tma-n128-ahead,triton-cp_async-n128,triton-cp_async-n128-ahead,triton-tma,triton-tma-ahead,triton-cp_async,triton-cp_async-ahead,triton-ws,triton-ws-n128 \
    --time-limit "$launch_budget" --out "$out_dir/launches" --no-plot --no-progress \
    >"$out_dir/launches.log" 2>&1
launch_rc=$?
[ "$launch_rc" -eq 0 ] || tail -n 15 "$out_dir/launches.log"
echo "== launch candidates: exit $launch_rc after $((SECONDS - start))s"

# The quantized loops a launch could take (bench/RESULTS.md, compile figures, Triton 3.6, per
# 64 keys): FP8-MMA over keys-major pools takes 128-key TMA tiles where a tile lies inside a
# block (357 at block 1560, 355 at 256), against its 64-key pointer loop (437 at 1560) and its
# 64-key TMA loop (477) (K's rows in the FP8 MMA's key order, 2026-12-05); so does INT8-MMA
# (404 at 1560), against its 64-key pointer loop (489) and TMA loop (516). The dequantizing
# modes over keys-major scales take 128-key TMA tiles too (e4m3 at block 1560: 369; int8 418),
# against their 64-key pointer loop (451; 500) and e4m3's 64-key TMA loop (475) (float16 V
# scaled by its rows, 2026-12-05). The launcher's own choice first: the time limit cuts the
# last runs.
probe_timeout=${PROBE_TIMEOUT:-100}
echo "== quantized loop candidates (limit ${probe_timeout}s)"
start=$SECONDS
fp8=triton-e4m3-mma-keys
int8=triton-int8-mma-keys
e4m3=triton-e4m3-keys
dequant_int8=triton-int8-keys
timeout $((probe_timeout * 36 / 100)) "$python" -m paged_video.bench.launch_probe \
    --block-sizes 1560,256 --runs "$fp8@default,$fp8@128x64w8s3+cp_async,$fp8@128x64w8s3+tma" \
    --time-limit $((probe_timeout * 26 / 100)) --out "$out_dir/probe" 2>&1 | tail -n 6
timeout $((probe_timeout * 36 / 100)) "$python" -m paged_video.bench.launch_probe \
    --block-sizes 1560 \
    --runs "$e4m3@default,$e4m3@128x64w8s4+cp_async,$dequant_int8@default,$dequant_int8@128x64w8s4+cp_async,$e4m3@128x64w8s4+tma" \
    --time-limit $((probe_timeout * 26 / 100)) --out "$out_dir/probe_dequant" 2>&1 | tail -n 5
timeout $((probe_timeout * 28 / 100)) "$python" -m paged_video.bench.launch_probe \
    --block-sizes 1560 --runs "$int8@default,$int8@128x64w8s3+cp_async,$int8@128x64w8s3+tma" \
    --time-limit $((probe_timeout * 20 / 100)) --out "$out_dir/probe_int8" 2>&1 | tail -n 3
echo "== quantized candidates: after $((SECONDS - start))s; the winners:"

# The launch table from both: 16-bit rows from the launch candidates, quantized rows from the
# probes (a class keeps its row where nothing was compared).
choose_rc=1
sweeps=() probes=()
if [ -s "$out_dir/launches/sweep.csv" ]; then
    sweeps=("$out_dir/launches/sweep.csv")
    [ -s "$out_dir/sweep.csv" ] && sweeps+=("$out_dir/sweep.csv")
fi
for probe_csv in "$out_dir"/probe/probe.csv "$out_dir"/probe_{dequant,int8}/probe.csv; do
    grep -q ",ok," "$probe_csv" 2>/dev/null && probes+=(--probe "$probe_csv")
done
if [ ${#sweeps[@]} -gt 0 ] || [ ${#probes[@]} -gt 0 ]; then
    "$python" -m paged_video.bench choose ${sweeps[@]+"${sweeps[@]}"} \
        ${probes[@]+"${probes[@]}"} --write kernels/launch_choices.json
    choose_rc=$?
    cp kernels/launch_choices.json "$out_dir/launch_choices.json"
fi

# About 17 kernel compiles (attention per mode, with and without equalization; the writes)
# take most of the time.
echo "== accuracy of FP8/INT8 pools (limit ${ACCURACY_TIMEOUT:-60}s)"
start=$SECONDS
timeout "${ACCURACY_TIMEOUT:-60}" "$python" -m paged_video.bench accuracy --smoothing on \
    --out "$out_dir" >"$out_dir/accuracy.log" 2>&1
accuracy_rc=$?
grep -vE "^[a-z0-9-]+ .*: cosine" "$out_dir/accuracy.log" | tail -n 50
echo "== accuracy: exit $accuracy_rc after $((SECONDS - start))s"

# The compile report with this machine's own Triton and ptxas: ties the timings above to the
# machine code the CPU-side report describes (the launch table's defaults, blocks 16 and 1560).
echo "== compile report (limit ${COMPILE_TIMEOUT:-25}s)"
start=$SECONDS
timeout "${COMPILE_TIMEOUT:-25}" "$python" -m paged_video.bench compile --kernels paged_attention \
    --block-sizes 16,1560 --out "$out_dir" >"$out_dir/compile.log" 2>&1
compile_rc=$?
tail -n 6 "$out_dir/compile.log"
echo "== compile report: exit $compile_rc after $((SECONDS - start))s"

workers=()
if "$python" -c "import xdist" 2>/dev/null; then
    workers=(-n "${TEST_WORKERS:-12}")
fi
# One line per test as it ends (-v): a run the limit cuts short still says which tests passed
# and which failed (the console shows the failures and the counts; tests.log has every line).
echo "== kernel tests (limit ${TEST_TIMEOUT:-120}s)"
start=$SECONDS
timeout "${TEST_TIMEOUT:-120}" "$python" -m pytest tests/kernels -v --tb=short -rfE \
    -p no:cacheprovider ${workers[@]+"${workers[@]}"} >"$out_dir/tests.log" 2>&1
tests_rc=$?
failures=$(grep -oE "(FAILED|ERROR) tests/[^ ]+" "$out_dir/tests.log" | sort -u)
[ -z "$failures" ] || head -n 30 <<<"$failures"
echo "passed $(grep -c " PASSED" "$out_dir/tests.log"), failed $(grep -c . <<<"$failures")"
tail -n 1 "$out_dir/tests.log"
echo "== kernel tests: exit $tests_rc after $((SECONDS - start))s"

if [ -s "$out_dir/sweep.csv" ]; then
    "$python" -m paged_video.bench plot "$out_dir/sweep.csv" --out "$out_dir"
    echo "== sweep exit $sweep_rc, launches exit $launch_rc (choose $choose_rc), accuracy exit" \
        "$accuracy_rc, tests exit $tests_rc; ratio table:"
    "$python" -m paged_video.bench table "$out_dir/sweep.csv" --goal
else
    echo "== sweep exit $sweep_rc, launches exit $launch_rc (choose $choose_rc), accuracy exit" \
        "$accuracy_rc, tests exit $tests_rc; the sweep wrote no CSV"
fi
[ "$sweep_rc" -eq 0 ] && [ "$launch_rc" -eq 0 ] && [ "$choose_rc" -eq 0 ] \
    && [ "$accuracy_rc" -eq 0 ] && [ "$tests_rc" -eq 0 ]

#!/usr/bin/env bash
# The GPU check: one command for a lent GPU (sized for an H200), in under 6 minutes.
#
#   bench/gpu_check.sh [OUT_DIR]          OUT_DIR defaults to $OUT, else out/gpu_check
#
# 1. the kernel tests on CUDA (they run bf16 there too), log in OUT_DIR/tests.log;
# 2. the shipped-geometry sweep (40 heads, head_dim 128, bf16, q 4680, kv 28080, block sizes
#    16..1560), every provider checked against the oracle before it is timed; CSV and log in
#    OUT_DIR, then the PNGs drawn from the CSV;
# 3. the short table (block sizes down, providers across), printed last.
# Each stage has a time limit (TEST_TIMEOUT, SWEEP_TIMEOUT seconds) so the whole stays inside
# 6 minutes; a sweep cut short still leaves the rows it measured in the CSV. BLOCK_SIZES and
# SWEEP_PROVIDERS (comma lists) narrow the sweep, e.g. SWEEP_PROVIDERS=triton,sdpa,sdpa+gather
# to leave out FlexAttention's compiles. PYTHON picks the interpreter (default python3).
# Exit status: 0 when the tests and the sweep both passed, 1 otherwise.
set -uo pipefail
cd "$(dirname "$0")/.."

out_dir=${1:-${OUT:-out/gpu_check}}
python=${PYTHON:-python3}
block_sizes=${BLOCK_SIZES:-16,24,32,64,128,256,520,1560}
mkdir -p "$out_dir"
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if ! "$python" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: no CUDA device is visible to $python" >&2
    exit 2
fi
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader \
    2>/dev/null || true

workers=()
if "$python" -c "import xdist" 2>/dev/null; then
    workers=(-n "${TEST_WORKERS:-8}")
fi
echo "== kernel tests (limit ${TEST_TIMEOUT:-200}s)"
start=$SECONDS
timeout "${TEST_TIMEOUT:-200}" "$python" -m pytest tests/kernels -x -q -p no:cacheprovider \
    "${workers[@]}" 2>&1 | tee "$out_dir/tests.log" | tail -n 25
tests_rc=${PIPESTATUS[0]}
echo "== kernel tests: exit $tests_rc after $((SECONDS - start))s"

echo "== shipped-geometry sweep, block sizes $block_sizes (limit ${SWEEP_TIMEOUT:-140}s)"
start=$SECONDS
timeout "${SWEEP_TIMEOUT:-140}" "$python" -m bench sweep --preset shipped \
    --block-sizes "$block_sizes" ${SWEEP_PROVIDERS:+--providers "$SWEEP_PROVIDERS"} \
    --out "$out_dir" --no-plot --no-progress \
    >"$out_dir/sweep.log" 2>&1
sweep_rc=$?
grep -E "^(skipped|error)" "$out_dir/sweep.log" || true
[ "$sweep_rc" -eq 0 ] || tail -n 15 "$out_dir/sweep.log"
echo "== sweep: exit $sweep_rc after $((SECONDS - start))s"

if [ -s "$out_dir/sweep.csv" ]; then
    "$python" -m bench plot "$out_dir/sweep.csv" --out "$out_dir"
    echo "== tests exit $tests_rc, sweep exit $sweep_rc; short table:"
    "$python" -m bench table "$out_dir/sweep.csv" --pivot
else
    echo "== tests exit $tests_rc, sweep exit $sweep_rc; the sweep wrote no CSV"
fi
[ "$tests_rc" -eq 0 ] && [ "$sweep_rc" -eq 0 ]

#!/usr/bin/env bash
# The GPU check: what a lent GPU window (15 minutes of device time, the machine's start
# included: two back-to-back calls of about 6 minutes, on the machine's own torch and Triton,
# peers' wheels carried) must not miss, in that order, each stage under its own time limit, its
# files written into OUT_DIR as it ends (and packed, with --pack) so that nothing the first
# call measured is lost if the second never comes or is cut short (docs/benchmarks.md).
#
#   bench/gpu_check.sh [--part 1|2|all] [--dry-run] [--pack DIR] [OUT_DIR]
#
# OUT_DIR defaults to out/gpu_check (inside the clone, which a warm device machine keeps
# between calls: part 2 reads what part 1 wrote there). --pack DIR copies OUT_DIR into
# DIR/gpu_check-partN.tgz after every stage (a device's $OUT: eight files at most come back).
# --dry-run (or GPU_CHECK_DEVICE=cpu) runs the same stages, commands and files on a CPU with
# tiny shapes under Triton's interpreter, so a stage that would crash on a GPU for a reason a
# CPU can show fails CI instead (tests/bench/test_gpu_check.py); it never writes the shipped
# launch table and judges no speed.
#
# Part 1 (the stages a window must not miss):
#   versions  torch, Triton, the device, the peers importable;
#   peers_setup  the peers' carried wheels installed into out/peer_site (bench/peer_wheels.sh);
#   tests     the kernel tests on CUDA (bench/gpu_tests.txt: every launch-table row, every kv
#             format, the copy kernels; no -x: each failure recorded, the run goes on);
#   sweep     the shipped geometry (40 heads, head_dim 128, bf16, q 4680, kv 28080), the
#             shipped block sizes first (16, 1560, then 24, 64, 256, 520, 32, 128): our kernels,
#             sdpa-best, the staged path beside gather + SDPA, the quantized pools, sageattention
#             where carried, compiled FlexAttention last; each checked against the oracle first;
#   launches  this project's kernel at every variant and key tile the launch table can choose
#             (blocks 1560, 256, 16, then 520, 64, 24: a block of each table class first);
#   choose    the 16-bit launch rows from the launches (kernels/launch_choices.json, copied to
#             OUT_DIR), and the launch providers no row picked.
# Part 2 (versions and peers_setup again, then):
#   pipes     which pipe the int32 -> float32 conversion (I2FP) takes beside exp2's MUFU.EX2
#             (bench.pipe_probe): instruction-mix micro-kernels, each checked against torch
#             before it is timed, and whether each pair's time is its parts' sum: pipe_probe.csv;
#   probes    the quantized loop candidates (bench.launch_probe): k8v8 and k8v16 first, the
#             table's launch against the 64-key loop with each P V under the next softmax, at
#             blocks 1560 then 16; then the int8 dequantizing mode over keys-major scales;
#   choose2   the launch table again from both (16-bit and quantized rows);
#   peers     our kernel, the table's launch and the staged path beside sdpa-best, FlexAttention,
#             sageattention 1.0.6 and FlashAttention-4 (bench/peer_wheels.sh: wheels carried,
#             FA4's largest split over the two calls and reassembled here) at blocks 16 and 1560;
#   rollout   bench.wan_rollout at the Wan 2.1 1.3B shape: time per block and frames per second
#             once the window is full, our paged cache (bf16, k8v8) against the stock
#             attention over a plain KV cache, beside the papers' anchors;
#   accuracy  the quantized formats (int8, k8v8, k8v16) against float64, each beside its float64
#             emulation, at the shipped geometry (8 of the 40 heads);
#   regrow    what the equalization factors' regrowth check costs a write of one frame, per
#             quantized format (bench.regrow_cost);
#   compile   the compile report with this machine's Triton and ptxas (blocks 16, 1560);
#   report    the plots and the ratio table.
# Each stage's limit (seconds) is printed at the start; *_TIMEOUT variables change them
# (SWEEP_BUDGET, LAUNCH_BUDGET: when the sweeps stop starting runs). BLOCK_SIZES and
# SWEEP_PROVIDERS (comma lists) narrow the sweep; PYTHON picks the interpreter. OUT_DIR/stages.tsv
# lists every stage run: part, name, exit status, seconds, the files it wrote.
# Exit status: 0 when every stage of the parts run passed (the compile report is informative),
# 1 otherwise, 2 without a GPU (outside a dry run) or on a wrong option.
set -uo pipefail
script=$(cd "$(dirname "$0")" && pwd)/$(basename "$0")
cd "$(dirname "$0")/.."

part=all pack="" out_dir="" only="" device=${GPU_CHECK_DEVICE:-cuda}
while [ $# -gt 0 ]; do
    case $1 in
        --part) part=${2:-}; shift 2 || { echo "gpu_check: --part needs 1, 2 or all" >&2; exit 2; } ;;
        --pack) pack=${2:-}; shift 2 || { echo "gpu_check: --pack needs a folder" >&2; exit 2; } ;;
        --dry-run) device=cpu; shift ;;
        --only) only=${2:-}; shift 2 || exit 2 ;;
        -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        -*) echo "gpu_check: unknown option $1" >&2; exit 2 ;;
        *) out_dir=$1; shift ;;
    esac
done
case $part in 1|2|all) ;; *) echo "gpu_check: --part must be 1, 2 or all, got '$part'" >&2; exit 2 ;; esac
case $device in cuda|cpu) ;; *) echo "gpu_check: GPU_CHECK_DEVICE must be cuda or cpu" >&2; exit 2 ;; esac
[ -z "$pack" ] || mkdir -p "$pack" || exit 2
out_dir=${out_dir:-out/gpu_check}
python=${PYTHON:-python3}
mkdir -p "$out_dir" || exit 2
manifest=$out_dir/stages.tsv
[ -s "$manifest" ] || printf 'part\tstage\texit\tseconds\tfiles\n' >"$manifest"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# The peers' wheels, installed by bench/peer_wheels.sh into the clone (kept between calls).
peer_site=out/peer_site
[ -d "$peer_site" ] && export PYTHONPATH="$PYTHONPATH:$PWD/$peer_site"

# Per device: the same commands, at the shipped geometry on a GPU and at a tiny one on a CPU.
if [ "$device" = cuda ]; then
    export TRITON_INTERPRET=0
    block_sizes=${BLOCK_SIZES:-16,1560,24,64,256,520,32,128}
    launch_blocks=1560,256,16,520,64,24
    geometry=(--preset shipped)
    probe_geometry=()
    dequant_blocks=1560 peer_blocks=16,1560
    # The 8-bit formats' 64-key loops against the table's 128-key ones: frame-sized blocks,
    # then block 16's gathered tiles (the rows path) if the stage's time is left.
    eight_bit_blocks=1560,16
    # 4 heads, not 40: the one-switch formats' float64 emulations (k8v8's models its 13-bit
    # accumulator a k-step at a time) join int8's rows within the stage's limit (an estimate).
    accuracy_geometry=(--heads 4)
    regrow_shape=()
    # 8 blocks: the window is full from the 7th (sink 9 + window 9 frames, 3 a block), so two
    # steady blocks a rollout; each rollout's first block compiles its kernels (the stage's
    # limit is mostly compiles: two paged rollouts and the plain one).
    rollout_shape=(--blocks 8)
    compile_shape=(--kernels paged_attention --block-sizes 16,1560)
    test_run=()
    # Each part's limits total 355 s: two calls of 365 s and the machine's start (about 2
    # minutes) fit the window's 15 minutes (tests/bench/test_gpu_check.py holds the sums).
    limits=(VERSIONS=15 TESTS=120 SWEEP=115 LAUNCH=70 CHOOSE=15
        PEERS_SETUP=20 PIPES=10 PROBE=70 CHOOSE2=15 PEERS=60 ROLLOUT=80 ACCURACY=45 REGROW=15 COMPILE=15
        REPORT=10)
    sweep_budget=${SWEEP_BUDGET:-75} launch_budget=${LAUNCH_BUDGET:-45}
else
    export TRITON_INTERPRET=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
    block_sizes=${BLOCK_SIZES:-16}
    launch_blocks=16
    tiny=(--device cpu --chunk-sizes 16 --heads 2 --gqa-groups 1 --cpu-reps 1)
    geometry=(--preset small "${tiny[@]}")
    probe_geometry=(--preset small --device cpu)
    dequant_blocks=16 peer_blocks=16 eight_bit_blocks=16
    accuracy_geometry=(--device cpu --heads 1 --head-dim 32 --chunk-size 16 --sink-chunks 1
        --window-chunks 1 --queries 8 --block-size 16 --data random --equalize off)
    regrow_shape=(--preset small --device cpu)
    rollout_shape=(--tiny --device cpu --blocks 2)
    compile_shape=(--kernels write_slots --block-sizes 16)
    # Every listed test is collected (a wrong id fails here, not in a window); the launch rows run.
    test_run=(--collect-only -q)
    limits=(VERSIONS=20 TESTS=120 SWEEP=150 LAUNCH=150 CHOOSE=30
        PEERS_SETUP=20 PIPES=60 PROBE=150 CHOOSE2=30 PEERS=100 ROLLOUT=120 ACCURACY=60 REGROW=60 COMPILE=90
        REPORT=60)
    sweep_budget=${SWEEP_BUDGET:-120} launch_budget=${LAUNCH_BUDGET:-120}
fi
for pair in "${limits[@]}"; do
    name=${pair%%=*} var=${pair%%=*}_TIMEOUT
    declare "limit_${name,,}=${!var:-${pair#*=}}"
done

part1=(versions peers_setup tests sweep launches choose)
part2=(versions peers_setup pipes probes choose2 peers rollout accuracy regrow compile report)
case $part in
    1) stages=("${part1[@]}") ;;
    2) stages=("${part2[@]}") ;;
    all) stages=("${part1[@]}" "${part2[@]:2}") ;;
esac

limit_of() {
    case $1 in
        peers_setup) echo "$limit_peers_setup" ;; launches) echo "$limit_launch" ;;
        probes) echo "$limit_probe" ;; *) local v="limit_$1"; echo "${!v}" ;;
    esac
}
total=0
[ -n "$only" ] || echo "== gpu_check part $part on $device, into $out_dir; stages and limits (s):"
for stage in "${stages[@]}"; do
    total=$((total + $(limit_of "$stage")))
    [ -n "$only" ] || printf '   %-12s %4s\n' "$stage" "$(limit_of "$stage")"
done
[ -n "$only" ] || echo "   total        $total"

failed=0
pack_out() {
    [ -n "$pack" ] || return 0
    tar czf "$pack/gpu_check-part$part.tgz" -C "$(dirname "$out_dir")" "$(basename "$out_dir")"
}
# run_stage NAME FILE...: runs the stage in a child of this script (`--only NAME`) under the
# stage's limit, records its exit status, its seconds and which of FILE (relative to OUT_DIR)
# it left non-empty in the manifest, then packs OUT_DIR.
run_stage() {
    local name=$1 start=$SECONDS rc limit written=() f
    shift
    limit=$(limit_of "$name")
    echo "== $name (limit ${limit}s)"
    GPU_CHECK_DEVICE=$device timeout -k 5 "$limit" bash "$script" --only "$name" --part "$part" \
        "$out_dir"
    rc=$?
    [ "$rc" -ne 124 ] || echo "== $name: stopped at its limit"
    for f in "$@"; do [ -s "$out_dir/$f" ] && written+=("$f"); done
    echo "== $name: exit $rc after $((SECONDS - start))s"
    printf '%s\t%s\t%s\t%s\t%s\n' "$part" "$name" "$rc" "$((SECONDS - start))" \
        "$(IFS=,; echo "${written[*]-}")" >>"$manifest"
    [ "$rc" -eq 0 ] || [ "$name" = compile ] || failed=1
    pack_out
    return "$rc"
}

stage_versions() {
    "$python" - "$device" <<'PY'
import importlib.util
import platform
import subprocess
import sys

import torch
import triton

device = sys.argv[1]
commit = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True)
peers = {n: importlib.util.find_spec(n) is not None for n in ("flash_attn", "sageattention")}
try:
    peers["flash_attn.cute"] = importlib.util.find_spec("flash_attn.cute") is not None
except ImportError:
    peers["flash_attn.cute"] = False
print(f"python {platform.python_version()}, torch {torch.__version__} (CUDA {torch.version.cuda}),"
      f" triton {triton.__version__}, commit {commit.stdout.strip() or 'unknown'}; importable: "
      + ", ".join(f"{n} {'yes' if ok else 'no'}" for n, ok in peers.items()))
if device == "cpu":
    print("dry run: the CPU and Triton's interpreter, tiny shapes (no figure is a speed)")
    sys.exit(0)
if not torch.cuda.is_available():
    sys.exit(2)
props = torch.cuda.get_device_properties(0)
print(f"device {props.name}, sm_{props.major}{props.minor}, {props.total_memory / 2**30:.0f} GiB,"
      f" {props.multi_processor_count} SMs")
PY
    local rc=$?
    [ "$device" = cpu ] || nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm \
        --format=csv,noheader 2>/dev/null || true
    return $rc
}

stage_tests() {
    local ids workers=()
    mapfile -t ids < <(grep -vE '^\s*(#|$)' bench/gpu_tests.txt)
    if [ "$device" = cuda ] && "$python" -c "import xdist" 2>/dev/null; then
        workers=(-n "${TEST_WORKERS:-12}")
    fi
    # One line per test as it ends (-v): a run the limit cuts short still says which passed.
    "$python" -m pytest "${ids[@]}" ${test_run[@]+"${test_run[@]}"} -v --tb=short -rfE \
        -p no:cacheprovider ${workers[@]+"${workers[@]}"} >"$out_dir/tests.log" 2>&1
    local rc=$?
    if [ "$device" = cpu ] && [ "$rc" -eq 0 ]; then
        "$python" -m pytest tests/kernels/test_launch_rows.py -q -p no:cacheprovider \
            >>"$out_dir/tests.log" 2>&1
        rc=$?
    fi
    local failures
    failures=$(grep -oE "(FAILED|ERROR) tests/[^ ]+" "$out_dir/tests.log" | sort -u)
    [ -z "$failures" ] || head -n 40 <<<"$failures"
    if [ "$device" = cpu ]; then
        echo "collected $(grep -oE "[0-9]+ tests? collected" "$out_dir/tests.log" | cut -d' ' -f1)" \
            "listed tests; the launch-table rows routed:"
    else
        echo "passed $(grep -c " PASSED" "$out_dir/tests.log"), failed $(grep -c . <<<"$failures")"
    fi
    tail -n 1 "$out_dir/tests.log"
    return $rc
}

stage_sweep() {
    "$python" -m paged_video.bench sweep "${geometry[@]}" --block-sizes "$block_sizes" \
        ${SWEEP_PROVIDERS:+--providers "$SWEEP_PROVIDERS"} --time-limit "$sweep_budget" \
        --out "$out_dir" --no-plot --no-progress >"$out_dir/sweep.log" 2>&1
    local rc=$?
    grep -E "^(error|skipped)" "$out_dir/sweep.log" | cut -c1-300 | head -n 30
    [ "$rc" -eq 0 ] || tail -n 15 "$out_dir/sweep.log"
    return $rc
}

# The table's 128-key launches first, each beside its scores-ahead twin.
launch_providers=triton-tma-n128,triton-tma-n128-ahead,triton-cp_async-n128,triton-cp_async-n128-ahead,triton-tma,triton-tma-ahead,triton-cp_async,triton-cp_async-ahead,triton-ws,triton-ws-n128
stage_launches() {
    "$python" -m paged_video.bench sweep "${geometry[@]}" --block-sizes "$launch_blocks" \
        --kernels paged_attention --providers "$launch_providers" \
        --time-limit "$launch_budget" --out "$out_dir/launches" --no-plot --no-progress \
        >"$out_dir/launches.log" 2>&1
    local rc=$?
    [ "$rc" -eq 0 ] || tail -n 15 "$out_dir/launches.log"
    return $rc
}

# choose from what is there: the launch sweep (and the main sweep for sdpa-best), the probes.
# On a GPU it rewrites kernels/launch_choices.json (recording the run is committing it); a dry
# run chooses from CPU figures (--rehearsal) into OUT_DIR's copy alone.
stage_choose() {
    local sources=() table=kernels/launch_choices.json rehearsal=()
    if [ -s "$out_dir/launches/sweep.csv" ]; then
        sources=("$out_dir/launches/sweep.csv")
        [ -s "$out_dir/sweep.csv" ] && sources+=("$out_dir/sweep.csv")
    fi
    for probe_csv in "$out_dir"/probe_dequant/probe.csv "$out_dir"/probe_eight_bit/probe.csv; do
        grep -q ",ok," "$probe_csv" 2>/dev/null && sources+=(--probe "$probe_csv")
    done
    if [ "$device" = cpu ]; then
        cp "$table" "$out_dir/launch_choices.json"
        table=$out_dir/launch_choices.json rehearsal=(--rehearsal)
    fi
    [ ${#sources[@]} -gt 0 ] || { echo "choose: neither the launches nor a probe wrote rows"; return 1; }
    "$python" -m paged_video.bench choose "${sources[@]}" ${rehearsal[@]+"${rehearsal[@]}"} \
        --write "$table"
    local rc=$?
    [ "$table" = "$out_dir/launch_choices.json" ] || cp "$table" "$out_dir/launch_choices.json"
    return $rc
}

stage_peers_setup() {
    bash bench/peer_wheels.sh install "$peer_site"
}

# Seconds, before the probes: whether I2FP shares MUFU.EX2's pipe decides whether k8v8's loop
# should convert its int32 scores with integer adds instead (docs/benchmarks.md).
stage_pipes() {
    "$python" -m paged_video.bench.pipe_probe --device "$device" --out "$out_dir"
}

# The 8-bit formats first (issue 45's speed goals are k8v8's): the table's launch (at 1560 the
# 128-key TMA loop) against the 64-key pointer loop, whose P V MMA runs under the next tile's
# softmax (_attend_pv_behind: fewer instructions with no MMA in flight, more in all;
# docs/quantization.md). Then the int8 dequantizing pool's loops: the launcher's own choice
# first (the time limit cuts the last runs), its 64-key pointer loop and its 64-key TMA loop.
dequant_int8=triton-int8-keys
# Each format's own launch beside its +bits twin first (the int32 scores taken to float by an
# integer add, no I2FP: whether that conversion shares the exponentials' pipe is pipe_probe's
# question, this the answer at the shipped geometry), then the 64-key loops.
eight_bit_runs=triton-k8v8@default,triton-k8v8@default+bits,triton-k8v16@default,triton-k8v16@default+bits,triton-k8v8@128x64w8s3+cp_async,triton-k8v16@128x64w8s3+cp_async
stage_probes() {
    local rc=0
    "$python" -m paged_video.bench.launch_probe ${probe_geometry[@]+"${probe_geometry[@]}"} \
        --block-sizes "$eight_bit_blocks" \
        --runs "$eight_bit_runs" \
        --time-limit "$((limit_probe * 60 / 100))" --out "$out_dir/probe_eight_bit" 2>&1 |
        tail -n 5 || rc=1
    "$python" -m paged_video.bench.launch_probe ${probe_geometry[@]+"${probe_geometry[@]}"} \
        --block-sizes "$dequant_blocks" \
        --runs "$dequant_int8@default,$dequant_int8@128x64w8s4+cp_async,$dequant_int8@128x64w8s4+tma" \
        --time-limit "$((limit_probe * 15 / 100))" --out "$out_dir/probe_dequant" 2>&1 |
        tail -n 5 || rc=1
    return $rc
}

# The peers a user would pick, in one run: each that cannot run here skips with one line.
peer_providers=triton,triton-tma-n128,sdpa-best,flex,sageattention,flash-attn-4,sdpa+gather,triton+sdpa
stage_peers() {
    "$python" -m paged_video.bench sweep "${geometry[@]}" --block-sizes "$peer_blocks" \
        --kernels paged_attention,staged --providers "$peer_providers" \
        --time-limit "$((limit_peers * 3 / 4))" --out "$out_dir/peers" --no-plot --no-progress \
        >"$out_dir/peers.log" 2>&1
    local rc=$?
    [ "$rc" -eq 0 ] || tail -n 15 "$out_dir/peers.log"
    # Ours over each peer (the ratio table names the fastest alone), the skips' reasons after.
    "$python" -m paged_video.bench.peers "$out_dir/peers/sweep.csv" | cut -c1-300 || rc=1
    return $rc
}

stage_rollout() {
    "$python" -m paged_video.bench.wan_rollout ${rollout_shape[@]+"${rollout_shape[@]}"} \
        --kv-format bf16 k8v8 --out "$out_dir"
}

stage_accuracy() {
    "$python" -m paged_video.bench accuracy --smoothing on --formats int8,k8v8,k8v16 \
        ${accuracy_geometry[@]+"${accuracy_geometry[@]}"} --out "$out_dir" \
        >"$out_dir/accuracy.log" 2>&1
    local rc=$?
    grep -vE "^[a-z0-9-]+ .*: cosine" "$out_dir/accuracy.log" | tail -n 50
    return $rc
}

stage_regrow() {
    "$python" -m paged_video.bench.regrow_cost ${regrow_shape[@]+"${regrow_shape[@]}"} \
        --out "$out_dir"
}

stage_compile() {
    "$python" -m paged_video.bench compile "${compile_shape[@]}" --out "$out_dir" \
        >"$out_dir/compile.log" 2>&1
    local rc=$?
    tail -n 6 "$out_dir/compile.log"
    return $rc
}

stage_report() {
    [ -s "$out_dir/sweep.csv" ] || { echo "report: the sweep wrote no CSV"; return 1; }
    "$python" -m paged_video.bench plot "$out_dir/sweep.csv" --out "$out_dir" || return 1
    "$python" -m paged_video.bench table "$out_dir/sweep.csv" --goal
}

if [ -n "$only" ]; then  # a child of run_stage: the stage alone
    "stage_${only%2}"
    exit $?
fi
for stage in "${stages[@]}"; do
    case $stage in
        versions)
            run_stage versions
            rc=$?
            if [ "$rc" -eq 2 ]; then
                echo "gpu_check: no CUDA device is visible to $python (--dry-run runs on a CPU)" >&2
                exit 2
            fi ;;
        tests) run_stage tests tests.log ;;
        sweep) run_stage sweep sweep.csv sweep.log ;;
        launches) run_stage launches launches/sweep.csv ;;
        choose|choose2) run_stage "$stage" launch_choices.json ;;
        peers_setup) run_stage peers_setup ;;
        pipes) run_stage pipes pipe_probe.csv ;;
        probes) run_stage probes probe_dequant/probe.csv probe_eight_bit/probe.csv ;;
        peers) run_stage peers peers/sweep.csv ;;
        rollout) run_stage rollout rollout.csv ;;
        accuracy) run_stage accuracy accuracy.csv ;;
        regrow) run_stage regrow regrow_cost.csv ;;
        compile) run_stage compile compile.csv ;;
        report) run_stage report speedup.png ;;
    esac
done
echo "== gpu_check part $part: $([ "$failed" -eq 0 ] && echo passed || echo "a stage failed");" \
    "stages in $manifest"
column -t -s $'\t' "$manifest" 2>/dev/null || cat "$manifest"
exit "$failed"

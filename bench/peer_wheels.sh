#!/usr/bin/env bash
# The peers' wheels for a GPU machine that reaches no package registry, carried with the clone.
#
#   bench/peer_wheels.sh download        here, where pip reaches a registry: the wheels of
#                                        sageattention 1.0.6 (plain Triton SageAttention1) and
#                                        FlashAttention-4 4.0.0b36 (flash-attn-4, quack-kernels,
#                                        nvidia-cutlass-dsl and its libraries, apache-tvm-ffi,
#                                        torch-c-dlpack-ext, einops), and diffusers 0.42.1 (the
#                                        Wan rollout's model), for Python 3.12 x86-64;
#   bench/peer_wheels.sh install SITE    there: pip-installs what was carried into SITE (no index,
#                                        no dependencies: torch and Triton are the machine's own);
#   bench/peer_wheels.sh split WHEEL     cut one wheel into the halves (download does it);
#   bench/peer_wheels.sh reassemble DIR  the wheels both of whose halves are here, checked, to DIR.
# The folders are in the clone's root, or in PEER_WHEELS_ROOT.
#
# One call carries 64 MiB with the clone, and nvidia-cutlass-dsl-libs-cu13 alone is ~92 MB. So a
# wheel over SPLIT_MB (30) is cut in two: its first half goes to .whl_a (carried by the first
# call), its second to .whl_b (the second call), each beside the whole wheel's sha256; the small
# wheels go to .whl (both calls). A warm machine keeps the first call's .whl_a, so the second
# call finds both halves, checks the sum and installs FA4; a fresh one (the first call's machine
# gone back) lacks a half, installs the rest and FA4's provider skips with one line.
# sageattention is in .whl: the first call's sweep already has it. The folders are git-ignored.
set -uo pipefail
cd "${PEER_WHEELS_ROOT:-$(dirname "$0")/..}" || exit 2

split_mb=${SPLIT_MB:-30}
sage=(sageattention==1.0.6)
# Not a peer: the Wan rollout's model (the device image has huggingface_hub, not diffusers).
rollout=(diffusers==0.42.1)
fa4=(flash-attn-4==4.0.0b36 quack-kernels==0.6.5 nvidia-cutlass-dsl==4.7.0
    nvidia-cutlass-dsl-libs-base==4.7.0 nvidia-cutlass-dsl-libs-cu13==4.7.0
    apache-tvm-ffi==0.1.15.post2 torch-c-dlpack-ext==0.1.5 einops==0.8.2)
platform=(--only-binary=:all: --python-version 3.12 --implementation cp
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)

# split_wheel WHEEL: halves into .whl_a/.whl_b with the whole wheel's sum beside each.
split_wheel() {
    local wheel=$1 name size half
    name=$(basename "$wheel")
    size=$(stat -c %s "$wheel")
    half=$(((size + 1) / 2))
    mkdir -p .whl_a .whl_b
    head -c "$half" "$wheel" >".whl_a/$name.part1"
    tail -c +"$((half + 1))" "$wheel" >".whl_b/$name.part2"
    (cd "$(dirname "$wheel")" && sha256sum "$name") | tee ".whl_a/$name.sha256" >".whl_b/$name.sha256"
    rm "$wheel"
    echo "split $name ($((size >> 20)) MiB) into .whl_a and .whl_b"
}

# reassemble DIR: every wheel both of whose halves are here, checked against its sum, into DIR.
reassemble() {
    local dir=$1 part1 name
    for part1 in .whl_a/*.part1; do
        [ -e "$part1" ] || continue
        name=$(basename "$part1" .part1)
        if [ ! -s ".whl_b/$name.part2" ]; then
            echo "peer_wheels: $name: the second call's half (.whl_b) is not here; not installed"
            continue
        fi
        cat "$part1" ".whl_b/$name.part2" >"$dir/$name"
        if ! (cd "$dir" && sha256sum --quiet -c "$OLDPWD/.whl_a/$name.sha256"); then
            echo "peer_wheels: $name: the halves do not give the wheel that was split" >&2
            rm -f "$dir/$name"
            return 1
        fi
        echo "reassembled $name"
    done
    return 0
}

case ${1:-} in
    download)
        staging=$(mktemp -d)
        python3 -m pip download --no-deps "${platform[@]}" -d "$staging" \
            "${sage[@]}" "${rollout[@]}" "${fa4[@]}" || exit 1
        mkdir -p .whl
        for wheel in "$staging"/*.whl; do
            if [ "$(stat -c %s "$wheel")" -gt $((split_mb << 20)) ]; then
                split_wheel "$wheel"
            else
                mv "$wheel" .whl/
            fi
        done
        rmdir "$staging"
        du -sh .whl .whl_a .whl_b 2>/dev/null
        echo "call 1 carries .whl and .whl_a, call 2 .whl and .whl_b (docs/benchmarks.md)"
        ;;
    install)
        site=${2:?usage: bench/peer_wheels.sh install SITE}
        wheels=$(mktemp -d)
        [ -d .whl ] && cp .whl/*.whl "$wheels"/ 2>/dev/null
        reassemble "$wheels" || exit 1
        if ! ls "$wheels"/*.whl >/dev/null 2>&1; then
            echo "peer_wheels: no wheel carried (.whl): the peers skip"
            exit 0
        fi
        "${PYTHON:-python3}" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$site" "$wheels"/*.whl
        rc=$?
        ls "$wheels"
        rm -rf "$wheels"
        exit $rc
        ;;
    split) split_wheel "${2:?usage: bench/peer_wheels.sh split WHEEL}" ;;
    reassemble) reassemble "${2:?usage: bench/peer_wheels.sh reassemble DIR}" ;;
    *)
        sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'
        exit 2
        ;;
esac

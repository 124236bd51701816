#!/usr/bin/env bash
# vllm-omni's own AR-Diffusion tests, as shipped and on this project's kernels, side by side.
#
#   bench/vllm_omni_check.sh VLLM_OMNI_CHECKOUT
#
# VLLM_OMNI_CHECKOUT is a checkout of vllm-omni at its v0.30.0 release (the tests live in its
# repository, not in its wheel; nothing of it is copied here). The script
# 1. builds a separate venv once (VLLM_OMNI_VENV, default ~/.cache/paged_video/vllm-omni-0.30.0,
#    reused while its recipe is unchanged; about 3.3 GB): torch 2.13.0 first, vllm 0.30.0 and
#    vllm-omni 0.30.0 without their dependencies (`pip install vllm-omni` alone would replace
#    torch with a CUDA build and not bring vllm), torchvision 0.28.0 without dependencies, then
#    the pure-Python packages their imports need, Hugging Face's `kernels` among them. It
#    deletes only a venv it made (its stamp file inside): any other existing, non-empty
#    VLLM_OMNI_VENV is refused (exit 2), never deleted;
# 2. installs this clone into it, as a vllm-omni user would, built from a copy in a temporary
#    folder (setuptools writes build/ and an egg-info beside the sources: not into the clone);
# 3. runs the AR-Diffusion tests (VLLM_OMNI_TESTS, default tests/diffusion/ar_diffusion; on a CPU
#    only the `cpu`-marked ones) three times: as shipped; with the backend installed
#    (`-p paged_video.integrations.vllm_omni.pytest_plugin`; on a CPU under Triton's
#    interpreter); and with the backend's outputs perturbed by 1e-3, which must fail;
# 4. prints the three counts.
# On a CPU torch, PyPI's torchvision (a CUDA build) cannot load its C ops, so the two op schemas
# its import registers fakes for are defined first (a tiny -p plugin). The checkout's conftest
# files are not loaded (--noconftest; VLLM_OMNI_CONFTEST=1 loads them, which needs their own
# test dependencies); no bytecode is written into the checkout. PYTHON picks the interpreter the
# venv is made from (default python3). Nothing is written outside the venv and temporary folders.
# Exit status: 0 when the shipped and the backend runs pass with the same number of tests
# passed and the perturbed run fails; 1 otherwise; 2 on bad usage or a failed venv build.
set -uo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
src=${1:-}
if [ -z "$src" ] || [ ! -d "$src/tests" ]; then
    echo "usage: $0 VLLM_OMNI_CHECKOUT (a vllm-omni v0.30.0 checkout with its tests/)" >&2
    exit 2
fi
src=$(cd "$src" && pwd)
venv=${VLLM_OMNI_VENV:-$HOME/.cache/paged_video/vllm-omni-0.30.0}
python=${PYTHON:-python3}
tests=${VLLM_OMNI_TESTS:-tests/diffusion/ar_diffusion}

# What vllm 0.30.0 and vllm-omni 0.30.0 import on the AR-Diffusion path, found by importing it.
pure_python=(
    "transformers>=5.13,<5.15" "diffusers==0.40.0" "kernels==0.16.1" "aenum==3.1.16"
    msgspec pyzmq cloudpickle xgrammar "apache-tvm-ffi==0.1.11" cbor2 psutil aiohttp openai
    openai-harmony pybase64 cachetools uvloop py-cpuinfo prometheus-client fastapi
    partial-json-parser llguidance tiktoken loguru einops omegaconf prettytable "cache-dit==1.5.0" av
    pytest "triton>=3.0" numpy
)
recipe="torch==2.13.0 vllm==0.30.0 vllm-omni==0.30.0 torchvision==0.28.0 ${pure_python[*]}"
stamp="$venv/.paged_video_recipe_$(printf '%s' "$recipe" | sha256sum | cut -c1-16)"
# Written into a venv the moment this script makes it: with a recipe stamp (which older versions
# of this script wrote alone), the only licence to delete it later.
made_here="$venv/.paged_video_vllm_omni_check"
pip=("$venv/bin/python" -m pip --disable-pip-version-check)

start=$SECONDS
# Everything but the venv is written here, and the tests run from here (neither this clone's
# root nor the checkout's on sys.path).
work=$(mktemp -d) || exit 2
trap 'rm -rf "$work"' EXIT
if [ ! -f "$stamp" ]; then
    if [ -f "$made_here" ] || compgen -G "$venv/.paged_video_recipe_*" >/dev/null; then
        rm -rf "$venv"  # ours (its stamps): an older recipe, or a build that failed
    elif [ -e "$venv" ] || [ -L "$venv" ]; then
        if [ ! -d "$venv" ] || [ -n "$(ls -A "$venv")" ]; then
            echo "vllm_omni_check: VLLM_OMNI_VENV=$venv exists and was not made by this script" \
                "(no $(basename "$made_here") in it); refusing to replace it. Point" \
                "VLLM_OMNI_VENV at a new path, or remove that folder yourself." >&2
            exit 2
        fi
    fi
    echo "== building $venv (once; ~16 min, ~3.3 GB)"
    mkdir -p "$venv" && : >"$made_here" && "$python" -m venv "$venv" || exit 2
    wheels="$work/wheels"
    {
        "${pip[@]}" install -q torch==2.13.0 &&
        "${pip[@]}" download -q --no-deps vllm==0.30.0 -d "$wheels" &&
        "${pip[@]}" install -q --no-deps "$wheels"/vllm-0.30.0-*.whl vllm-omni==0.30.0 \
            torchvision==0.28.0 &&
        "${pip[@]}" install -q "${pure_python[@]}"
    } 2>&1 | grep -vE "^WARNING: Location|dependency (resolver|conflicts)|requires .*, which is not installed|which is incompatible"
    build_rc=${PIPESTATUS[0]}
    [ "$build_rc" -eq 0 ] || { echo "venv build failed (exit $build_rc)" >&2; exit 2; }
    touch "$stamp"
    echo "== venv built in $((SECONDS - start))s"
else
    echo "== reusing $venv"
fi

# The build writes beside its sources (build/, an egg-info): build a copy, inside $work.
mkdir "$work/source" &&
    tar -C "$repo" --exclude=./.git --exclude=./build --exclude='*.egg-info' \
        --exclude=__pycache__ --exclude=./out -cf - . | tar -C "$work/source" -xf - || exit 2
"${pip[@]}" install -q --no-deps --no-build-isolation --force-reinstall "$work/source" 2>&1 |
    grep -v "^WARNING: Location"
cat >"$work/pytest.ini" <<'INI'
[pytest]
markers =
    cpu: runs on a CPU
    core_model: vllm-omni core model test
    diffusion: vllm-omni diffusion test
INI
cat >"$work/torchvision_cpu_schemas.py" <<'PY'
"""Define the torchvision op schemas its import registers fakes for, when its C ops cannot load
(PyPI's torchvision is a CUDA build; a CPU torch cannot load its extension)."""
import torch

if torch.version.cuda is None:
    for name in ("nms", "qnms"):
        torch.library.define(
            f"torchvision::{name}", "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor"
        )
PY

on_gpu=$("$venv/bin/python" -c "import torch; print(int(torch.cuda.is_available()))")
selection=()
[ "$on_gpu" = 1 ] || selection=(-m cpu)
conftest=(--noconftest)
[ "${VLLM_OMNI_CONFTEST:-0}" = 1 ] && conftest=()
paths=()
for path in $tests; do paths+=("$src/$path"); done

run() {  # run LABEL [extra pytest args...]: prints the label and pytest's count line
    local label=$1; shift
    local log="$work/$label.log"
    (cd "$work" && PYTHONPATH="$work" PYTHONDONTWRITEBYTECODE=1 \
        "$venv/bin/python" -m pytest -c "$work/pytest.ini" \
        --rootdir "$src" -p no:cacheprovider -p torchvision_cpu_schemas ${conftest[@]+"${conftest[@]}"} \
        ${selection[@]+"${selection[@]}"} "$@" "${paths[@]}") >"$log" 2>&1
    local rc=$?
    grep -E "^paged_video backend" "$log"
    local counts
    counts=$(grep -E "^=*.* in [0-9.]+s" "$log" | tail -n 1 | tr -d '=' | sed 's/^ *//')
    echo "$label: ${counts:-no count (exit $rc)}"
    [ "$rc" -le 1 ] || tail -n 20 "$log"
    printf -v "${label}_rc" '%s' "$rc"
    printf -v "${label}_passed" '%s' "$(grep -oE '[0-9]+ passed' <<<"$counts" | cut -d' ' -f1)"
}

echo "== vllm-omni's AR-Diffusion tests from $src ($tests; ${selection[*]:-all markers})"
run shipped
# On a CPU the kernels run under Triton's interpreter (switched on before triton is imported).
[ "$on_gpu" = 1 ] || export TRITON_INTERPRET=1
run backend -p paged_video.integrations.vllm_omni.pytest_plugin
run perturbed -p paged_video.integrations.vllm_omni.pytest_plugin --paged-video-perturb=1e-3
echo "== done in $((SECONDS - start))s"

if [ "$shipped_rc" -eq 0 ] && [ "$backend_rc" -eq 0 ] && [ "$perturbed_rc" -eq 1 ] &&
    [ -n "$shipped_passed" ] && [ "$shipped_passed" = "$backend_passed" ]; then
    echo "vllm_omni_check: OK (same tests pass on the backend; a perturbed backend fails them)"
    exit 0
fi
echo "vllm_omni_check: FAILED (shipped exit $shipped_rc, backend exit $backend_rc," \
    "perturbed exit $perturbed_rc)"
exit 1

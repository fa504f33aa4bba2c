#!/usr/bin/env bash
# Builds a binary wheel of jax_kimi_mla with its CUDA module, for the default architectures
# (CMakeLists.txt), with the nvcc on PATH: CUDA 13 here, CUDA 12 where that toolkit is installed
# (put its bin/ first on PATH). The wheel is repaired with auditwheel when auditwheel is
# installed, and copied as built otherwise.
#
#   bash scripts/build_wheel.sh [OUT_DIR]        # default: dist/
#   JKM_WHEEL_NO_ISOLATION=1 bash scripts/build_wheel.sh   # offline: build with the installed
#                                                          # scikit-build-core, nanobind and jax
#
# Not part of .ci/run's test command; .ci/run calls it to prove that the wheel installs and runs
# without nvcc and without the source tree.
set -euo pipefail

repo="$(cd "$(dirname "$0")/.." && pwd)"
out="${1:-$repo/dist}"
python="${PYTHON:-python3}"
command -v nvcc >/dev/null 2>&1 || { echo "build_wheel: nvcc is not on PATH; the wheel would have no CUDA module" >&2; exit 1; }
echo "build_wheel: $(nvcc --version | tail -n 1); compiling the CUDA module takes a few minutes"

raw="$(mktemp -d)"
trap 'rm -rf "$raw"' EXIT
isolation=()
[ "${JKM_WHEEL_NO_ISOLATION:-0}" = 1 ] && isolation=(--no-build-isolation)
JAX_KIMI_MLA_CUDA=ON "$python" -m pip wheel --quiet --no-deps "${isolation[@]}" --wheel-dir "$raw" "$repo"
mkdir -p "$out"
if command -v auditwheel >/dev/null 2>&1; then
  auditwheel repair --wheel-dir "$out" "$raw"/jax_kimi_mla-*.whl
else
  echo "build_wheel: auditwheel is not installed; the wheel is not repaired (its platform tag is the build machine's)"
  cp "$raw"/jax_kimi_mla-*.whl "$out"/
fi
ls "$out"/jax_kimi_mla-*.whl

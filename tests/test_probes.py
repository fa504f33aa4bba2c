"""The probes of benchmarks/probes compile wherever nvcc is (CI has it), and on an sm_90 GPU they
pass: the hardware facts a kernel plan relies on still hold, the kernels they measure (the
gather's production kernel and its candidate) match the CPU handler's operations bit for bit, and
the decode attention's two kernels agree."""

import shutil
import subprocess
from pathlib import Path

import jax
import jax.ffi
import pytest

ROOT = Path(__file__).resolve().parents[1]
PROBES = ROOT / "benchmarks" / "probes"
NVCC = shutil.which("nvcc")
# The gather probe includes a kernel source: the production one, or a candidate beside the probe.
VARIANTS = {
    "gather_cache.cu[bulk]": ("gather_cache.cu", ['-DJKM_GATHER_SOURCE="gather_bulk.cuh"']),
    "gather_cache.cu[bulk-16-warps]": ("gather_cache.cu", ['-DJKM_GATHER_SOURCE="gather_bulk.cuh"', "-DJKM_GATHER_BULK_WARPS=16"]),
    "gather_cache.cu[bulk-2-ctas]": ("gather_cache.cu", ['-DJKM_GATHER_SOURCE="gather_bulk.cuh"', "-DJKM_GATHER_BULK_CTAS=2"]),
    # As CMake builds the extension for sm_90a (the rs and wide kernels are then the defaults).
    "decode_attention.cu": ("decode_attention.cu", ["-DJKM_SM90A_BUILT"]),
    "decode_attention.cu[phases]": ("decode_attention.cu", ["-DJKM_SM90A_BUILT", "-DJKM_PHASE_STAMPS"]),
    "ds_rs_tile_loop.cu[fp8]": ("ds_rs_tile_loop.cu", ["-DJKM_RS_FP8"]),
    # S^T from shared memory under an E4M3 query; the rope chunk 64- or 128-byte swizzled.
    "ds_rs_tile_loop.cu[fp8-ss]": ("ds_rs_tile_loop.cu", ["-DJKM_RS_FP8_SS"]),
    "ds_rs_tile_loop.cu[fp8-ss-pe128]": ("ds_rs_tile_loop.cu", ["-DJKM_RS_FP8_SS", "-DJKM_RS_PE_SW128"]),
}
BUILDS = {p.name: (p.name, []) for p in PROBES.glob("*.cu")} | VARIANTS


def hopper_gpu() -> bool:
    try:
        return str(jax.devices("cuda")[0].compute_capability).startswith("9.")
    except RuntimeError:  # no CUDA backend
        return False


@pytest.mark.skipif(NVCC is None, reason="nvcc is not on the PATH")
@pytest.mark.parametrize("probe", sorted(BUILDS))
def test_probe_builds_and_passes_on_hopper(probe, tmp_path):
    source, flags = BUILDS[probe]
    binary = tmp_path / "probe"
    includes = ["-I", str(ROOT / "ffi" / "include"), "-I", jax.ffi.include_dir()]
    build = [NVCC, "-std=c++17", "-O2", "-gencode=arch=compute_90a,code=sm_90a", *includes, *flags, "-o", str(binary), str(PROBES / source)]
    result = subprocess.run(build, capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    if not hopper_gpu():
        pytest.skip("built; running it needs an sm_90 GPU")
    result = subprocess.run([str(binary)], capture_output=True, text=True, check=False, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr

"""The probes of benchmarks/probes compile wherever nvcc is (CI has it), and on an sm_90 GPU they
pass: the hardware facts a kernel plan relies on still hold."""

import shutil
import subprocess
from pathlib import Path

import jax
import pytest

PROBES = Path(__file__).resolve().parents[1] / "benchmarks" / "probes"
NVCC = shutil.which("nvcc")


def hopper_gpu() -> bool:
    try:
        return str(jax.devices("cuda")[0].compute_capability).startswith("9.")
    except RuntimeError:  # no CUDA backend
        return False


@pytest.mark.skipif(NVCC is None, reason="nvcc is not on the PATH")
@pytest.mark.parametrize("probe", sorted(p.name for p in PROBES.glob("*.cu")))
def test_probe_builds_and_passes_on_hopper(probe, tmp_path):
    binary = tmp_path / probe.removesuffix(".cu")
    build = [NVCC, "-std=c++17", "-O2", "-gencode=arch=compute_90a,code=sm_90a", "-o", str(binary), str(PROBES / probe)]
    result = subprocess.run(build, capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    if not hopper_gpu():
        pytest.skip("built; running it needs an sm_90 GPU")
    result = subprocess.run([str(binary)], capture_output=True, text=True, check=False, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr

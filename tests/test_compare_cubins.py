"""scripts/compare_cubins.py tells a change that leaves the kernels' machine code alone from one that
does not (it decides whether a device-code refactor needs a GPU run)."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from _util import load_script

pytest.importorskip("elftools", reason="pyelftools is not installed (pip install '.[test]')")
pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "compare_cubins.py"

SOURCE = """
namespace {
__device__ __forceinline__ float SCALED(float x) { return x * SCALE; }
__global__ void scale(float* x) { x[threadIdx.x] = SCALED(x[threadIdx.x]); }
__global__ void shift(float* x) { x[threadIdx.x] += 1.0f; }
#ifndef NO_SQUARE
__global__ void square(float* x) { x[threadIdx.x] *= x[threadIdx.x]; }
#endif
}
void launch(float* x) { scale<<<1, 32>>>(x); shift<<<1, 32>>>(x); }
"""


def cubin(tmp_path, name: str, **defines) -> Path:
    """SOURCE compiled under its own file name (so the anonymous namespace's hash differs too)."""
    src = tmp_path / f"{name}.cu"
    src.write_text(SOURCE.replace("SCALED", defines.pop("helper", "scaled")).replace("SCALE", defines.pop("scale", "2.0f")))
    out = tmp_path / f"{name}.cubin"
    flags = [f"-D{k}" if v is None else f"-D{k}={v}" for k, v in defines.items()]
    subprocess.run(["nvcc", "-arch=sm_80", "-diag-suppress", "177", "-cubin", "-o", str(out), str(src), *flags],
                   check=True)
    return out


def test_a_renamed_helper_and_a_removed_kernel_change_no_machine_code(tmp_path):
    tool = load_script(SCRIPT, "compare_cubins")
    same, differ, only_before, only_after = tool.compare(cubin(tmp_path, "before"),
                                                         cubin(tmp_path, "after", helper="times_scale", NO_SQUARE=None))
    assert differ == [] and only_after == [], differ
    assert len(same) == 2 and any("scale" in k for k in same) and any("shift" in k for k in same), same
    assert len(only_before) == 1 and "square" in only_before[0], only_before


def test_a_changed_constant_is_a_difference(tmp_path):
    tool = load_script(SCRIPT, "compare_cubins")
    same, differ, only_before, only_after = tool.compare(cubin(tmp_path, "before"),
                                                         cubin(tmp_path, "after", scale="3.0f"))
    assert len(differ) == 1 and "scale" in differ[0] and not only_before and not only_after, differ
    assert len(same) == 2, same  # shift and square are untouched
    run = subprocess.run([sys.executable, str(SCRIPT), "--cubins", str(tmp_path / "before.cubin"),
                          str(tmp_path / "after.cubin")], capture_output=True, text=True)
    assert run.returncode == 1 and "1 differ" in run.stdout, run.stdout + run.stderr


@pytest.mark.skipif(not (ROOT / ".git").exists(), reason="needs the git checkout")
def test_a_file_of_the_extension_against_its_last_commit():
    """--rev: the committed file and the working tree's, compiled as CMake does (unchanged in CI's
    clean clone, so every kernel is identical)."""
    source = ROOT / "ffi" / "cuda" / "gather_cache_cuda.cu"
    if subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "ffi"], cwd=ROOT).returncode != 0:
        pytest.skip("ffi/ has uncommitted changes")
    run = subprocess.run([sys.executable, str(SCRIPT), str(source), "--rev", "HEAD", "--arch", "sm_80"],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "kernels identical, 0 differ" in run.stdout and "only" not in run.stdout, run.stdout


def test_code_differences_are_counted_as_edits():
    """An instruction added at the start is one insertion, not a shift of every later one."""
    tool = load_script(SCRIPT, "compare_cubins")
    code = b"".join(bytes([k]) * 16 for k in range(1, 9))  # eight distinct 16-byte instructions
    assert tool.code_diff(code, b"\xee" * 16 + code) == "8 -> 9 instructions, 1 inserted"
    assert tool.code_diff(code, code[:32] + b"\xee" * 16 + code[48:]) == "8 instructions, 1 replaced"
    assert tool.code_diff(code, code[16:]) == "8 -> 7 instructions, 1 removed"

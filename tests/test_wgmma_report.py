"""scripts/wgmma_report.py finds a wgmma that ptxas serialized, and the sm_90a kernels have none:
a change that makes ptxas wait out every wgmma (20-30% of the decode attention's loop, more than
once: docs/DECODE_ATTENTION.md) fails here, on a machine without a GPU."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from _util import load_script

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "wgmma_report.py"

# An E4M3 wgmma whose accumulator an ordinary instruction changes while its group runs.
TOUCHED = """
#include "{root}/ffi/cuda/sm90_wgmma.cuh"
using namespace jax_kimi_mla;
__global__ void touched_accumulator(float* out, uint64_t a, uint64_t b) {{
  float d[8] = {{}};
  for (int i = 0; i < 4; ++i) {{
    wgmma_fence();
    wgmma_m64n16k32_e4m3_ss(d, a, b, 1);
    wgmma_commit();
    d[0] += out[i];
  }}
  wgmma_wait<0>();
  for (int j = 0; j < 8; ++j) out[8 * threadIdx.x + j] = d[j];
}}
"""


def test_the_decode_attention_kernels_have_no_serialized_wgmma(capsys):
    tool = load_script(SCRIPT, "wgmma_report")
    status = tool.main([])
    report = capsys.readouterr().out
    for kernel in ("rs_attention_kernel", "wide_attention_kernel", "attention_kernel", "combine_kernel"):
        assert kernel in report, report
    assert status == 0 and "SERIALIZED" not in report, report


def test_a_touched_accumulator_is_reported_and_fails(tmp_path):
    source = tmp_path / "touched.cu"
    source.write_text(TOUCHED.format(root=ROOT))
    run = subprocess.run([sys.executable, str(SCRIPT), str(source)], capture_output=True, text=True)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "touched_accumulator" in run.stdout and "SERIALIZED wgmma: C75" in run.stdout, run.stdout

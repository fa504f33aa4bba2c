"""examples/serve_loop.py runs end to end at its (small) default sizes, in every cache format, and
its generated tokens pass its own check against the cache-free reference model."""

import subprocess
import sys
from pathlib import Path

import pytest

SERVE_LOOP = Path(__file__).resolve().parents[1] / "examples" / "serve_loop.py"


@pytest.mark.parametrize("cache_format", ["bf16", "fp8", "fp8_ds_mla"])
def test_serve_loop_serves_every_request(cache_format):
    result = subprocess.run([sys.executable, "-P", str(SERVE_LOOP), "--cache-format", cache_format], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "served 8 requests" in result.stdout, result.stdout[-2000:]
    assert "greedy choice" in result.stdout and result.stdout.rstrip().endswith("PASS"), result.stdout[-2000:]

"""The code passes the project's ruff configuration (pyproject.toml), as pre-commit checks it."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# ruff comes with the test extras, beside the interpreter running the tests.
RUFF = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")


@pytest.mark.skipif(RUFF is None, reason="ruff is not installed (pip install '.[test]')")
def test_ruff_check_passes():
    result = subprocess.run([RUFF, "check", str(ROOT)], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr

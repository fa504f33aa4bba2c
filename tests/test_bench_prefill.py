"""benchmarks/bench_prefill.py runs end to end at its --quick sizes (a smoke run: on the CPU its
times are wall clock and its judgements mean nothing) and writes its CSV and RESULTS.md."""

import csv
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_prefill.py"


def test_bench_prefill_quick_smoke_run(tmp_path):
    # The chunked case: every part (the gather, the context's k and v, the attention over them).
    command = [sys.executable, "-P", str(BENCH), "--quick", "--only", "after", "--no-memory", "--out", str(tmp_path)]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    rows = list(csv.DictReader(open(tmp_path / "results.csv")))
    assert len(rows) == 1 and rows[0]["error"] == "" and float(rows[0]["step_us"]) > 0, rows
    assert "gather" in rows[0]["parts"] and "attention" in rows[0]["parts"], rows[0]["parts"]
    results = (tmp_path / "RESULTS.md").read_text()
    assert "step <= 1.25x the sum of its parts" in results and "peak memory" in results

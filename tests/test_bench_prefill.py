"""benchmarks/bench_prefill.py runs end to end at its --quick sizes (a smoke run: on the CPU its
times are wall clock and its judgements mean nothing) and writes its CSV and RESULTS.md."""

import csv
import dataclasses
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


def test_the_layer_expects_every_full_size_case_under_the_memory_target():
    """The layer's estimate of its temporaries (layer.prefill_temp_bytes, with the head groups
    layer.prefill_head_groups picks for head_groups=None) over the bench's budget, for every
    full-size case of issue 11: under the 1.5x target, by the margin the rule keeps for what it
    leaves out. (The H200 measured 1.48-1.61x with these groups: the model runs 0.1-0.2 low.) With all heads at
    once, the H = 96 cases would be far over it (2.5-3.4x): there the heads run in groups."""
    from _util import load_script

    from jax_kimi_mla import layer

    bench = load_script(BENCH, "bench_prefill")
    for case in bench.FULL.cases:
        config = dataclasses.replace(bench.config_of(case, bench.FULL, "auto"), head_groups=None)
        shape = dict(packed=case.seqs > 1, context_tokens=case.seqs * case.context)
        budget = bench.budget_bytes(case, bench.FULL, "auto")
        groups = layer.prefill_head_groups(config, case.tokens, **shape)
        estimated = 1 + layer.prefill_temp_bytes(config, case.tokens, groups, **shape) / budget
        assert estimated <= bench.MAX_PEAK_OVER_BUDGET - 0.03, (case.name, groups, estimated)
        if case.heads == 96:
            assert groups > 1 and 1 + layer.prefill_temp_bytes(config, case.tokens, 1, **shape) / budget > 2, case.name

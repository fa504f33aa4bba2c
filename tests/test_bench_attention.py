"""benchmarks/bench_attention.py's judgement of issue 10's targets from a run's rows."""

from pathlib import Path

from _util import load_script

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_attention.py"


def load_bench():
    return load_script(BENCH, "bench_attention")


def row(section, fmt, op_us, ref_us, *, heads=12, batch=64, context=16384):
    return dict(section=section, name=f"{section} {fmt}", cache_format=fmt, heads=heads, batch=batch, context=context,
                op_us=op_us, ref_us=ref_us, speedup=ref_us / op_us, floor_us=op_us / 2, ceiling_fraction=0.5)


def speedup_lines(bench, rows):
    return [line for line in bench.target_lines(rows, bench.FULL) if line.startswith("| 5.")]


def test_the_reference_target_is_judged_from_the_memory_grid_when_the_reference_section_did_not_run():
    bench = load_bench()
    rows = [row("memory", "bf16", 320.0, 2168.0), row("memory", "fp8_ds_mla", 300.0, 2325.0),
            row("memory", "bf16", 90.0, 560.0, batch=16)]  # not the point: not judged
    bf16, ds_mla = speedup_lines(bench, rows)
    assert "PASS" in bf16 and "6.8x (320.0 vs 2168.0 us)" in bf16 and "560" not in bf16, bf16
    assert "**MISS**" in ds_mla and "7.8x (300.0 vs 2325.0 us)" in ds_mla, ds_mla


def test_the_reference_section_wins_where_both_ran():
    bench = load_bench()
    rows = [row("memory", "bf16", 320.0, 2168.0), row("reference", "bf16", 330.0, 1650.0)]
    bf16, ds_mla = speedup_lines(bench, rows)
    assert "**MISS**" in bf16 and "5.0x (330.0 vs 1650.0 us)" in bf16 and "6.8x" not in bf16, bf16
    assert "not measured" in ds_mla, ds_mla

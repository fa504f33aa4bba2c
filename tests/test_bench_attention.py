"""benchmarks/bench_attention.py's judgement of issue 10's targets from a run's rows."""

from pathlib import Path

from _util import load_script

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_attention.py"


def load_bench():
    return load_script(BENCH, "bench_attention")


def row(section, fmt, op_us, ref_us, *, heads=12, batch=64, context=16384):
    return dict(section=section, name=f"{section} {fmt}", cache_format=fmt, heads=heads, batch=batch, context=context,
                op_us=op_us, ref_us=ref_us, speedup=None if ref_us is None else ref_us / op_us, floor_us=op_us / 2, ceiling_fraction=0.5)


def speedup_lines(bench, rows):
    return [line for line in bench.target_lines(rows, bench.FULL) if line.startswith("| 5.")]


def test_the_reference_target_is_judged_from_the_memory_grid_when_the_reference_section_did_not_run():
    bench = load_bench()
    rows = [row("memory", "bf16", 320.0, 2168.0), row("memory", "fp8_ds_mla", 300.0, 2325.0),
            row("memory", "bf16", 90.0, 560.0, batch=16)]  # not the issue's point: not judged
    bf16, ds_mla = speedup_lines(bench, rows)
    assert "PASS" in bf16 and "6.8x (320.0 vs 2168.0 us)" in bf16 and "560" not in bf16, bf16
    assert "**MISS**" in ds_mla and "7.8x (300.0 vs 2325.0 us)" in ds_mla, ds_mla


def test_the_reference_section_wins_where_both_ran():
    bench = load_bench()
    rows = [row("memory", "bf16", 320.0, 2168.0), row("reference", "bf16", 330.0, 1650.0)]
    bf16, ds_mla = speedup_lines(bench, rows)
    assert "**MISS**" in bf16 and "5.0x (330.0 vs 1650.0 us)" in bf16 and "6.8x" not in bf16, bf16
    assert "not measured" in ds_mla, ds_mla


def layer_lines(bench, rows):
    return [line for line in bench.target_lines(rows, bench.FULL) if line.startswith("| 6.")]


def test_the_layer_targets_are_judged_at_the_issues_point_only():
    bench = load_bench()
    rows = [row("layer", "bf16", 300.0, None, batch=64, context=16384),
            row("layer", "fp8_ds_mla", 250.0, None, batch=64, context=16384),
            row("layer", "bf16", 60.0, None, batch=1, context=4096),  # 4x its floor: reported, not judged
            row("layer", "fp8_ds_mla", 80.0, None, batch=1, context=4096)]  # slower than bf16: not judged
    for r, over_floor in zip(rows, (1.2, 1.4, 4.0, 4.0)):
        r["floor_us"] = r["op_us"] / over_floor
    floor, faster = layer_lines(bench, rows)
    assert "PASS" in floor and "bf16 1.20x, fp8_ds_mla 1.40x" in floor and "4.00x" not in floor, floor
    assert "PASS" in faster and "250.0 vs 300.0 us" in faster and "80.0" not in faster, faster
    rows[0]["floor_us"] = rows[0]["op_us"] / 1.6  # the point itself over 1.5x: a miss
    assert "**MISS**" in layer_lines(bench, rows)[0]

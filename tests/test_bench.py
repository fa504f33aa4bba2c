"""benchmarks/bench.py's judgement of issue 12's targets from a run's rows."""

from pathlib import Path

import pytest
from _util import load_script

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench.py"


def row(variant, heads, tokens, bw=0.0, us=1.0):
    return dict(variant=variant, phase=variant.split("_")[0], heads=heads, tokens=tokens, rope=variant.endswith("_rope"),
                ffi_bw_fraction=bw, ffi_us=us, error="")


def status(lines, label):
    (line,) = [line for line in lines if line.startswith(f"| {label}")]
    return line.split(" | ")[2]


def test_issue12_targets_are_judged_per_path():
    bench = load_script(BENCH, "bench")
    rows = [
        row("prefill_fp8_rope", 96, 8192, bw=0.91), row("prefill_fp8_rope", 96, 32768, bw=0.89),
        row("decode_fp8_rope", 96, 1024, bw=0.93), row("decode_fp8_rope", 96, 4096, bw=0.95),
        row("decode_fp8_rope", 96, 64, bw=0.10),  # not a large size: not judged
        row("decode_bf16_nope", 12, 1, us=1.2), row("decode_fp8_nope", 12, 64, us=1.3),
        row("decode_bf16_rope", 12, 16, us=1.39),
    ]
    lines = bench.issue12_lines(rows, 0.8)
    assert status(lines, "prefill fp8 q/k/v + RoPE, H = 96") == "**not met**"
    assert status(lines, "decode fp8 RoPE, H = 96") == "met"
    assert status(lines, "prefill fp8 RoPE, H = 12") == "not measured"
    assert status(lines, "decode B <= 64, H = 12, every format, NoPE") == "**not met**"
    assert status(lines, "decode B <= 64, H = 12, every format, RoPE") == "met"
    assert "an empty kernel: 0.80 us" in "".join(lines)


def test_points_runs_chosen_points(capsys):
    """benchmarks/points.py on the default backend at tiny sizes: an epilogue point, an attention
    case by its bench_attention name, its kernels; an unknown case name is refused."""
    points = load_script(BENCH.parent / "points.py", "points")
    assert points.main(["--epilogue", "decode_bf16_rope:2:3", "--attention", "small bf16 H=12 B=1 ctx=4096",
                        "--kernels", "--unbalanced", "--copy-bytes", str(1 << 20), "--tag", "t"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("[t] copy ceiling")
    assert lines[1].startswith("[t] decode_bf16_rope T=2 H=3:") and "of the ceiling" in lines[1]
    assert lines[2].startswith("[t] small bf16 H=12 B=1 ctx=4096: op ")
    assert lines[3].startswith("[t] small bf16 H=12 B=1 ctx=4096: ")
    with pytest.raises(SystemExit, match="no bench_attention case"):
        points.main(["--attention", "small bf16 H=12 B=3 ctx=5", "--copy-bytes", str(1 << 20)])


def test_points_shortens_kernel_names():
    points = load_script(BENCH.parent / "points.py", "points")
    name = "void jax_kimi_mla::(anonymous namespace)::combine_kernel<16, 4>(jax_kimi_mla::DecodeAttention)"
    assert points.short_kernel_name(name) == "combine_kernel"
    assert points.short_kernel_name("nvjet_tst_128x256_64x4") == "nvjet_tst_128x256_64x4"

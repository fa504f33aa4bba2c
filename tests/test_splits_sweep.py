"""benchmarks/splits_sweep.py's cases: a uniform grid, and a serving batch with padding rows."""

from pathlib import Path

import numpy as np
import pytest
from _util import load_script

SWEEP = Path(__file__).resolve().parents[1] / "benchmarks" / "splits_sweep.py"


def test_a_case_with_live_rows_pads_the_others():
    sweep = load_script(SWEEP, "splits_sweep")
    fmt, batch, context, heads, args = sweep.case_inputs("bf16:8:512:4:3")
    lens = np.asarray(args[3])
    assert (fmt, batch, context, heads) == ("bf16", 8, 512, 4)
    assert lens.shape == (8,) and np.count_nonzero(lens) == 3
    assert lens[lens > 0].min() >= 256 and lens.max() <= 512
    assert np.asarray(args[2]).shape == (8, 8)  # the tables stay CONTEXT tokens wide


def test_a_case_without_live_rows_is_uniform():
    sweep = load_script(SWEEP, "splits_sweep")
    *_, args = sweep.case_inputs("fp8_ds_mla:2:128:4")
    assert np.asarray(args[3]).tolist() == [128, 128]


def test_plans_by_work_parse_and_patch_split_plan():
    sweep = load_script(SWEEP, "splits_sweep")
    assert sweep.by_work_plans("8x2,16x4") == [(8, 2), (16, 4)]
    for bad in ("8", "2x8", "8x0", "ax2"):
        with pytest.raises(sweep.argparse.ArgumentTypeError, match="MOSTxWORK"):
            sweep.by_work_plans(bad)
    chosen = sweep.ops.split_plan
    with sweep.forced_split_plan((8, 2)):
        assert sweep.ops.split_plan(128, 12, 16384, 132) == (8, 2)
    assert sweep.ops.split_plan is chosen

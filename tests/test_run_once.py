"""benchmarks/run_once.py, the profilers' target, runs each kind of case it names (tiny sizes, on
the default device), so that a device session's ncu call does not find it broken."""

from pathlib import Path

import pytest
from _util import load_script

RUN_ONCE = Path(__file__).resolve().parents[1] / "benchmarks" / "run_once.py"


@pytest.mark.parametrize("case", [
    ("attention", "fp8_ds_mla", "2", "128", "4"),
    ("gather", "fp8", "2", "128"),
    ("prefill_fp8_rope", "16", "2"),
])
def test_run_once_runs(case):
    load_script(RUN_ONCE, "run_once").main(*case)


def test_run_once_rejects_an_unknown_case():
    with pytest.raises(KeyError):
        load_script(RUN_ONCE, "run_once").main("no_such_case", "1", "1")

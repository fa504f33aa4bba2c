"""The cuDNN custom calls that the prefill attention's cuDNN path lowers to, on any machine.

jax_kimi_mla/prefill_attention.py calls jax's private cuDNN module, so it runs only on the jax
versions in ``TESTED_JAX``. What that module hands XLA is one ``__cudnn$fmhaSoftmax`` custom call
per attention call: the operands, the result types and a backend config that says everything cuDNN
is asked to do (mask, scale, layouts, segments). This script lowers each of the layer's call
patterns for a CUDA GPU (no GPU needed: the module's device queries are answered as an H200 with
cuDNN 9.19 would) and prints those custom calls, SSA names normalised. Two jax versions that print
the same text ask cuDNN for the same thing.

    python3 -P scripts/cudnn_lowering.py                  # print
    python3 -P scripts/cudnn_lowering.py --write FILE     # record (on a version the GPU tests passed on)
    python3 -P scripts/cudnn_lowering.py --check FILE     # exit 1 and show the difference if they differ

The record is tests/data/cudnn_prefill_lowering.txt; tests/test_prefill_attention.py checks it.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import re
import sys
from pathlib import Path
from unittest import mock

import jax
import jax.numpy as jnp

from jax_kimi_mla import prefill_attention as pa

# Small shapes with every feature: three packed sequences, a context shorter than the chunk.
T, H, C, S = 256, 4, 128, 3
SCALE = 0.1


@contextlib.contextmanager
def as_if_on_an_h200():
    """The private module's device queries answered as on an H200 with cuDNN 9.19, and the module
    used whatever the jax version (its signature is still checked)."""
    module = pa.private_module()
    if module is None:
        raise RuntimeError(f"jax {jax.__version__}: no private cuDNN module with the arguments the layer passes")
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(module, "check_cudnn_version", lambda: 91900))
        stack.enter_context(mock.patch.object(module, "check_compute_capability", lambda capability: True))
        stack.enter_context(mock.patch.object(module, "is_cuda_compute_capability_equal", lambda capability: False))
        stack.enter_context(mock.patch.object(pa, "private_api", lambda: module))
        yield


def _cases():
    def spec(*shape, dtype=jnp.bfloat16):
        return jax.ShapeDtypeStruct(shape, dtype)

    q, v = spec(T, H, 192), spec(T, H, 128)
    ctx_k, ctx_v = spec(C, H, 192), spec(C, H, 128)
    cu1, cu = spec(2, dtype=jnp.int32), spec(S + 1, dtype=jnp.int32)
    lens1, lens = spec(1, dtype=jnp.int32), spec(S, dtype=jnp.int32)

    def chunk(q, k, v, cu):
        return pa.cudnn_attention(q, k, v, cu, scale=SCALE)

    def after_context(q, k, v, cu, ctx_k, ctx_v, ctx_lens):
        return pa.cudnn_attention(q, k, v, cu, scale=SCALE, ctx_k=ctx_k, ctx_v=ctx_v, ctx_lens=ctx_lens)

    return {
        "one sequence": (chunk, (q, q, v, cu1)),
        "packed sequences": (chunk, (q, q, v, cu)),
        "one sequence after its context": (after_context, (q, q, v, cu1, ctx_k, ctx_v, lens1)),
        "packed sequences after their contexts": (after_context, (q, q, v, cu, ctx_k, ctx_v, lens)),
    }


def lowered_calls() -> str:
    """The cuDNN custom calls of every call pattern, one line each under a '== pattern' header."""
    lines = []
    with as_if_on_an_h200():
        for name, (fn, args) in _cases().items():
            text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
            calls = [line.strip() for line in text.splitlines() if "stablehlo.custom_call" in line]
            lines.append(f"== {name}: {len(calls)} custom calls")
            lines += [re.sub(r"%[0-9]+(:[0-9]+)?", "%N", re.sub(r"\s*loc\(.*\)\s*$", "", c)) for c in calls]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--write", type=Path, help="record the custom calls in this file")
    group.add_argument("--check", type=Path, help="compare the custom calls with this record")
    args = parser.parse_args(argv)
    text = lowered_calls()
    if args.write:
        args.write.write_text(text)
        print(f"jax {jax.__version__}: {text.count(chr(10))} lines written to {args.write}")
    elif args.check:
        diff = list(difflib.unified_diff(args.check.read_text().splitlines(), text.splitlines(), str(args.check),
                                         f"jax {jax.__version__}", lineterm=""))
        print("\n".join(diff) if diff else f"jax {jax.__version__}: the same custom calls as {args.check}")
        return 1 if diff else 0
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

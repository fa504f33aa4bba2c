"""Loading the compiled handlers and calling them.

Each backend module (``_cpu`` always, ``_cuda`` when it was built) exposes ``registrations()``:
op name -> capsule. Both register under the same target name, so one ``ffi_call`` runs the CPU
handler for CPU arrays and the CUDA kernel for GPU arrays.

Target names carry an ABI version: an exported (``jax.export``) program stores only the name and
the operands, so a change of operand order or meaning must bump ``ABI_VERSION``.
"""

from __future__ import annotations

import jax

from . import _cpu
from .formats import FFI_TARGETS as OPS

ABI_VERSION = 1


def target_name(op: str) -> str:
    return f"jax_kimi_mla_{op}_v{ABI_VERSION}"


def _register(module, platform: str) -> None:
    registrations = module.registrations()
    assert tuple(registrations) == OPS, f"{module.__name__} registers {tuple(registrations)}"
    for op, capsule in registrations.items():
        jax.ffi.register_ffi_target(target_name(op), capsule, platform=platform)


_register(_cpu, "cpu")
try:
    from . import _cuda
except ImportError:  # built without nvcc: CPU handlers only
    _cuda = None
else:
    _register(_cuda, "CUDA")

HAS_CUDA_MODULE = _cuda is not None


def call(op: str, inputs, result_shapes, aliases: dict[int, int], attrs: dict):
    """Runs one epilogue target. ``aliases`` maps input index -> output index (in place);
    ``attrs`` are the int64 column attributes."""
    outputs = jax.ffi.ffi_call(
        target_name(op),
        result_shapes,
        input_output_aliases=aliases,
        # Each batch element is an independent call on its own cache: a loop is always correct.
        vmap_method="sequential",
    )(*inputs, **attrs)
    return tuple(outputs)

"""Loading the compiled handlers and calling them.

Each backend module (``_cpu`` always, ``_cuda`` when it was built) exposes ``registrations()``:
op name -> capsule. Both register under the same target name, so one ``ffi_call`` runs the CPU
handler for CPU arrays and the CUDA kernel for GPU arrays.

Target names carry an ABI version: an exported (``jax.export``) program stores only the name and
the operands, so a change of operand order or meaning must bump ``ABI_VERSION``.
"""

from __future__ import annotations

import jax

from .formats import EPILOGUES, READERS
from .formats import FFI_TARGETS as OPS

try:
    from . import _cpu
except ImportError as e:  # the source tree without its compiled modules, most likely
    raise ImportError(
        f"jax_kimi_mla's compiled module _cpu was not found next to {__file__}. Importing the source tree"
        " needs an editable install that builds it (pip install -e .); to use an installed package"
        " instead, run Python with -P (or from another folder) so that the source folder does not"
        " shadow it."
    ) from e

ABI_VERSION = 2
# Older versions whose names stay registered, to the same handlers: every v1 program computes
# under them what it did under v1 (v1 calls carry no rope_style attribute, which means GPT-J, and
# v1 caches have unpadded rows). docs/ABI.md lists what changed.
COMPATIBLE_ABI_VERSIONS = (1,)


def target_name(op: str, version: int = ABI_VERSION) -> str:
    return f"jax_kimi_mla_{op}_v{version}"


def _register(module, platform: str) -> None:
    registrations = module.registrations()
    assert tuple(registrations) == OPS, f"{module.__name__} registers {tuple(registrations)}"
    for op, capsule in registrations.items():
        for version in (ABI_VERSION, *COMPATIBLE_ABI_VERSIONS):
            jax.ffi.register_ffi_target(target_name(op, version), capsule, platform=platform)


_register(_cpu, "cpu")
try:
    from . import _cuda
except ImportError:  # built without nvcc: CPU handlers only
    _cuda = None
else:
    _register(_cuda, "CUDA")

HAS_CUDA_MODULE = _cuda is not None


# The public function of each target, for messages.
PUBLIC_NAMES = {e.target: e.op for e in EPILOGUES.values()} | {r: r for r in READERS}


def call(op: str, inputs, result_shapes, aliases: dict[int, int], attrs: dict):
    """Runs one FFI target. ``aliases`` maps input index -> output index (in place); ``attrs``
    are its attributes, typed as the handler binds them."""
    target = jax.ffi.ffi_call(
        target_name(op),
        result_shapes,
        input_output_aliases=aliases,
        # Each batch element is an independent call on its own cache: a loop is always correct.
        vmap_method="sequential",
    )

    # The ops are inference-only: differentiating one says so at trace time, instead of jax's
    # generic "cannot differentiate" from inside the custom call.
    @jax.custom_jvp
    def run(*args):
        return tuple(target(*args, **attrs))

    @run.defjvp
    def _no_derivative(primals, tangents):
        name = PUBLIC_NAMES[op]
        raise TypeError(
            f"jax_kimi_mla.{name} is inference-only and has no derivative; differentiate"
            f" jax_kimi_mla.reference.{name} (the same op in jax.numpy) instead"
        )

    return run(*inputs)

"""Loading the compiled handlers and calling them.

Each backend module (``_cpu`` always, ``_cuda`` when it was built) exposes ``registrations()``:
target name -> capsule. Both register under the same target name, so one ``ffi_call`` runs the CPU
handler for CPU arrays and the CUDA kernel for GPU arrays.

Target names carry an ABI version: an exported (``jax.export``) program stores only the name and
the operands, so a change of operand order or meaning must bump ``ABI_VERSION``.
"""

from __future__ import annotations

import jax
from jax import custom_batching
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir

from . import _partition
from .formats import EPILOGUES, FFI_TARGETS, READERS

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


def target_name(target: str, version: int = ABI_VERSION) -> str:
    return f"jax_kimi_mla_{target}_v{version}"


def _register(module, platform: str) -> None:
    registrations = module.registrations()
    assert tuple(registrations) == FFI_TARGETS, f"{module.__name__} registers {tuple(registrations)}"
    for target, capsule in registrations.items():
        for version in (ABI_VERSION, *COMPATIBLE_ABI_VERSIONS):
            jax.ffi.register_ffi_target(target_name(target, version), capsule, platform=platform)


_register(_cpu, "cpu")
try:
    from . import _cuda
except ImportError:  # built without nvcc: CPU handlers only
    _cuda = None
else:
    _register(_cuda, "CUDA")

HAS_CUDA_MODULE = _cuda is not None

BUILD_CUDA_HINT = (
    "jax_kimi_mla was built without its CUDA module (no nvcc was found when it was installed), so"
    " its ops have no GPU kernels. Reinstall it with the CUDA toolkit's nvcc on PATH, forcing the"
    " CUDA build so that a missing nvcc fails loudly: JAX_KIMI_MLA_CUDA=ON pip install . from the"
    " source tree (README.md), or install a wheel built by scripts/build_wheel.sh; or run the op on"
    " the CPU (jax.devices('cpu'))."
)

# Without the CUDA module, each call passes its first operand through this identity, whose CUDA
# lowering (outside jax.export) says what to do instead of XLA's "no registered implementation
# for custom call" at compile time.
_missing_cuda_p = Primitive("jax_kimi_mla_missing_cuda_module")
_missing_cuda_p.def_abstract_eval(lambda x, *, target: x)
_missing_cuda_p.def_impl(lambda x, *, target: x)
mlir.register_lowering(_missing_cuda_p, lambda ctx, x, *, target: [x])
batching.primitive_batchers[_missing_cuda_p] = lambda args, dims, *, target: (_missing_cuda_p.bind(*args, target=target), dims[0])


def _missing_cuda_lowering(ctx, x, *, target):
    if ctx.module_context.lowering_parameters.for_export:  # an artifact may target CUDA from anywhere
        return [x]
    raise RuntimeError(f"jax_kimi_mla.{PUBLIC_NAMES[target]} was called on a GPU, but {BUILD_CUDA_HINT}")


mlir.register_lowering(_missing_cuda_p, _missing_cuda_lowering, platform="cuda")


# The public function of each target, for messages.
PUBLIC_NAMES = {e.target: e.op for e in EPILOGUES.values()} | {r: r for r in READERS}


def call(target: str, inputs, result_shapes, aliases: dict[int, int], attrs: dict, fold=None):
    """Runs one FFI target. ``aliases`` maps input index -> output index (in place); ``attrs``
    are its attributes, typed as the handler binds them. Under a jit on sharded inputs the call
    is partitioned by ``_partition``'s rule of the target; a scratch result comes back as None.
    Under ``jax.vmap``, ``fold(axis_size, in_batched, inputs, result_shapes, attrs)`` gives the one
    call that does the whole batch, as (inputs, result_shapes, attrs, unfold), or None: then the
    batch runs as a loop of calls (``_batching``)."""

    def make_target(results):
        return jax.ffi.ffi_call(target_name(target), results, input_output_aliases=aliases, vmap_method="sequential")

    # custom_partitioning has no batching rule of its own: this one folds or loops.
    @custom_batching.custom_vmap
    def partitioned(*args):
        if not HAS_CUDA_MODULE:
            args = (_missing_cuda_p.bind(args[0], target=target), *args[1:])
        return _partition.call(target, make_target, args, result_shapes, aliases, attrs)

    @partitioned.def_vmap
    def _batched(axis_size, in_batched, *args):
        plan = None if fold is None else fold(axis_size, in_batched, args, result_shapes, attrs)
        if plan is not None:
            folded, folded_shapes, folded_attrs, unfold = plan
            outs = unfold(call(target, folded, folded_shapes, aliases, folded_attrs, fold))
        else:

            def one(batched):
                it = iter(batched)
                return partitioned(*(next(it) if b else x for x, b in zip(args, in_batched)))

            outs = jax.lax.map(one, [x for x, b in zip(args, in_batched) if b])
        return outs, jax.tree.map(lambda _: True, outs)

    # The ops are inference-only: differentiating one says so at trace time, instead of jax's
    # generic "cannot differentiate" from inside the custom call.
    @jax.custom_jvp
    def run(*args):
        return partitioned(*args)

    @run.defjvp
    def _no_derivative(primals, tangents):
        name = PUBLIC_NAMES[target]
        raise TypeError(
            f"jax_kimi_mla.{name} is inference-only and has no derivative; differentiate"
            f" jax_kimi_mla.reference.{name} (the same op in jax.numpy) instead"
        )

    return run(*inputs)

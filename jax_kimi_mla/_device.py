"""What the default device is, as the ops and the prefill attention choose by it at trace time."""

from __future__ import annotations

import jax

DEFAULT_SM_COUNT = 132  # an H100/H200, when no GPU is visible at trace time


def sm_count() -> int:
    """Multiprocessors of the default GPU, or 0 when the default backend is not a GPU."""
    if jax.default_backend() != "gpu":
        return 0
    return getattr(jax.devices()[0], "core_count", None) or DEFAULT_SM_COUNT


def gpu_compute_capability() -> tuple[int, int] | None:
    """(major, minor) of the default device when it is a GPU that says, else None."""
    if jax.default_backend() != "gpu":
        return None
    try:
        major, minor = str(jax.devices()[0].compute_capability).split(".")[:2]
        return int(major), int(minor)
    except (AttributeError, TypeError, ValueError):
        return None


def gpu_is_sm90() -> bool:
    """Whether the default device is an sm_90 GPU (H100/H200), where the wgmma kernels run."""
    cc = gpu_compute_capability()
    return cc is not None and cc[0] == 9


def gpu_before_hopper() -> bool:
    """Whether the default device is a GPU older than sm_90, where the decode attention kernel
    cannot run (it needs TMA and 178-222 KB of shared memory per block)."""
    cc = gpu_compute_capability()
    return cc is not None and cc < (9, 0)

"""The nvcc command that CMake's build of the extension amounts to, for the scripts that compile its
CUDA sources on their own (compare_cubins.py, wgmma_report.py): one cubin, the tree's headers."""

from __future__ import annotations

from pathlib import Path

SUPPRESSED = "940,2473,177,550"  # warnings of the XLA FFI headers and of nvcc's own


def cubin_command(tree: Path, source: Path, arch: str, defines: list[str], out: Path, extra: tuple = ()) -> list[str]:
    """nvcc compiling source for arch (e.g. sm_90a) into the cubin out, with tree's ffi headers."""
    import jax.ffi

    return ["nvcc", "-std=c++17", "-O3", f"-arch={arch}", "-cubin", "-o", str(out), str(source),
            "-I", str(tree / "ffi" / "include"), "-I", str(tree / "ffi" / "cuda"), "-I", jax.ffi.include_dir(),
            "-diag-suppress", SUPPRESSED, "-diag-error", "20013,20015", *extra, *(f"-D{d}" for d in defines)]

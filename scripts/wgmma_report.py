"""What ptxas made of the sm_90a kernels that use wgmma, decided without a GPU.

A wgmma whose accumulator or A registers ptxas cannot prove untouched while it runs is serialized:
ptxas waits for it to finish before the next instruction and says so only in an informational line
(C7510-C7520, "Potential Performance Loss: wgmma.mma_async instructions are serialized"). The
decode attention kernels lost 20-30% that way more than once (docs/DECODE_ATTENTION.md, Sixteenth
round), so this compiles a .cu file for sm_90a with the flags CMake uses and reports, per kernel:
registers, spills, every serialization message, and with --pipeline the order of
its wgmmas and waits in the machine code (cuobjdump and nvdisasm from the CUDA toolkit, or
the nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm wheels), where `Q`/`H` is a wgmma (E4M3 / 16-bit), `|` a group's start and
`wN` a wait until at most N groups run.

    python3 scripts/wgmma_report.py                     # this tree's ffi/cuda/decode_attention_cuda.cu
    python3 scripts/wgmma_report.py --pipeline --kernel rs_attention_kernel
    python3 scripts/wgmma_report.py benchmarks/probes/ds_rs_tile_loop.cu --define JKM_RS_FP8_SS
    python3 scripts/wgmma_report.py ../other-worktree/ffi/cuda/decode_attention_cuda.cu  # with its headers

Exit status 1 if ptxas serialized a wgmma in any kernel, 0 otherwise (spills are reported: some
kernels spill a few bytes by design). Needs nvcc and jax (for
the XLA FFI headers).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))  # nvcc_flags, beside this script
from nvcc_flags import cubin_command  # noqa: E402

ENTRY = re.compile(r"Compiling entry function '(\w+)' for 'sm_90a'")
SERIALIZED = re.compile(r"\((C75\d\d)\) Potential Performance Loss: (.*?) in the function '(\w+)'")
REGISTERS = re.compile(r"Used (\d+) registers")
SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def readable_names(mangled: list[str]) -> dict[str, str]:
    """Kernel names demangled by c++filt (where it is), without namespaces and parameter lists."""
    if not mangled or shutil.which("c++filt") is None:
        return {m: m for m in mangled}
    out = subprocess.run(["c++filt"], input="\n".join(mangled), capture_output=True, text=True).stdout.splitlines()
    names = {}
    for m, d in zip(mangled, out):
        d = re.sub(r"^void |\(anonymous namespace\)::|jax_kimi_mla::", "", d)
        depth = 0
        for i, ch in enumerate(d):  # cut at the parameter list: the first "(" outside the template arguments
            depth += {"<": 1, ">": -1}.get(ch, 0)
            if ch == "(" and depth == 0:
                d = d[:i]
                break
        names[m] = d
    return names


def compile_report(source: Path, defines: list[str], cubin: Path) -> dict[str, dict]:
    """nvcc with ptxas -v: per kernel, its registers, spill bytes and serialization messages."""
    tree = next((p for p in source.parents if (p / "ffi" / "include").is_dir()), ROOT)  # a worktree's own headers
    cmd = cubin_command(tree, source, "sm_90a", defines, cubin, extra=("-Xptxas", "-v"))
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode != 0:
        raise SystemExit(f"nvcc failed:\n{run.stderr[-4000:]}")
    kernels: dict[str, dict] = {}
    current = None
    for line in run.stderr.splitlines():
        if m := ENTRY.search(line):
            current = kernels.setdefault(m.group(1), {"registers": 0, "spills": 0, "serialized": []})
        elif m := SERIALIZED.search(line):
            kernels.setdefault(m.group(3), {"registers": 0, "spills": 0, "serialized": []})["serialized"].append(
                f"{m.group(1)} {m.group(2).removeprefix('wgmma.mma_async instructions are serialized ')}")
        elif current is not None and (m := SPILLS.search(line)):
            current["spills"] = max(current["spills"], int(m.group(1)) + int(m.group(2)))
        elif current is not None and (m := REGISTERS.search(line)):
            current["registers"] = int(m.group(1))
    return kernels


def cuobjdump() -> tuple[str, dict] | None:
    """cuobjdump and an environment whose PATH has nvdisasm (which it runs on cubins): the CUDA
    toolkit's, or those of the nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm wheels."""
    folders = [str(Path(p).parent) for p in (shutil.which("cuobjdump"), shutil.which("nvdisasm")) if p]
    try:
        import nvidia.cu13  # a namespace package: the wheels put their binaries in its bin folder

        folders += [str(Path(base) / "bin") for base in nvidia.cu13.__path__]
    except ImportError:
        pass
    path = os.pathsep.join([*folders, os.environ.get("PATH", "")])
    tool, disassembler = shutil.which("cuobjdump", path=path), shutil.which("nvdisasm", path=path)
    return (tool, {**os.environ, "PATH": path}) if tool and disassembler else None


def pipeline(tool: tuple[str, dict], cubin: Path, kernel: str) -> str:
    """The kernel's wgmmas and waits in machine-code order (all paths of the code, in address order)."""
    sass = subprocess.run([tool[0], "-sass", "-fun", kernel, str(cubin)], capture_output=True, text=True, check=True,
                          env=tool[1]).stdout
    out = []
    for line in sass.splitlines():
        if "WARPGROUP.ARRIVE" in line:
            out.append("|")
        elif m := re.search(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x(\d+)", line):
            out.append(f"w{int(m.group(1), 16)}")
        elif m := re.search(r"\b([QH])GMMA\.", line):
            out.append(m.group(1))
    return " ".join(out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", nargs="?", default=str(ROOT / "ffi" / "cuda" / "decode_attention_cuda.cu"),
                        help="a .cu file (default: this tree's decode attention)")
    parser.add_argument("--define", action="append", default=None,
                        help="a -D (default: JKM_SM90A_BUILT, as CMake defines it for sm_90a); repeatable")
    parser.add_argument("--kernel", default="", help="only kernels whose name contains this")
    parser.add_argument("--pipeline", action="store_true", help="each kernel's wgmmas and waits (needs cuobjdump)")
    opts = parser.parse_args(argv)
    defines = ["JKM_SM90A_BUILT"] if opts.define is None else opts.define
    tool = cuobjdump() if opts.pipeline else None
    if opts.pipeline and tool is None:
        raise SystemExit("--pipeline needs cuobjdump and nvdisasm (the CUDA toolkit's, or "
                         "pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)")
    good = True
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernels.cubin"
        kernels = compile_report(Path(opts.source).resolve(), defines, cubin)
        version = subprocess.run(["nvcc", "--version"], capture_output=True, text=True).stdout.strip().splitlines()
        print(f"{Path(opts.source).resolve()}, sm_90a, {version[-1] if version else 'nvcc'}")
        names = readable_names(list(kernels))
        for mangled, k in sorted(kernels.items(), key=lambda kv: names[kv[0]]):
            name = names[mangled]
            if opts.kernel not in name:
                continue
            order = pipeline(tool, cubin, mangled) if tool else ""
            serialized = "; ".join(sorted(set(k["serialized"])))
            good &= not serialized
            spills = f"{k['spills']} bytes of spills" if k["spills"] else "no spills"
            print(f"  {name}: {k['registers']} registers, {spills}, " +
                  (f"SERIALIZED wgmma: {serialized}" if serialized else "no wgmma serialized"))
            if order:
                print(f"    {order}")
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())

"""Whether a change to CUDA source changed the machine code of the kernels, decided without a GPU.

Compiles a .cu file (or takes cubins) before and after a change and compares, kernel by kernel,
what the GPU would run: the machine code (.text), its relocations, the kernel's constant bank,
its static shared memory and its .nv.info attributes (registers, parameters, barriers...), with
symbol indices resolved to names and the anonymous-namespace hash stripped from them. A refactor
whose kernels all come out identical needs no GPU run to show that it changed nothing; any kernel
that differs does. Kernels present on one side only are listed (a kernel removed on purpose).

    # the working tree's file against the same file at a git revision, for the CI architectures
    python3 scripts/compare_cubins.py ffi/cuda/decode_attention_cuda.cu --rev HEAD
    # two cubins built some other way
    python3 scripts/compare_cubins.py --cubins before.cubin after.cubin

With --rev, the before side is that revision's ffi/ folder (its headers included) and the after
side the working tree's, each compiled with the flags CMake uses for the extension (see --arch
and --define), once per architecture. Needs nvcc, jax (for the XLA FFI
headers) and pyelftools (the test extras). Exit status: 0 when every kernel both sides have is
identical and the after side has no kernel the before side lacks, 1 otherwise.
"""

from __future__ import annotations

import argparse
import difflib
import re
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

from elftools.elf.elffile import ELFFile
from elftools.elf.relocation import RelocationSection

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))  # nvcc_flags, beside this script
from nvcc_flags import cubin_command  # noqa: E402

# nvcc names an anonymous namespace after the file and a hash of it: strip the name and its length.
ANON = re.compile(r"\d+_GLOBAL__N__[0-9a-f]+_\d+_\w+?_cu_[0-9a-f]{8}")
# .nv.info attributes whose payload starts with a symbol index: PARAM_CBANK, FRAME_SIZE,
# MIN_STACK_SIZE, MAX_STACK_SIZE, REGCOUNT.
SYMBOL_ATTRS = {0x0A, 0x11, 0x12, 0x23, 0x2F}
EIFMT_SVAL = 0x04  # a u16 size, then the payload; the other formats carry 2 bytes inline
PER_KERNEL = (".text.", ".rela.text.", ".rel.text.", ".nv.info.", ".nv.shared.", ".nv.constant0.")


def _name(name: str) -> str:
    return ANON.sub("<anon>", name)


def _nv_info(data: bytes, symbol) -> list:
    entries, i = [], 0
    while i + 4 <= len(data):
        fmt, attr = data[i], data[i + 1]
        if fmt != EIFMT_SVAL:
            entries.append((attr, bytes(data[i + 2 : i + 4])))
            i += 4
            continue
        (size,) = struct.unpack_from("<H", data, i + 2)
        payload = bytes(data[i + 4 : i + 4 + size])
        if attr in SYMBOL_ATTRS and size >= 4:
            payload = (symbol(struct.unpack_from("<I", payload)[0]), payload[4:])
        entries.append((attr, payload))
        i += 4 + size
    return entries


def sections(cubin: Path) -> dict:
    """The comparable sections of a cubin, by normalized name."""
    with open(cubin, "rb") as f:
        elf = ELFFile(f)
        symtab = elf.get_section_by_name(".symtab")

        def symbol(k: int) -> str:
            return _name(symtab.get_symbol(k).name)

        out = {}
        for s in elf.iter_sections():
            name = _name(s.name)
            if isinstance(s, RelocationSection):
                out[name] = tuple(
                    (r["r_offset"], r["r_info_type"], symbol(r["r_info_sym"]), r["r_addend"] if r.is_RELA() else 0)
                    for r in s.iter_relocations()
                )
            elif s.name == ".nv.info":
                out[name] = _nv_info(s.data(), symbol)
            elif s.name.startswith(PER_KERNEL):
                out[name] = _nv_info(s.data(), symbol) if s.name.startswith(".nv.info.") else s.data()
        return out


def _how(a: dict, b: dict, kernel: str) -> str:
    """What differs in a kernel: which sections, and for its code, how many instructions."""
    parts = [p.strip(".") for p in PER_KERNEL if a.get(p + kernel) != b.get(p + kernel)]
    code_a, code_b = a[".text." + kernel], b[".text." + kernel]
    if code_a == code_b:
        return ", ".join(parts)
    return f"{', '.join(parts)}: {code_diff(code_a, code_b)}"


def code_diff(code_a: bytes, code_b: bytes) -> str:
    """How two kernels' code differs, in 16-byte instructions: the counts, and the edit that turns one
    into the other, matched in order (an instruction added at the start shifts every later one, yet
    is one insertion, not thousands of changes)."""
    words = [[code[i : i + 16] for i in range(0, len(code), 16)] for code in (code_a, code_b)]
    edits = {"replaced": 0, "inserted": 0, "removed": 0}
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, *words, autojunk=False).get_opcodes():
        if tag == "replace":
            edits["replaced"] += max(i2 - i1, j2 - j1)
        elif tag == "insert":
            edits["inserted"] += j2 - j1
        elif tag == "delete":
            edits["removed"] += i2 - i1
    counts = f"{len(words[0])} instructions" if len(words[0]) == len(words[1]) else f"{len(words[0])} -> {len(words[1])} instructions"
    return f"{counts}, {', '.join(f'{n} {what}' for what, n in edits.items() if n)}"


def compare(before: Path, after: Path) -> tuple[list[str], list[str], list[str], list[str]]:
    """(identical, differing, only before, only after) kernel names; a differing one says how."""
    a, b = sections(before), sections(after)
    kernels = [{k[len(".text.") :] for k in d if k.startswith(".text.")} for d in (a, b)]
    same, differ = [], []
    for k in sorted(kernels[0] & kernels[1]):
        if all(a.get(p + k) == b.get(p + k) for p in PER_KERNEL):
            same.append(k)
        else:
            differ.append(f"{k} ({_how(a, b, k)})")
    # The module-wide attributes that name a kernel both sides have.
    both = kernels[0] & kernels[1]

    def module_wide(d: dict) -> list:
        return sorted((e for e in d.get(".nv.info", []) if not isinstance(e[1], tuple) or e[1][0] in both), key=repr)

    if module_wide(a) != module_wide(b):
        differ.append("(module-wide .nv.info entries)")
    return same, differ, sorted(kernels[0] - kernels[1]), sorted(kernels[1] - kernels[0])


def compile_cubin(tree: Path, relative: Path, arch: str, defines: list[str], out: Path) -> None:
    """tree / relative compiled as CMake compiles the extension, with tree's headers."""
    subprocess.run(cubin_command(tree, tree / relative, arch, defines, out), check=True)


def report(label: str, result: tuple) -> bool:
    same, differ, only_before, only_after = result
    print(f"{label}: {len(same)} kernels identical, {len(differ)} differ"
          + (f", {len(only_before)} only before" if only_before else "")
          + (f", {len(only_after)} only after" if only_after else ""))
    for what, names in (("differs", differ), ("only before", only_before), ("only after", only_after)):
        for n in names:
            print(f"  {what}: {n}")
    return not differ and not only_after


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", nargs="?", type=Path, help="a .cu file of the working tree (with --rev)")
    parser.add_argument("--rev", help="the git revision to compare the working tree's source against")
    parser.add_argument("--cubins", nargs=2, type=Path, metavar=("BEFORE", "AFTER"))
    parser.add_argument("--arch", action="append",
                        help="nvcc -arch values (default: sm_90a, sm_80, sm_100a, the CI build's)")
    parser.add_argument("--define", action="append", default=None,
                        help="a -D for both sides (default: JKM_SM90A_BUILT, as CMake defines it); repeatable")
    opts = parser.parse_args(argv)
    if opts.cubins:
        return 0 if report("cubins", compare(*opts.cubins)) else 1
    if opts.source is None or opts.rev is None:
        parser.error("give a source and --rev, or --cubins BEFORE AFTER")
    source = opts.source.resolve()
    relative = source.relative_to(ROOT)
    defines = ["JKM_SM90A_BUILT"] if opts.define is None else opts.define
    good = True
    with tempfile.TemporaryDirectory(prefix="jkm_cubins_") as tmp:
        before = Path(tmp) / "before"  # the revision's ffi/ (and the file's folder, if elsewhere)
        before.mkdir()
        folders = sorted({"ffi", relative.parts[0]})
        archive = subprocess.run(["git", "archive", opts.rev, *folders], cwd=ROOT, check=True, capture_output=True)
        subprocess.run(["tar", "-x", "-C", str(before)], input=archive.stdout, check=True)
        for arch in opts.arch or ["sm_90a", "sm_80", "sm_100a"]:
            paths = [Path(tmp) / f"{side}_{arch}.cubin" for side in ("before", "after")]
            compile_cubin(before, relative, arch, defines, paths[0])
            compile_cubin(ROOT, relative, arch, defines, paths[1])
            good &= report(f"{relative} {arch} ({opts.rev} -> working tree)", compare(*paths))
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())

"""Whether two csrc/ trees compile to the same machine code, kernel by kernel (no GPU needed).

Compiles every ``.cu`` of both trees to a cubin for one architecture (nvcc, as the build does:
``-O3 -lineinfo``), disassembles them (``cuobjdump -sass``, e.g. the one shipped with triton)
and compares each kernel's instructions, ignoring addresses and encodings. A kernel of the old
tree is matched in the new one by its mangled name, with `--new-suffix` inserted before the
parameter list of ``prefill_mma_kernel`` (template switches added since, all ``false``) and
anonymous-namespace hashes ignored. Exit status 1 when any old kernel differs or is missing.

    python backends/cuda_paged/bench/sass_diff.py OLD_CSRC NEW_CSRC [--arch sm_90]
        [--new-suffix Lb0ELb0ELb0E] [--cuobjdump PATH] [--jobs 2]
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

_ANON = re.compile(r"_GLOBAL__N__[0-9a-f]+_\d+_\w+?_cu_[0-9a-f]+")
_INSN = re.compile(r"\s+/\*[0-9a-f]{4,}\*/")


def _compile(src: Path, out: Path, arch: str, includes: list[str]) -> None:
    cmd = ["nvcc", "-cubin", "-std=c++17", "-O3", "-lineinfo", f"-arch={arch}", f"-I{src.parent}",
           *includes, str(src), "-o", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"nvcc failed on {src}:\n{proc.stderr[-2000:]}")


def _kernels(cubin: Path, cuobjdump: str) -> dict[str, list[str]]:
    out = subprocess.run([cuobjdump, "-sass", str(cubin)], capture_output=True, text=True,
                         check=True).stdout
    res: dict[str, list[str]] = {}
    cur: list[str] | None = None
    for line in out.splitlines():
        m = re.search(r"Function : (\S+)", line)
        if m:
            cur = res.setdefault(_ANON.sub("ANON", m.group(1)), [])
        elif cur is not None and _INSN.match(line):
            cur.append(" ".join(line.split(";")[0].split()[1:]))
    return res


def _find_cuobjdump() -> str | None:
    found = shutil.which("cuobjdump")
    if found:
        return found
    try:
        import triton
    except ImportError:
        return None
    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return str(path) if path.is_file() else None


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old", type=Path)
    ap.add_argument("new", type=Path)
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--new-suffix", default="Lb0ELb0ELb0E",
                    help="mangled template arguments appended to prefill_mma_kernel since OLD")
    ap.add_argument("--cuobjdump", default=None)
    ap.add_argument("--jobs", type=int, default=2)
    args = ap.parse_args(argv)
    cuobjdump = args.cuobjdump or _find_cuobjdump()
    if cuobjdump is None:
        print("cuobjdump not found: pass --cuobjdump (triton ships one)")
        return 2
    from torch.utils.cpp_extension import include_paths

    includes = [f"-I{p}" for p in include_paths()]
    sources = sorted(p.name for p in args.old.glob("*.cu"))
    with tempfile.TemporaryDirectory() as tmp:
        jobs = [(tree / name, Path(tmp) / f"{tag}_{name}.cubin")
                for tag, tree in (("old", args.old), ("new", args.new)) for name in sources]
        with ThreadPoolExecutor(args.jobs) as pool:
            list(pool.map(lambda j: _compile(j[0], j[1], args.arch, includes), jobs))
        same = differ = missing = added = 0
        for name in sources:
            old = _kernels(Path(tmp) / f"old_{name}.cubin", cuobjdump)
            new = _kernels(Path(tmp) / f"new_{name}.cubin", cuobjdump)
            matched = set()
            for kernel, insns in old.items():
                key = kernel
                if "prefill_mma_kernel" in kernel:
                    key = kernel.replace("EEEvNS_15", f"E{args.new_suffix}EEvNS_15")
                if key not in new:
                    missing += 1
                    print(f"MISSING {name} {kernel}")
                    continue
                matched.add(key)
                if new[key] == insns:
                    same += 1
                else:
                    differ += 1
                    print(f"DIFFERS {name} {kernel} ({len(insns)} vs {len(new[key])} insns)")
            added += len(set(new) - matched)
    print(f"{args.arch}: {same} kernels identical, {differ} differ, {missing} missing, "
          f"{added} only in the new tree")
    return 1 if differ or missing else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

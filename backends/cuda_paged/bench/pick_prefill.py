"""Pick the default prefill kernel from one GPU run's correctness and timing files.

A candidate qualifies when it ran in `check_gpu.py --json` with every one of its cases passing,
and is faster than the shipped `DEFAULT_PREFILL_KERNEL` at both causal prompt shapes (4x2048,
4x8192; milliseconds averaged over the given `bench_kernels.py --sections prefill --json`
files) and at most 1% slower on the chunk over a cached prefix. Of those, the one with the
lowest worst-prompt-shape time ratio wins; none qualifying keeps the shipped default.

    python backends/cuda_paged/bench/pick_prefill.py CHECK.json BENCH.json [BENCH2.json ...]

Prints the table and, last, ``PICK <PrefillKernel value>`` (``KEEP <value>`` when the default
stays).
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict

PROMPTS = ("4x2048", "4x8192")
CACHED_SLACK = 1.01


def main(argv: list[str]) -> int:
    from pagedcore_cuda_paged.plan import DEFAULT_PREFILL_KERNEL

    if len(argv) < 2:
        print(__doc__)
        return 2
    try:
        with open(argv[0]) as f:
            cases = json.load(f)["cases"]
    except (OSError, ValueError, KeyError) as exc:
        print(f"no correctness results ({exc!r}): KEEP")
        print(f"KEEP {DEFAULT_PREFILL_KERNEL.value}")
        return 0
    checked: dict[str, bool] = {}
    for c in cases:
        if "prefill=PrefillKernel." not in c["case"]:
            continue
        name = c["case"].split("prefill=PrefillKernel.")[1].split()[0].lower()
        checked[name] = checked.get(name, True) and bool(c["ok"])
    runs: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for path in argv[1:]:
        try:
            with open(path) as f:
                rows = json.load(f).get("prefill", [])
        except (OSError, ValueError) as exc:
            print(f"skipping {path}: {exc}")
            continue
        for row in rows:
            if "ms" in row:
                runs[row["impl"].split("/", 1)[1]][row["shape"]].append(float(row["ms"]))
    ms = {k: {s: sum(v) / len(v) for s, v in shapes.items()} for k, shapes in runs.items()}
    default = DEFAULT_PREFILL_KERNEL.value
    base = ms.get(default)
    if base is None or not all(s in base for s in PROMPTS):
        print(f"no timing of the default {default} at {PROMPTS}: KEEP")
        print(f"KEEP {default}")
        return 0
    print(f"default {default}: " + ", ".join(f"{s} {t:.4f} ms" for s, t in sorted(base.items())))
    print(f"{'kernel':32s} {'checks':8s} " + " ".join(f"{s:>20s}" for s in sorted(base)))
    best, best_score = default, 1.0
    for name, shapes in sorted(ms.items()):
        ratio = {s: shapes[s] / base[s] for s in base if s in shapes}
        ok = checked.get(name)
        status = "n/a" if ok is None else "pass" if ok else "FAIL"
        print(f"{name:32s} {status:8s} " + " ".join(
            f"{ratio[s]:20.4f}" if s in ratio else f"{'-':>20s}" for s in sorted(base)))
        if name == default or not ok or not all(s in ratio for s in base):
            continue
        if not all(ratio[s] < 1.0 for s in PROMPTS):
            continue
        if any(ratio[s] > CACHED_SLACK for s in base if s not in PROMPTS):
            continue
        score = max(ratio[s] for s in PROMPTS)
        if score < best_score:
            best, best_score = name, score
    if best == default:
        print(f"no candidate beats {default} at both {PROMPTS} with every check passed")
        print(f"KEEP {default}")
    else:
        print(f"{best}: worst prompt-shape time ratio {best_score:.4f} to {default}")
        print(f"PICK {best}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

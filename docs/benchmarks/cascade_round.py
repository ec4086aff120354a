"""The last GPU round for issue #26 in one process (one torch/triton start-up, shared
compiles), each step only while GPU_DEADLINE leaves time, results written as they finish:

1. where the cascade target step's time goes (``backends/triton/tools/cascade_bench.py``'s
   components: prefix launch, suffix launch with its fused merge) for the default prefix
   shape and the variants of ``CASCADE_VARIANTS``; the fastest correct one is used below
   (recorded in ``cascade_choice.json``);
2. ``pagedcore bench kernels --case cascade --case prefill --backend triton --backend
   cuda_paged`` (the issue's bench: the cascade target, and prefill against SDPA with
   cuda_paged's prompts handed to triton's Hopper kernel);
3. ``pagedcore conformance triton -k shared_`` (cascade cases, NaN-poisoned slots);
4. ``pagedcore conformance cuda_paged`` on cases with prompts (the handoff, and layers
   that fall back to cuda_paged's prefill);
5. the engine's shared-prefix decode workload (llama3-8b shape, eager), if time is left.

    OUT_DIR=o GPU_DEADLINE=$(( $(date +%s) + 50 )) python3 docs/benchmarks/cascade_round.py
    python3 docs/benchmarks/cascade_round.py --smoke     # CPU, Triton's interpreter
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"
ROOT = Path(__file__).resolve().parents[2]
OUT = Path(os.environ.get("OUT_DIR") or "/tmp/cascade_round")
OUT.mkdir(parents=True, exist_ok=True)
# The round kills the job 15 s after GPU_DEADLINE: steps may start until 8 s after it.
DEADLINE = float(os.environ.get("GPU_DEADLINE") or time.time() + 600) + 8
T0 = time.time()


def log(msg: str) -> None:
    line = f"[+{time.time() - T0:5.1f}s, {DEADLINE - time.time():5.1f}s left] {msg}"
    print(line, flush=True)
    with open(OUT / "steps.txt", "a") as f:
        f.write(line + "\n")


def step(name: str, need_s: float, fn: Any) -> Any:
    """Run `fn` if at least `need_s` seconds are left; log and swallow its failure."""
    if DEADLINE - time.time() < need_s:
        log(f"{name}: skipped (needs ~{need_s:.0f} s)")
        return None
    log(f"{name}: start")
    try:
        result = fn()
    except BaseException as exc:  # SystemExit from a click command included
        if isinstance(exc, KeyboardInterrupt):
            raise
        log(f"{name}: {type(exc).__name__}: {exc}"[:400])
        (OUT / f"{name}_error.txt").write_text(traceback.format_exc())
        return None
    log(f"{name}: done")
    return result


def cli(args: list[str]) -> int:
    from pagedcore.cli import main

    try:
        rc = main.main(args, standalone_mode=False)
    except SystemExit as exc:
        rc = exc.code if isinstance(exc.code, int) else 1
    return int(rc or 0)


def components() -> str:
    """Time the target step's parts per prefix shape; return the fastest correct shape."""
    sys.path.insert(0, str(ROOT / "backends/triton/tools"))
    import cascade_bench

    args = argparse.Namespace(smoke=SMOKE)
    device = cascade_bench.set_target_shape(args, smoke=SMOKE)
    variants = [""] + [v for v in os.environ.get(
        "CASCADE_VARIANTS", "16,16,4,1,2" if SMOKE else "64,64,4,3,2").split(";") if v]
    rows = cascade_bench.components(args, device, variants=variants)
    rows["commit"] = os.environ.get("PAGEDCORE_GIT_COMMIT", "unknown")
    (OUT / "cascade_components.json").write_text(json.dumps(rows, indent=2))
    ok = [r for r in rows["variants"] if "cascade_ms" in r and not r["nan"]
          and r["rel_err"] < 2e-2]
    best = min(ok, key=lambda r: r["cascade_ms"]) if ok else None
    choice = "" if best is None or best["variant"] == "default" else best["variant"]
    (OUT / "cascade_choice.json").write_text(json.dumps(
        {"PAGEDCORE_TRITON_CASCADE_PREFIX": choice or None,
         "by": "fastest correct variant of cascade_components.json"}, indent=2))
    log(f"components: best {best and best['variant']} "
        f"{best and round(best['cascade_ms'], 4)} ms (plain {rows['plain_ms']:.4f} ms)")
    return choice


def _registered() -> list[str]:
    """The attention backends registered through entry points (empty on a fresh machine
    whose packages were copied but not installed)."""
    from pagedcore.plugins.registry import get_registry

    return sorted(get_registry().backends)


def main() -> None:
    log(f"round start (smoke={SMOKE})")
    names = _registered()
    if "triton" not in names:
        log(f"the triton backend is not registered (registered: {names or 'none'}): install "
            "the packages first, e.g. python3 -m pip install --no-deps --no-build-isolation "
            "-e . -e backends/triton; the steps that need it are skipped")
    quick = ["--quick"] if SMOKE else []
    dev = ["--device", "cpu"] if SMOKE else ["--device", "cuda"]
    choice = step("components", 14, components)
    if choice:
        os.environ["PAGEDCORE_TRITON_CASCADE_PREFIX"] = choice
        log(f"PAGEDCORE_TRITON_CASCADE_PREFIX={choice} for the steps below")
    backends = ["--backend", "triton"]
    cases = ["--case", "cascade"]
    if not SMOKE:
        cases += ["--case", "prefill"]
        from pagedcore_cuda_paged import CudaPagedBackend

        why = CudaPagedBackend.is_available()
        log(f"cuda_paged: {why or 'available'}")
        if why is None:
            backends += ["--backend", "cuda_paged"]
    step("kernels", 12, lambda: cli(
        ["bench", "kernels", *cases, *backends, *quick,
         "--json", str(OUT / "kernels_cascade_prefill.json")]))
    step("conf_triton", 8, lambda: cli(
        ["conformance", "triton", *dev, *quick, "-k",
         "shared_decode/float32" if SMOKE else "shared_",
         "--json", str(OUT / "conformance_triton_shared.json")]))
    if "cuda_paged" in backends:
        for k in ("prefill/", "mixed/float16/hs128/bs16/h8kv2"):
            name = k.strip("/").replace("/", "_")
            step(f"conf_cuda_paged_{name}", 4, lambda k=k, name=name: cli(
                ["conformance", "cuda_paged", "--device", "cuda", "-k", k,
                 "--json", str(OUT / f"conformance_cuda_paged_{name}.json")]))
    step("engine", 4 if SMOKE else 30, lambda: cli(
        ["bench", "prefix", "--shared-decode-only", "--enforce-eager",
         *(["--small", "--device", "cpu"] if SMOKE else ["--model", "llama3-8b"]),
         "--json", str(OUT / "shared_decode.json")]))
    log("round end")


if __name__ == "__main__":
    main()

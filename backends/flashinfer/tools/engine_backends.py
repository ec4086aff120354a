"""`pagedcore bench engine` once per backend, each forced, in one process (one JSON each).

    python backends/flashinfer/tools/engine_backends.py OUT_PREFIX triton,flashinfer,cuda_paged \
        --only throughput,prefill --num-prompts 32 --max-new 32 --skip-hf --skip-eager

runs ``pagedcore bench engine ARGS --backend NAME --json OUT_PREFIXNAME.json`` for each name in
turn. One process pays the imports once (seconds on a fresh GPU machine), which is what a
short GPU slot needs; each JSON records the equivalent ``pagedcore bench engine`` command. A
backend whose run fails is reported and the next one runs.
"""

from __future__ import annotations

import gc
import sys
import time


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    prefix, names, rest = argv[0], [n for n in argv[1].split(",") if n], argv[2:]
    import torch

    from pagedcore.bench.engine import engine

    failed = 0
    for name in names:
        args = [*rest, "--backend", name, "--json", f"{prefix}{name}.json"]
        sys.argv = ["pagedcore", "bench", "engine", *args]  # what the JSON records
        t0 = time.time()
        try:
            engine.main(args, prog_name="pagedcore bench engine", standalone_mode=False)
            status = "ok"
        except BaseException as exc:  # report it, run the next backend
            if isinstance(exc, KeyboardInterrupt):
                raise
            failed += 1
            status = f"failed: {type(exc).__name__}: {exc}"[:400]
        print(f"engine_backends: {name} {status} ({time.time() - t0:.1f} s)", flush=True)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

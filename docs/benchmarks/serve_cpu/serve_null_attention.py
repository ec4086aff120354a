"""`pagedcore serve` with toy_sdpa's attention replaced by a copy (see
docs/benchmarks/serve_overhead_cpu.py): a CPU server whose steps cost about what an H200 step
of a small model costs the host. The engine process (spawned) imports this file as its main
module, so it is patched too."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from serve_overhead_cpu import _null_attention

_null_attention()

if __name__ == "__main__":
    from pagedcore.cli import main

    sys.argv = ["pagedcore", "serve", *sys.argv[1:]]
    main()

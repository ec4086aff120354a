"""Run a `pagedcore` command with the flashinfer backend declared for decode CUDA graphs
(``CudaGraphSupport.UNIFORM_SINGLE_TOKEN_DECODE``), whatever `backend.py` declares: how the
engine bench measures FlashInfer with graphs before the declaration is made.

    python backends/flashinfer/tools/engine_graphs.py bench engine --backend flashinfer ...
"""

from __future__ import annotations

import sys

from pagedcore_flashinfer import FlashInferBackend

from pagedcore.attention.backend import CudaGraphSupport
from pagedcore.cli import main

if __name__ == "__main__":
    FlashInferBackend.cudagraph_support = CudaGraphSupport.UNIFORM_SINGLE_TOKEN_DECODE
    sys.argv[0] = "pagedcore"
    main()

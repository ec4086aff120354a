"""Tensor parallelism for the engine over torch.distributed (gloo on CPU, NCCL on CUDA).

`LLM(..., tensor_parallel_size=N)` shards attention heads and the MLP across N processes
(`sharding`), runs one scheduler on rank 0 and broadcasts each step's plan (`plan`) from the
rank-0 side (`executor`) to the other ranks (`worker`). See ``docs/distributed.md``.

Nothing heavy is imported here.
"""

from __future__ import annotations

__all__: list[str] = []

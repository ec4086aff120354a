"""Where the Triton backend keeps V in an fp8 cache: transposed within each block.

The cache tensor is ``[2, num_blocks, block_size, Hkv, D]`` for every dtype (index 0 K, 1 V).
A 16-bit cache stores both halves token-major, as the shape reads. An fp8 cache stores
**V transposed within each block**: block ``b``'s V bytes are ``[Hkv, D, block_size]`` (the
tokens of one head dimension adjacent), in the same bytes the shape allots it.

Why: the attention's second product ``P @ V`` reduces over the tokens, so V is its B
operand along the reduction. A 16-bit tile read token-major reaches the tensor cores
through ``ldmatrix.trans``; an 8-bit tile has no transposing load, and Triton gathered it
one byte per element (``LDS.U8``, 128 a thread per 128-token tile: ~1,080 instructions a
tile against 464 for a bf16 tile of the same bytes, ``docs/benchmarks/triton.md``). With
the tokens of a head dimension adjacent the tile arrives 16 bytes at a time and its
interior loop compiles to ~620 instructions (sm_90, ``tools/sass_stats.py``).

``PAGEDCORE_TRITON_FP8_V_LAYOUT=token`` keeps V token-major (A/B measurements, and the
``kernels/decode_fp8.py`` experiment, which reads that layout only). The setting is read at
every cache write and launch: change it only between engines, never while a cache holds
data written under the other.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["FP8_V_LAYOUTS", "FP8_V_LAYOUT_ENV", "fp8_v_transposed", "v_transposed", "value_view"]

#: Tuning / A-B switch of the fp8 V layout (``transposed``, the default, or ``token``).
FP8_V_LAYOUT_ENV = "PAGEDCORE_TRITON_FP8_V_LAYOUT"
#: The layouts `FP8_V_LAYOUT_ENV` accepts.
FP8_V_LAYOUTS = ("transposed", "token")


def fp8_v_transposed() -> bool:
    """Whether an fp8 cache keeps V transposed within each block (`FP8_V_LAYOUT_ENV`)."""
    layout = os.environ.get(FP8_V_LAYOUT_ENV, "transposed")
    if layout not in FP8_V_LAYOUTS:
        raise ValueError(
            f"{FP8_V_LAYOUT_ENV}={layout!r}: expected one of {', '.join(FP8_V_LAYOUTS)}"
        )
    return layout == "transposed"


def v_transposed(kv_fp8: bool) -> bool:
    """Whether a cache of this kind keeps V transposed (fp8 caches, unless `FP8_V_LAYOUT_ENV`
    says ``token``; 16-bit and float32 caches never)."""
    return kv_fp8 and fp8_v_transposed()


def value_view(kv_cache: torch.Tensor) -> torch.Tensor:
    """V of a Triton-backend cache as ``[num_blocks, block_size, Hkv, D]`` in token order,
    whatever its layout: a view (no copy) whose element ``[b, s, h, d]`` is slot ``s`` of
    block ``b``, so ``value_view(cache)[blocks, slots] = rows`` writes rows where the kernels
    read them (tests and tools that fill a cache directly)."""
    v = kv_cache[1]
    if not v_transposed(kv_cache.element_size() == 1):
        return v
    num_blocks, block_size, num_kv_heads, head_size = v.shape
    return v.view(num_blocks, num_kv_heads, head_size, block_size).permute(0, 3, 1, 2)

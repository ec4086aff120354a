"""What the triton backend serves, shared by its descriptor (`TritonAttentionBackend`) and its
impl."""

from __future__ import annotations

#: Head sizes the kernels are built for.
HEAD_SIZES: tuple[int, ...] = (64, 80, 96, 112, 128, 192, 256)
#: KV-cache storage dtypes ("auto": the model dtype).
KV_CACHE_DTYPES: tuple[str, ...] = ("auto", "fp8_e4m3", "fp8_e5m2")

"""What the flex backend serves, shared by its descriptor (`FlexBackend`) and its impl."""

from __future__ import annotations

#: Head sizes FlexAttention's kernels serve (powers of two).
HEAD_SIZES: tuple[int, ...] = (16, 32, 64, 128, 256)

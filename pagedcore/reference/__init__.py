"""The reference attention backend: pure torch, float32 math, CPU and CUDA; the oracle.

Modules: `backend` (the descriptor), `metadata` (builder and plan), `impl` (per-layer
attention), `ops` (plain functions: cache writes, gathers, masked attention), `mla` (the MLA
reference, `ReferenceMLABackend`) and `plugin` (the registration hook). Importing this
package loads only the descriptor; torch loads with the builder and impl.
"""

from pagedcore.reference.backend import ReferenceBackend

__all__ = ["ReferenceBackend"]

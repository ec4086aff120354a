"""Entry point of the ``pagedcore.backends`` group: registers `CudaPagedBackend`."""

from __future__ import annotations

from collections.abc import Sequence

import pagedcore
from pagedcore.attention.backend import AttentionBackend


@pagedcore.hookimpl
def pagedcore_register_backends() -> Sequence[type[AttentionBackend]]:
    from pagedcore_cuda_paged.backend import CudaPagedBackend

    return [CudaPagedBackend]

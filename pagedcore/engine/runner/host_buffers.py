"""Pinned host buffers mirrored on the device, carved from one allocation (`Arena`), so a
step's inputs reach the device in one copy; and a C-speed identity index (`index_in`)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from itertools import compress, repeat
from operator import is_
from typing import TYPE_CHECKING

from pagedcore.kv_cache.spec import cdiv

if TYPE_CHECKING:
    import torch

    from pagedcore.engine.scheduling.request import Request

__all__ = ["Arena", "Buffer", "index_in"]


class Buffer:
    """A host array (pinned torch storage on CUDA) mirrored by a device tensor: views into
    an `Arena`, so several buffers can be uploaded with one copy."""

    def __init__(self, host: torch.Tensor, device: torch.Tensor) -> None:
        self.host = host
        self.np = host.numpy()
        self.device = device

    def upload(self, n: int, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """Copy the first `n` host elements to the device; return the device view."""
        if self.device is not self.host:
            self.device[:n].copy_(self.host[:n], non_blocking=True)
        out = self.device[:n]
        return out if shape is None else out.view(shape)

    def host_view(self, n: int, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        out = self.host[:n]
        return out if shape is None else out.view(shape)


def _nothing() -> None:
    return None


def index_in(reqs: Sequence[Request]) -> Callable[[Request], int | None]:
    """``f(request)``: its index in `reqs` (None: absent); a C-speed identity scan (no
    ``__eq__`` calls, unlike ``list.index``)."""
    positions = range(len(reqs))

    def index(request: Request) -> int | None:
        return next(compress(positions, map(is_, reqs, repeat(request))), None)

    return index


class Arena:
    """One host allocation (pinned on CUDA) and its device twin, carved into `Buffer`s.

    Buffers are laid out in the order they are made (8-byte aligned), so a byte range of the
    arena covering several buffers is uploaded with one ``copy_`` (`upload_bytes`). `mirror`
    (default: on any device but the CPU) gives the device side its own memory; on the CPU
    that is for tests: a host write that is never uploaded then stays invisible to the model.
    """

    def __init__(
        self,
        specs: Sequence[tuple[int, torch.dtype]],
        device: torch.device,
        *,
        mirror: bool | None = None,
    ) -> None:
        import torch

        mirror = device.type != "cpu" if mirror is None else mirror
        sizes = [n * dtype.itemsize for n, dtype in specs]
        offsets = [0]
        for size in sizes:
            offsets.append(offsets[-1] + cdiv(size, 8) * 8)
        self.offsets = offsets
        pin = device.type == "cuda"
        self.host = torch.zeros(max(offsets[-1], 8), dtype=torch.uint8, pin_memory=pin)
        self.device = torch.zeros(
            self.host.shape[0], dtype=torch.uint8, device=device
        ) if mirror else self.host
        self.buffers = []
        for o, size, (_n, dtype) in zip(offsets, sizes, specs, strict=False):
            host = self.host[o : o + size].view(dtype)
            # On the CPU the buffer is its own device copy (`upload` then copies nothing).
            dev = host if self.device is self.host else self.device[o : o + size].view(dtype)
            self.buffers.append(Buffer(host, dev))

    def uploader(self, start: int, end: int) -> Callable[[], object]:
        """A zero-argument call uploading host bytes ``[start, end)`` (views made once)."""
        if self.device is self.host or end <= start:
            return _nothing
        return functools.partial(
            self.device[start:end].copy_, self.host[start:end], non_blocking=True
        )

    def upload_bytes(self, start: int, end: int) -> None:
        """Copy host bytes ``[start, end)`` to the device (asynchronously from pinned memory)."""
        if self.device is not self.host and end > start:
            self.device[start:end].copy_(self.host[start:end], non_blocking=True)

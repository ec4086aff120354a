"""Several `nn.Linear`s over one input as one GEMM: their weights stacked in one buffer.

`LinearStack.build` concatenates the weights (and biases) of plain `nn.Linear` modules that
read the same input (q / k / v, gate / up) and makes each module's parameters views into the
stacked buffers: the state dict keeps its keys and the memory is not doubled. Calling the
stack runs one GEMM whose output holds the modules' outputs side by side. A module whose
weight was replaced afterwards (a loader assigning a new Parameter) breaks the aliasing;
`intact` says so, and callers fall back to the modules themselves.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["LinearStack"]


class LinearStack:
    """Stacked weights of plain `nn.Linear` modules (build with `LinearStack.build`).

    Attributes
    ----------
    weight:
        ``[sum(out_i), in]``: the modules' weights, in order.
    bias:
        ``[sum(out_i)]`` or None (no module has a bias).
    sizes:
        Each module's output features (the split points of the output).
    """

    __slots__ = ("_modules", "_ptrs", "bias", "sizes", "weight")

    def __init__(self, modules: Sequence[nn.Module], weight: torch.Tensor,
                 bias: torch.Tensor | None, sizes: tuple[int, ...]) -> None:
        self._modules = tuple(modules)
        self.weight = weight
        self.bias = bias
        self.sizes = sizes
        self._ptrs = self._current_ptrs()

    def _current_ptrs(self) -> tuple[int, ...]:
        linears: tuple[Any, ...] = self._modules
        return tuple(m.weight.data_ptr() for m in linears)

    @property
    def intact(self) -> bool:
        """True while every module's weight is still its view into `weight`."""
        return self._current_ptrs() == self._ptrs

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., in]`` -> ``[..., sum(out_i)]``: every module's output, side by side."""
        return F.linear(x, self.weight, self.bias)

    @classmethod
    def build(cls, modules: Sequence[nn.Module]) -> LinearStack | None:
        """Stack `modules` (plain `nn.Linear`s of one input size, dtype and device, all with
        or all without a bias); None, and nothing changed, when they cannot be stacked."""
        linears: list[Any] = list(modules)
        if not linears or any(type(m) is not nn.Linear for m in linears):
            return None
        weights = [m.weight for m in linears]
        biases = [m.bias for m in linears]
        w0 = weights[0]
        if w0.device.type == "meta" or any(
                w.dtype != w0.dtype or w.device != w0.device or w.shape[1] != w0.shape[1]
                for w in weights):
            return None
        if any(b is None for b in biases) and any(b is not None for b in biases):
            return None

        def stack(parts: list[Any], attr: str) -> torch.Tensor:
            buf = torch.cat([p.detach() for p in parts])
            start = 0
            for m, p in zip(linears, parts, strict=True):
                n = p.shape[0]
                setattr(m, attr, nn.Parameter(buf[start:start + n],
                                              requires_grad=p.requires_grad))
                start += n
            return buf

        with torch.no_grad():
            weight = stack(weights, "weight")
            bias = None if biases[0] is None else stack(biases, "bias")
        return cls(linears, weight, bias, tuple(int(w.shape[0]) for w in weights))

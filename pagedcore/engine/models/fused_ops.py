"""Fused RMSNorm and SiLU-and-mul for the engine's Llama-family models (Triton, CUDA).

transformers' `LlamaRMSNorm` (and its copies in Qwen2, Qwen3 and Mistral) runs as five to
eight small kernels (casts, pow, mean, add, rsqrt, muls) and the MLP's
``act_fn(gate_proj(x)) * up_proj(x)`` as two; a decode step of a 32-layer model launches
about 65 norms and 32 activations. `swap_fused_modules` replaces those modules by
`FusedRMSNorm` and `FusedSiLUMulMLP`, one Triton kernel each, which keep the original's
parameters and submodules (same state-dict keys; tensor-parallel shards stay as they are)
and round where transformers rounds, so the swapped model computes the same numbers.

The engine swaps when the device is CUDA, Triton imports and ``PAGEDCORE_FUSED_KERNELS`` is
not ``0`` (see `fused_kernels_disabled_reason`); the variable may also name the kinds to swap
(`fused_kinds_setting`: ``rms_norm``, ``silu_mul``, and the attention module's ``rotary`` and
``qkv`` of `pagedcore.engine.models.fused_attention`). The kernels are CUDA-graph capturable:
no host syncs, outputs from torch's caching allocator.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import torch
from torch import nn

__all__ = [
    "FUSED_KERNELS_ENV",
    "FUSED_KINDS",
    "GPU_CHECKED_KINDS",
    "MAX_NORM_SIZE",
    "MLP_CLASSES",
    "RMS_NORM_CLASSES",
    "FusedRMSNorm",
    "FusedSiLUMulMLP",
    "add_rms_norm",
    "copy_attributes",
    "fused_kernels_disabled_reason",
    "fused_kinds_setting",
    "rms_norm",
    "silu_and_mul",
    "silu_and_mul_stacked",
    "swap_fused_modules",
]

#: Environment switch: unset swaps the `GPU_CHECKED_KINDS`; ``0`` / ``false`` / ``off`` /
#: ``no`` keeps transformers' own modules; ``1`` / ``all`` swaps every kind; a comma list of
#: `FUSED_KINDS` swaps those only.
FUSED_KERNELS_ENV = "PAGEDCORE_FUSED_KERNELS"
#: What can be swapped: the norms, the MLP activation (with ``silu_mul``: its gate and up
#: projections as one GEMM), the attention's rotary embedding,
#: (with ``rotary``) its q/k/v projections as one GEMM, (with ``rms_norm``) a decoder
#: layer's residual add fused into the norm after it, and (with ``add_rms_norm`` and
#: ``silu_mul``) ``down_add``: the layer's second residual add run by the MLP's down
#: projection GEMM itself, accumulating into the residual in place (`FusedSiLUMulMLP.add_into`).
FUSED_KINDS = ("rms_norm", "silu_mul", "gate_up", "rotary", "qkv", "add_rms_norm", "down_add")
#: The kinds swapped when `FUSED_KERNELS_ENV` is unset: those whose outputs were compared with
#: transformers' (or main's fused norm and MLP) on the GPU. ``rms_norm`` / ``silu_mul``:
#: ``tests/engine/test_fused_ops.py`` / ``test_engine_gpu.py`` on the H200; ``gate_up``,
#: ``rotary``, ``qkv`` and ``add_rms_norm``: ``docs/benchmarks/fused_check.py --quick`` on the
#: H200 (Qwen2-0.5B shape, bf16 logits of a prefill and of decode rows bit-identical with every
#: kind on; ``docs/benchmarks/step_h200_r1/fused_check.json``). ``down_add`` (session 27) is
#: not among them yet: it rounds once where the unfused layer rounds twice (the GEMM adds the
#: residual to its float32 accumulator), so it is not bit-identical and waits for its GPU
#: check (``PAGEDCORE_FUSED_KERNELS=1`` turns it on).
GPU_CHECKED_KINDS = tuple(k for k in FUSED_KINDS if k != "down_add")
_ON = ("1", "true", "on", "yes", "all", "")
_OFF = ("0", "false", "off", "no")
#: RMSNorm classes computing ``w * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)`` (not Gemma's
#: ``1 + w``), replaced by `FusedRMSNorm`.
RMS_NORM_CLASSES = ("LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MistralRMSNorm")
#: MLP classes computing ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``, replaced by
#: `FusedSiLUMulMLP` when their ``act_fn`` is SiLU.
MLP_CLASSES = ("LlamaMLP", "Qwen2MLP", "Qwen3MLP", "MistralMLP")
#: Largest normalised size one RMSNorm program handles (the row lives in registers).
MAX_NORM_SIZE = 32768

_SILU_BLOCK = 1024


def fused_kinds_setting() -> frozenset[str]:
    """The kinds ``PAGEDCORE_FUSED_KERNELS`` asks for (`GPU_CHECKED_KINDS` when unset).

    Raises
    ------
    ValueError
        The variable names something other than 0/1 or a comma list of `FUSED_KINDS`.
    """
    raw = os.environ.get(FUSED_KERNELS_ENV)
    if raw is None:
        return frozenset(GPU_CHECKED_KINDS)
    setting = raw.strip().lower()
    if setting in _ON:
        return frozenset(FUSED_KINDS)
    if setting in _OFF:
        return frozenset()
    kinds = {k.strip() for k in setting.split(",") if k.strip()}
    unknown = sorted(kinds - set(FUSED_KINDS))
    if unknown:
        raise ValueError(
            f"{FUSED_KERNELS_ENV}={raw!r} names {', '.join(unknown)}, which is not a fused "
            f"kernel kind; set it to 1 (all), 0 (none) or a comma list of {', '.join(FUSED_KINDS)}"
        )
    return frozenset(kinds)


def fused_kernels_disabled_reason(device: torch.device) -> str | None:
    """Why the engine keeps transformers' modules on `device` (None: swap them)."""
    if device.type != "cuda":
        return f"fused kernels run on CUDA devices only (device is {device.type!r})"
    if not fused_kinds_setting():
        return f"turned off by {FUSED_KERNELS_ENV}={os.environ[FUSED_KERNELS_ENV]!r}"
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    return None


def copy_attributes(dst: nn.Module, src: nn.Module, names: tuple[str, ...]) -> None:
    """Give a replacement module the plain attributes of the module it replaces that the
    model's code may read (``layer_idx``, ``config``, ...), those `src` has."""
    for name in names:
        if hasattr(src, name):
            setattr(dst, name, getattr(src, name))


def _check_same_device(name: str, a: torch.Tensor, b: torch.Tensor) -> None:
    if a.device != b.device:
        raise ValueError(f"{name}: tensors on {a.device} and {b.device}; move them to one device")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, *, eps: float) -> torch.Tensor:
    """``weight * (x * rsqrt(mean(x^2, -1) + eps)).to(x.dtype)``, the mean in fp32.

    Parameters
    ----------
    x:
        ``[..., N]`` fp32 / fp16 / bf16, ``N <= MAX_NORM_SIZE``; any strides (copied when the
        last dimension is not contiguous).
    weight:
        ``[N]`` on `x`'s device.
    eps:
        Added to the mean square.

    Returns
    -------
    torch.Tensor
        ``[..., N]`` in ``promote_types(x.dtype, weight.dtype)`` (what transformers returns).
    """
    from pagedcore.engine.models import _fused_kernels as fused_kernels

    size = x.shape[-1] if x.dim() else 0
    if weight.dim() != 1 or weight.shape[0] != size:
        raise ValueError(
            f"rms_norm: weight of shape {tuple(weight.shape)} does not match the last dimension "
            f"of x {tuple(x.shape)}; pass a [N] weight for a [..., N] input"
        )
    if not 0 < size <= MAX_NORM_SIZE:
        raise ValueError(f"rms_norm: last dimension {size} is outside 1..{MAX_NORM_SIZE}")
    _check_same_device("rms_norm", x, weight)
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    rows = x.reshape(-1, size)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if rows.shape[0] == 0:
        return out
    out_rows = out.view(-1, size)
    block = 1 << (size - 1).bit_length()
    num_warps = 4 if block <= 1024 else 8 if block <= 4096 else 16
    fused_kernels.rms_norm_kernel[(rows.shape[0],)](
        rows, weight.contiguous(), out_rows, rows.stride(0), out_rows.stride(0), size, float(eps),
        BLOCK=block, num_warps=num_warps,
    )
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, *,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = residual + x`` and ``rms_norm(s, weight)`` in one launch (a decoder layer's
    residual add and the norm after it).

    Parameters
    ----------
    x, residual:
        ``[..., N]`` of one shape and dtype (fp32 / fp16 / bf16), ``N <= MAX_NORM_SIZE``.
    weight:
        ``[N]`` on `x`'s device.
    eps:
        Added to the mean square.

    Returns
    -------
    tuple
        ``(normed, s)``: ``[..., N]`` in ``promote_types(x.dtype, weight.dtype)``, and the
        sum ``[..., N]`` in `x`'s dtype (rounded as torch's add rounds it).
    """
    from pagedcore.engine.models import _fused_kernels as fused_kernels

    if x.shape != residual.shape or x.dtype != residual.dtype:
        raise ValueError(
            f"add_rms_norm: x {tuple(x.shape)} {x.dtype} and residual {tuple(residual.shape)} "
            f"{residual.dtype} differ; pass the sublayer's output and its input"
        )
    size = x.shape[-1] if x.dim() else 0
    if weight.dim() != 1 or weight.shape[0] != size or not 0 < size <= MAX_NORM_SIZE:
        raise ValueError(
            f"add_rms_norm: weight of shape {tuple(weight.shape)} does not fit x "
            f"{tuple(x.shape)}; pass a [N] weight, N in 1..{MAX_NORM_SIZE}"
        )
    _check_same_device("add_rms_norm", x, weight)
    _check_same_device("add_rms_norm", x, residual)
    rows, res = x.reshape(-1, size), residual.reshape(-1, size)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if res.stride(-1) != 1:
        res = res.contiguous()
    total = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    if rows.shape[0]:
        block = 1 << (size - 1).bit_length()
        num_warps = 4 if block <= 1024 else 8 if block <= 4096 else 16
        fused_kernels.add_rms_norm_kernel[(rows.shape[0],)](
            rows, res, weight.contiguous(), total, out, rows.stride(0), res.stride(0), size,
            float(eps), BLOCK=block, num_warps=num_warps,
        )
    return out, total


def silu_and_mul_stacked(gate_up: torch.Tensor) -> torch.Tensor:
    """`silu_and_mul` of the two halves of ``[..., 2I]`` (gate first, then up: the output of
    one GEMM over stacked gate and up weights), read in place.

    Returns
    -------
    torch.Tensor
        ``[..., I]`` in `gate_up`'s dtype.
    """
    from pagedcore.engine.models import _fused_kernels as fused_kernels

    width = gate_up.shape[-1] if gate_up.dim() else 0
    if width % 2:
        raise ValueError(f"silu_and_mul_stacked: last dimension {width} is odd; pass the "
                         "[..., 2I] output of the stacked gate/up GEMM")
    half = width // 2
    rows = gate_up.reshape(-1, width)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty((*gate_up.shape[:-1], half), dtype=gate_up.dtype, device=gate_up.device)
    if rows.shape[0] and half:
        grid = (rows.shape[0], _cdiv(half, _SILU_BLOCK))
        fused_kernels.silu_mul_rows_kernel[grid](rows, out, half, rows.stride(0),
                                                 BLOCK=_SILU_BLOCK, num_warps=4)
    return out


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate).to(gate.dtype) * up``, elementwise, as transformers' gated MLP computes it.

    Parameters
    ----------
    gate, up:
        Same shape ``[..., I]``, fp32 / fp16 / bf16, on one device (``gate_proj(x)`` and
        ``up_proj(x)``).

    Returns
    -------
    torch.Tensor
        ``[..., I]`` in ``promote_types(gate.dtype, up.dtype)``.
    """
    from pagedcore.engine.models import _fused_kernels as fused_kernels

    if gate.shape != up.shape:
        raise ValueError(
            f"silu_and_mul: gate {tuple(gate.shape)} and up {tuple(up.shape)} differ in shape; "
            "pass gate_proj(x) and up_proj(x) of the same input"
        )
    _check_same_device("silu_and_mul", gate, up)
    gate, up = gate.contiguous(), up.contiguous()
    out = torch.empty(gate.shape, dtype=torch.promote_types(gate.dtype, up.dtype),
                      device=gate.device)
    numel = gate.numel()
    if numel:
        grid = (_cdiv(numel, _SILU_BLOCK),)
        fused_kernels.silu_mul_kernel[grid](gate, up, out, numel, BLOCK=_SILU_BLOCK, num_warps=4)
    return out


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class FusedRMSNorm(nn.Module):
    """A Llama-style RMSNorm as one Triton kernel, sharing the original's weight Parameter.

    Parameters
    ----------
    orig:
        One of `RMS_NORM_CLASSES` (its ``weight`` ``[N]`` and ``variance_epsilon``).
    """

    def __init__(self, orig: nn.Module) -> None:
        super().__init__()
        src: Any = orig
        self.weight: nn.Parameter = src.weight
        self.variance_epsilon = float(src.variance_epsilon)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[..., N]`` -> ``[..., N]`` (see `rms_norm`)."""
        return rms_norm(hidden_states, self.weight, eps=self.variance_epsilon)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


class FusedSiLUMulMLP(nn.Module):
    """``down_proj(silu_and_mul(gate_proj(x), up_proj(x)))`` over the original's projections.

    Parameters
    ----------
    orig:
        One of `MLP_CLASSES` with a SiLU ``act_fn``; its ``gate_proj``, ``up_proj`` and
        ``down_proj`` (possibly tensor-parallel shards) are reused as they are.
    fuse_gate_up:
        Stack the gate and up weights for one GEMM (`LinearStack`, when they are plain
        `nn.Linear`s); the activation then reads both halves of its output in place.
    """

    def __init__(self, orig: nn.Module, *, fuse_gate_up: bool = False) -> None:
        from pagedcore.engine.models.linear_stack import LinearStack

        super().__init__()
        src: Any = orig
        self.gate_proj: nn.Module = src.gate_proj
        self.up_proj: nn.Module = src.up_proj
        self.down_proj: nn.Module = src.down_proj
        copy_attributes(self, orig, ("config", "hidden_size", "intermediate_size"))
        self._gate_up: LinearStack | None = (
            LinearStack.build([self.gate_proj, self.up_proj]) if fuse_gate_up else None)

    @property
    def fused_gate_up(self) -> bool:
        """Whether gate and up run as one GEMM (stacked, and still aliasing the stack)."""
        return self._gate_up is not None and self._gate_up.intact

    def _activation(self, x: torch.Tensor) -> torch.Tensor:
        """``silu(gate_proj(x)) * up_proj(x)``: ``[..., hidden]`` -> ``[..., intermediate]``."""
        stack = self._gate_up
        if stack is not None and stack.intact:
            return silu_and_mul_stacked(stack(x))
        return silu_and_mul(self.gate_proj(x), self.up_proj(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., hidden]`` -> ``[..., hidden]``."""
        out: torch.Tensor = self.down_proj(self._activation(x))
        return out

    def add_into(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``residual + self(x)``, computed into `residual` (which it returns).

        When ``down_proj`` is a plain `nn.Linear` without bias or forward hooks (not a
        tensor-parallel shard, whose partial sums must be reduced before the add) in
        `residual`'s dtype and `residual` is contiguous, the down projection is one in-place
        ``addmm_``: the GEMM adds `residual` to its float32 accumulator (cuBLAS ``beta = 1``),
        one launch and one rounding instead of the GEMM, its rounding, the add's launch and
        its rounding. Otherwise it is ``residual += self(x)``.

        Parameters
        ----------
        x:
            ``[..., hidden]``, the normed input of the MLP.
        residual:
            ``[..., hidden]``, the residual stream, overwritten (the caller's own tensor:
            nothing else may read its old value).
        """
        act = self._activation(x)
        down: Any = self.down_proj
        weight = getattr(down, "weight", None)
        if (type(down) is nn.Linear and down.bias is None and weight is not None
                and not down._forward_hooks and not down._forward_pre_hooks
                and weight.dtype == residual.dtype == act.dtype and residual.is_contiguous()
                and residual.shape[:-1] == act.shape[:-1]):
            residual.view(-1, residual.shape[-1]).addmm_(act.reshape(-1, act.shape[-1]),
                                                         weight.t())
            return residual
        return residual.add_(down(act))


def _is_silu(act_fn: Any) -> bool:
    return isinstance(act_fn, nn.SiLU) or type(act_fn).__name__ == "SiLUActivation"


def _replacement(module: nn.Module, kinds: frozenset[str]) -> tuple[str, nn.Module] | None:
    """``(kind, new module)`` for a module this swap handles, else None."""
    name = type(module).__name__
    src: Any = module
    if (
        name in RMS_NORM_CLASSES
        and "rms_norm" in kinds
        and hasattr(src, "variance_epsilon")
        and isinstance(getattr(src, "weight", None), nn.Parameter)
        and src.weight.dim() == 1
        and 0 < src.weight.shape[0] <= MAX_NORM_SIZE
    ):
        return "rms_norm", FusedRMSNorm(module)
    if (
        name in MLP_CLASSES
        and "silu_mul" in kinds
        and all(hasattr(src, p) for p in ("gate_proj", "up_proj", "down_proj"))
        and _is_silu(getattr(src, "act_fn", None))
    ):
        return "silu_mul", FusedSiLUMulMLP(module, fuse_gate_up="gate_up" in kinds)
    return None


def swap_fused_modules(model: nn.Module, *,
                       kinds: frozenset[str] = frozenset({"rms_norm", "silu_mul"}),
                       ) -> dict[str, int]:
    """Replace `model`'s Llama-style RMSNorms and SiLU-gated MLPs by fused-kernel modules.

    Parameters
    ----------
    model:
        A transformers model (``...ForCausalLM`` or the bare model), already sharded when
        tensor-parallel. Modules of other classes (Gemma's ``1 + w`` norm, non-SiLU MLPs,
        MoE blocks, anything unrecognised) are left untouched, so any model may be passed.
    kinds:
        Which of ``rms_norm`` / ``silu_mul`` to swap, and ``gate_up``: the swapped MLPs
        stack their gate and up weights for one GEMM (other names are ignored here).

    Returns
    -------
    dict[str, int]
        ``{"rms_norm": n, "silu_mul": m}``: how many modules of each kind were replaced
        (and ``"gate_up"``: how many MLPs run one gate/up GEMM, when that kind is asked for).
    """
    counts = {"rms_norm": 0, "silu_mul": 0}
    if "gate_up" in kinds:
        counts["gate_up"] = 0
    targets = [
        (name, found)
        for name, module in model.named_modules()
        if name and (found := _replacement(module, kinds)) is not None
    ]
    for name, (kind, new) in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, new)
        counts[kind] += 1
        if isinstance(new, FusedSiLUMulMLP) and new.fused_gate_up:
            counts["gate_up"] += 1
    return counts

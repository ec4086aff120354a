"""FP8 KV-cache arithmetic shared by every backend: dtypes, ranges, quantize and dequantize.

The contract (see `pagedcore.attention.backend`): a cache write stores
``fp8(clamp(float32(x) / scale, -max, max))`` (round to nearest even, saturated to the fp8
range so that an outlier never becomes NaN/inf), and attention reads ``float32(fp8) * scale``.
``scale`` is per tensor per layer (``k_scale`` for K, ``v_scale`` for V), float32.

Importing this module does not import torch; the functions do.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedcore.attention.backend import KV_CACHE_DTYPE_ALIASES, KV_CACHE_DTYPES

if TYPE_CHECKING:
    import torch

__all__ = [
    "FP8_KV_CACHE_DTYPES",
    "FP8_MAX",
    "FP8_UNIT_ROUNDOFF",
    "calibrated_scale",
    "dequantize_fp8",
    "kv_cache_torch_dtype",
    "normalize_kv_cache_dtype",
    "quantize_fp8",
]

#: The fp8 KV-cache dtypes and their torch names.
FP8_KV_CACHE_DTYPES = {"fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
#: Largest finite magnitude of each fp8 dtype (the saturation bound of a cache write).
FP8_MAX = {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}
#: Unit roundoff ``u = 2**-(mantissa bits + 1)``: one rounding moves a value by at most
#: ``u`` relative (e4m3 has 3 mantissa bits, e5m2 has 2).
FP8_UNIT_ROUNDOFF = {"fp8_e4m3": 2.0**-4, "fp8_e5m2": 2.0**-3}


def normalize_kv_cache_dtype(name: str) -> str:
    """``"fp8"`` -> ``"fp8_e4m3"`` (and torch spellings); a ValueError for an unknown name."""
    norm = KV_CACHE_DTYPE_ALIASES.get(str(name).strip().lower(), str(name).strip().lower())
    if norm not in KV_CACHE_DTYPES:
        raise ValueError(
            f"kv_cache_dtype {name!r} is not one of 'auto', 'fp8', 'fp8_e4m3', 'fp8_e5m2'"
        )
    return norm


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype a cache of `kv_cache_dtype` is allocated in (`model_dtype` for auto)."""
    import torch

    norm = normalize_kv_cache_dtype(kv_cache_dtype)
    if norm == "auto":
        return model_dtype
    dtype: torch.dtype = getattr(torch, FP8_KV_CACHE_DTYPES[norm])
    return dtype


def _fp8_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    for kv_name, torch_name in FP8_KV_CACHE_DTYPES.items():
        if torch_name == name:
            return kv_name
    raise ValueError(f"{dtype} is not an fp8 KV-cache dtype ({', '.join(FP8_KV_CACHE_DTYPES)})")


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor | float, dtype: torch.dtype) -> torch.Tensor:
    """``fp8(clamp(float32(x) / scale, -max, max))`` in `dtype` (an fp8 torch dtype).

    Parameters
    ----------
    x:
        Any shape, any float dtype.
    scale:
        A float or a ``[1]`` float32 tensor (on `x`'s device).
    dtype:
        ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
    """
    bound = FP8_MAX[_fp8_name(dtype)]
    return (x.float() / scale).clamp_(-bound, bound).to(dtype)


def calibrated_scale(x: torch.Tensor, kv_cache_dtype: str) -> float:
    """The per-tensor scale that maps ``max|x|`` to the fp8 dtype's largest value (a tiny
    positive floor for an all-zero `x`); one host sync."""
    bound = FP8_MAX[normalize_kv_cache_dtype(kv_cache_dtype)]
    return max(float(x.abs().amax()) / bound, 1e-12)


def dequantize_fp8(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """``float32(x) * scale``: what a kernel reads from an fp8 cache."""
    return x.float() * scale

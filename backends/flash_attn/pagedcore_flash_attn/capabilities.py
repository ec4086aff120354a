"""What the installed flash-attn can do, read at call time without importing it.

The version comes from the distribution metadata (`importlib.metadata`), the device from
`torch.cuda`; neither loads flash-attn's CUDA extension. Every fact below was checked in
FlashAttention's sources (``csrc/flash_attn/flash_api.cpp``, ``mha_varlen_fwd``) at the tags
named; README.md carries the same table.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re

__all__ = [
    "HEAD_SIZES",
    "MIN_VERSION",
    "PAGED_BLOCK_MULTIPLE",
    "VERIFIED_UP_TO",
    "availability_problem",
    "compute_capability_problem",
    "device_capability",
    "format_release",
    "installed_version",
    "parse_release",
    "version_problem",
]

#: First release this adapter accepts. Paged KV in ``flash_attn_varlen_func`` (``block_table``)
#: arrived in 2.5.7 and ``softcap`` in 2.6.0; until 2.6.2 the split-KV path that varlen takes for
#: single-token GQA decode batches freed its accumulators before the kernel ran (fixed by
#: "Fix ima for split-kv kernel", #1085, first released in 2.6.2).
MIN_VERSION: tuple[int, int, int] = (2, 6, 2)
#: Newest release whose sources were read for this adapter.
VERIFIED_UP_TO: tuple[int, int, int] = (2, 8, 3)
#: From 2.7.3 on the arch check is ``major >= 8``; before it, only 8.x and 9.0 pass
#: ("Generalize arch checks for A100 and above", #1427).
GENERIC_ARCH_VERSION: tuple[int, int, int] = (2, 7, 3)
#: ``TORCH_CHECK(page_block_size % 256 == 0)`` in ``mha_varlen_fwd``, every release 2.5.7-2.8.3.
PAGED_BLOCK_MULTIPLE = 256
#: ``head_size <= 256``; multiples of 8 (2.7.0+ checks it; older releases pad q, k and v to a
#: multiple of 8, which for a paged cache would copy the whole cache on every call).
HEAD_SIZES: tuple[int, ...] = tuple(range(8, 257, 8))

_INSTALL_HINT = "pip install 'flash-attn>=2.6.2' --no-build-isolation"


def parse_release(version: str) -> tuple[int, ...]:
    """The numeric release part of a version string: ``"2.7.4.post1"`` -> ``(2, 7, 4)``.

    Raises
    ------
    ValueError
        When `version` does not start with a number.
    """
    match = re.match(r"^\s*v?(\d+(?:\.\d+)*)", version)
    if match is None:
        raise ValueError(f"cannot read a release number from version string {version!r}")
    return tuple(int(part) for part in match.group(1).split("."))


def format_release(release: tuple[int, ...]) -> str:
    """``(2, 6, 2)`` -> ``"2.6.2"``."""
    return ".".join(map(str, release))


def installed_version() -> str | None:
    """Version of the installed flash-attn distribution, or None when it is not installed.

    Reads package metadata only; the ``flash_attn`` module is located but not imported.
    """
    try:
        if importlib.util.find_spec("flash_attn") is None:
            return None
    except (ImportError, ValueError):  # a broken or half-imported installation
        return None
    for name in ("flash-attn", "flash_attn"):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def device_capability() -> tuple[int, int] | None:
    """Compute capability of the current CUDA device, or None without a usable NVIDIA GPU."""
    import torch

    if torch.version.hip is not None or not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability()
    return int(major), int(minor)


def version_problem(version: str | None) -> str | None:
    """Why `version` of flash-attn cannot serve this adapter, or None when it can."""
    if version is None:
        return f"flash-attn is not installed; install it with `{_INSTALL_HINT}`"
    try:
        release = parse_release(version)
    except ValueError:
        return f"cannot read the installed flash-attn version {version!r}; reinstall flash-attn"
    if release[0] >= 3:
        return (
            f"flash-attn {version} is not a FlashAttention-2 release; this adapter calls the "
            f"2.x flash_attn_varlen_func API (>= {format_release(MIN_VERSION)})"
        )
    if release < MIN_VERSION:
        return (
            f"flash-attn {version} is too old: this backend needs >= "
            f"{format_release(MIN_VERSION)} (paged varlen arrived in 2.5.7, soft-cap in 2.6.0, "
            "and 2.6.2 fixed a use-after-free in the split-KV decode path); upgrade with "
            f"`pip install -U 'flash-attn>={format_release(MIN_VERSION)}' --no-build-isolation`"
        )
    return None


def compute_capability_problem(version: str, capability: tuple[int, int] | None) -> str | None:
    """Why flash-attn `version` cannot run on a device of `capability`, or None when it can."""
    if capability is None:
        return (
            "needs an NVIDIA CUDA device and none is visible (torch.cuda.is_available() is False)"
        )
    shown = f"{capability[0]}.{capability[1]}"
    if capability < (8, 0):
        return f"needs compute capability >= 8.0 (Ampere or newer); this device has {shown}"
    release = parse_release(version)
    if release < GENERIC_ARCH_VERSION and capability[0] != 8 and capability != (9, 0):
        return (
            f"flash-attn {version} runs only on compute capability 8.x and 9.0; this device "
            f"has {shown}: upgrade to flash-attn >= {format_release(GENERIC_ARCH_VERSION)}"
        )
    return None


def availability_problem() -> str | None:
    """The first missing piece (package, version, device) for this backend, or None."""
    version = installed_version()
    problem = version_problem(version)
    if problem is not None or version is None:
        return problem
    return compute_capability_problem(version, device_capability())

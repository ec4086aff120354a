"""What the installed FlashInfer can do, read at call time without importing it.

The version comes from the distribution metadata (`importlib.metadata`), the device from
`torch.cuda`; neither imports ``flashinfer`` (whose import initialises CUDA and its JIT
machinery). Every fact below was read in flashinfer-python 0.7.2.post1's sources
(``flashinfer/decode.py``, ``flashinfer/prefill.py``); README.md carries the same table.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re

__all__ = [
    "BLOCK_SIZES",
    "HEAD_SIZES",
    "INSTALL_HINT",
    "KV_CACHE_DTYPES",
    "MIN_VERSION",
    "MLA_DIMS",
    "availability_problem",
    "device_capability",
    "installed_version",
    "parse_release",
    "record_load_failure",
    "version_problem",
]

#: The release whose Python API (plan/run keyword names, ``use_tensor_cores`` decode, the
#: ``q_data_type`` / ``kv_data_type`` / ``window_left`` / ``logits_soft_cap`` plan arguments)
#: this adapter was written against. Older releases renamed or lacked several of them.
MIN_VERSION: tuple[int, int, int] = (0, 7, 2)
#: Head sizes every prefill and tensor-core decode kernel FlashInfer JIT-builds accepts
#: (FA2 and FA3 templates are instantiated for these; others fail at JIT time).
HEAD_SIZES: tuple[int, ...] = (64, 128, 256)
#: Cache dtypes: the model dtype, or fp8 through the FA2 templates (``DTypeKV`` e4m3 / e5m2
#: with fp16/bf16 queries, in the tensor-core decode and the prefill kernels alike). FA3's
#: Hopper kernels take an fp8 cache only with fp8 queries (``is_fa3_backend_supported``).
KV_CACHE_DTYPES: tuple[str, ...] = ("auto", "fp8_e4m3", "fp8_e5m2")
#: Page sizes declared (FlashInfer takes any page size; these are the ones the conformance suite
#: is asked to confirm on a GPU).
BLOCK_SIZES: tuple[int, ...] = (1, 16, 32, 64)
#: ``(kv_lora_rank, rope_head_dim)`` pairs FlashInfer 0.7.2's FA2/FA3 MLA kernels are built
#: for (``flashinfer/mla/_batch_mla/_backends/_fa_common.py``); the flashinfer_mla backend.
MLA_DIMS: tuple[tuple[int, int], ...] = ((512, 64),)
#: FlashInfer's bf16 kernels and the FA2 templates need Ampere or newer.
MIN_CAPABILITY: tuple[int, int] = (8, 0)

INSTALL_HINT = (
    "pip install 'flashinfer-python>=0.7.2' (a GPU machine without a registry: "
    "backends/flashinfer/tools/install_offline.sh)"
)

#: Why the last attempt to import FlashInfer failed (set by `fi_api.load_flashinfer`).
_load_failure: list[str] = []


def record_load_failure(reason: str | None) -> None:
    """Remember (or with None, forget) why importing FlashInfer failed, for `is_available`."""
    _load_failure.clear()
    if reason is not None:
        _load_failure.append(reason)


def parse_release(version: str) -> tuple[int, ...]:
    """The numeric release part of a version string: ``"0.7.2.post1"`` -> ``(0, 7, 2)``.

    Raises
    ------
    ValueError
        When `version` does not start with a number.
    """
    match = re.match(r"^\s*v?(\d+(?:\.\d+)*)", version)
    if match is None:
        raise ValueError(f"cannot read a release number from version string {version!r}")
    return tuple(int(part) for part in match.group(1).split("."))


def installed_version() -> str | None:
    """Version of the installed FlashInfer distribution, or None when it is not installed.

    Reads package metadata only; the ``flashinfer`` module is located but not imported.
    """
    try:
        if importlib.util.find_spec("flashinfer") is None:
            return None
    except (ImportError, ValueError):  # a broken or half-imported installation
        return None
    for name in ("flashinfer-python", "flashinfer_python", "flashinfer"):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    # Installed with `pip install --target` and no metadata on the path: trust the module.
    return "unknown"


def version_problem(version: str | None) -> str | None:
    """Why `version` of FlashInfer cannot serve this adapter, or None when it can."""
    if version is None:
        return f"FlashInfer is not installed; install it with `{INSTALL_HINT}`"
    if version == "unknown":
        return None
    try:
        release = parse_release(version)
    except ValueError:
        return f"cannot read the installed FlashInfer version {version!r}; reinstall it"
    if release[:3] < MIN_VERSION:
        shown = ".".join(map(str, MIN_VERSION))
        return (
            f"FlashInfer {version} is too old: this backend needs >= {shown} (the plan() "
            f"arguments it passes); upgrade with `pip install -U 'flashinfer-python>={shown}'`"
        )
    return None


def device_capability() -> tuple[int, int] | None:
    """Compute capability of the current CUDA device, or None without a usable NVIDIA GPU."""
    import torch

    if torch.version.hip is not None or not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability()
    return int(major), int(minor)


def capability_problem(capability: tuple[int, int] | None) -> str | None:
    """Why a device of `capability` cannot run this backend, or None when it can."""
    if capability is None:
        return (
            "needs an NVIDIA CUDA device and none is visible (torch.cuda.is_available() is False)"
        )
    if capability < MIN_CAPABILITY:
        return (
            f"needs compute capability >= 8.0 (Ampere or newer); this device has "
            f"{capability[0]}.{capability[1]}"
        )
    return None


def availability_problem() -> str | None:
    """The first missing piece (package, version, device, import) for this backend, or None."""
    problem = version_problem(installed_version())
    if problem is not None:
        return problem
    problem = capability_problem(device_capability())
    if problem is not None:
        return problem
    return _load_failure[0] if _load_failure else None

"""`run_suite`: every case a backend's declarations call for, against the reference."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING

from pagedcore.attention.backend import AttentionBackend
from pagedcore.conformance.cases import CaseSpec, build_cases
from pagedcore.conformance.report import CaseResult, ConformanceReport

if TYPE_CHECKING:
    from pagedcore.conformance.graphs import GraphCase

__all__ = [
    "list_cases",
    "list_graph_cases",
    "mla_results",
    "resolve_backend",
    "resolve_device",
    "run_suite",
]


def resolve_backend(backend: str | type[AttentionBackend]) -> type[AttentionBackend]:
    """A backend class, given the class itself, a registered name, or ``"module:Class"``."""
    if not isinstance(backend, str):
        if not (isinstance(backend, type) and issubclass(backend, AttentionBackend)):
            raise TypeError(
                f"expected a backend name or an AttentionBackend subclass, got {backend!r}"
            )
        return backend
    if ":" in backend:  # "package.module:BackendClass", for classes not registered
        module_name, _, attr = backend.partition(":")
        found: object = getattr(importlib.import_module(module_name), attr)
    else:
        from pagedcore.plugins.registry import get_registry

        found = get_registry().get(backend)
    cls = getattr(found, "cls", found)  # a RegisteredBackend record or the class itself
    if not (isinstance(cls, type) and issubclass(cls, AttentionBackend)):
        raise TypeError(f"registry returned {found!r} for {backend!r}, not a backend class")
    return cls


def resolve_device(backend: type[AttentionBackend], device: str | None) -> tuple[str, str | None]:
    """``(device, None)``, or ``(device, why the suite cannot run there)``."""
    import torch

    has_cuda = torch.cuda.is_available()
    if device is None:
        if "cuda" in backend.supported_devices and has_cuda:
            device = "cuda"
        elif "cpu" in backend.supported_devices:
            device = "cpu"
        else:
            devices = ", ".join(backend.supported_devices)
            return "cuda", f"backend runs on {devices} only and no CUDA device is available"
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if device not in backend.supported_devices:
        devices = ", ".join(backend.supported_devices)
        return device, f"backend does not declare device {device!r} (declares {devices})"
    if device == "cuda" and not has_cuda:
        return device, "no CUDA device is available"
    return device, None


def list_cases(
    backend: type[AttentionBackend], *, quick: bool = False, device: str = "cpu"
) -> list[CaseSpec]:
    """The cases `run_suite` runs for `backend` on `device`."""
    return build_cases(backend, quick=quick, device=device)


def list_graph_cases(
    backend: type[AttentionBackend], *, quick: bool = False, device: str = "cpu"
) -> list[GraphCase]:
    """The graph-plan cases (``graph/decode/...``, ``graph/cascade/...``) `run_suite` runs
    for `backend` on `device` after `list_cases`' (none without a CUDA-graph capability;
    `pagedcore.conformance.graphs`, which imports torch)."""
    from pagedcore.conformance.graphs import build_graph_cases

    return build_graph_cases(backend, quick=quick, device=device)


def mla_results(
    backend: type[AttentionBackend], *, quick: bool, device: str
) -> list[CaseResult]:
    """MLA cases, from `pagedcore.conformance.mla` (its own module), as `CaseResult`s."""
    if not backend.supports_mla:
        return []
    try:
        mla = importlib.import_module("pagedcore.conformance.mla")
    except ModuleNotFoundError:
        return [CaseResult.skip("mla", "MLA conformance cases are not available yet")]
    tolerances: dict[str, float] = getattr(mla, "TOLERANCE", {})
    results = []
    for r in mla.run_mla_suite(backend, device=device, quick=quick):
        kv = "" if r.kv_cache_dtype == "auto" else f"/{r.kv_cache_dtype}"
        results.append(
            CaseResult(
                name=f"mla/{r.spec}/{r.dtype}{kv}/bs{r.block_size}",
                passed=bool(r.passed),
                max_rel_error=r.rel_err,
                tolerance=r.tolerance if r.tolerance is not None else tolerances.get(r.dtype),
                message=None if r.passed else (r.detail or "failed"),
            )
        )
    return results


def run_suite(
    backend: str | type[AttentionBackend],
    *,
    quick: bool = False,
    device: str | None = None,
    case_filter: str | None = None,
    exitfirst: bool = False,
    on_result: Callable[[CaseResult], None] | None = None,
) -> ConformanceReport:
    """Run the conformance suite on one backend.

    Parameters
    ----------
    backend:
        A registered backend name, or the backend class itself.
    quick:
        One case per axis instead of all of them (seconds on CPU for the reference).
    device:
        ``"cpu"`` or ``"cuda"``; None picks CUDA when the backend declares it and one is
        present, else the CPU.
    case_filter:
        Run only cases whose name contains this substring.
    exitfirst:
        Stop at the first failing case.
    on_result:
        Called with each case's result as soon as it is known (progress; the CLI's
        ``--progress``), graph-plan and MLA cases included.

    Returns
    -------
    ConformanceReport
        ``.passed`` is True iff every case that ran met its tolerance; an unavailable backend
        gives a report with ``.skipped`` set and ``.passed`` False.

    Examples
    --------
    >>> from pagedcore.conformance import run_suite
    >>> report = run_suite("reference", quick=True, device="cpu")
    >>> report.passed
    True
    """
    cls = resolve_backend(backend)
    why = cls.is_available()
    if why is not None:
        return ConformanceReport(backend=cls.name, device=device, quick=quick, skipped=why)
    dev, why = resolve_device(cls, device)
    if why is not None:
        return ConformanceReport(backend=cls.name, device=dev, quick=quick, skipped=why)
    from pagedcore.conformance.graphs import run_graph_case
    from pagedcore.conformance.harness import run_case

    report = ConformanceReport(backend=cls.name, device=dev, quick=quick)

    def record(result: CaseResult) -> bool:
        """Add `result`; True when the run stops here (`exitfirst` and a failure)."""
        report.results.append(result)
        if on_result is not None:
            on_result(result)
        return exitfirst and bool(report.failures)

    for case in list_cases(cls, quick=quick, device=dev):
        if case_filter is None or case_filter in case.name:
            if record(run_case(cls, case, device=dev)):
                return report
    # The CUDA-graph planning contract, where declared (pagedcore.conformance.graphs).
    for graph_case in list_graph_cases(cls, quick=quick, device=dev):
        if case_filter is None or case_filter in graph_case.name:
            if record(run_graph_case(cls, graph_case, device=dev)):
                return report
    if case_filter is None or "mla" in case_filter:
        for result in mla_results(cls, quick=quick, device=dev):
            if case_filter is not None and case_filter not in result.name:
                continue
            if record(result):
                return report
    return report

"""pytest plugin for the conformance suite (auto-loaded through the ``pytest11`` entry point).

Inert unless asked: importing it imports nothing but pytest, and it adds tests only with
``--pagedcore-backend NAME``.

* ``pytest --pagedcore-backend NAME [--pagedcore-quick] [--pagedcore-device cpu|cuda]`` adds
  one test per conformance case (graph-plan cases included), named ``conformance[NAME:case]``
  (select them with ``-k conformance``; ``--pagedcore-only`` drops every other collected
  test).
* The ``pagedcore_conformance`` fixture is a callable for backend packages::

      def test_conformance(pagedcore_conformance):
          pagedcore_conformance("triton", quick=True)

  It fails with the summary table unless the suite passed, and skips (with the reason) when
  the backend cannot run here. Without pytest: ``assert run_suite("triton", quick=True).passed``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from pagedcore.conformance.report import ConformanceReport


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("pagedcore", "pagedcore backend conformance")
    group.addoption("--pagedcore-backend", action="append", default=[], metavar="NAME",
                    help="Add one test per conformance case of backend NAME (repeatable).")
    group.addoption("--pagedcore-quick", action="store_true",
                    help="Use the quick case list.")
    group.addoption("--pagedcore-device", default=None, choices=["cpu", "cuda"],
                    help="Device for the conformance cases (default: as run_suite picks).")
    group.addoption("--pagedcore-only", action="store_true",
                    help="Run only the conformance cases, dropping other collected tests.")


class ConformanceItem(pytest.Item):
    """One conformance case of one backend."""

    def __init__(self, *, backend: str, case: Any, device: str, skip: str | None,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.backend = backend
        self.case = case
        self.device = device
        self.skip_reason = skip

    def runtest(self) -> None:
        if self.skip_reason is not None:
            pytest.skip(self.skip_reason)
        from pagedcore.conformance.graphs import GraphCase, run_graph_case
        from pagedcore.conformance.harness import run_case
        from pagedcore.conformance.runner import mla_results, resolve_backend

        cls = resolve_backend(self.backend)
        if self.case is None:  # the MLA cases, as one test
            quick = bool(self.config.getoption("--pagedcore-quick"))
            results = mla_results(cls, quick=quick, device=self.device)
            bad = [f"{r.name}: {r.message or r.skipped}" for r in results if not r.passed]
            if bad:
                raise AssertionError(f"{self.backend}: " + "; ".join(bad))
            return
        if isinstance(self.case, GraphCase):
            result = run_graph_case(cls, self.case, device=self.device)
        else:
            result = run_case(cls, self.case, device=self.device)
        if result.skipped is not None:
            pytest.skip(result.skipped)
        if not result.passed:
            raise AssertionError(f"{self.backend}: {self.case.name}: {result.message}")

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException],
                     style: Any = None) -> str:
        if isinstance(excinfo.value, AssertionError):
            return str(excinfo.value)
        return str(super().repr_failure(excinfo))

    def reportinfo(self) -> tuple[str, int, str]:
        return "pagedcore-conformance", 0, self.name


def _items(session: pytest.Session, name: str, quick: bool,
           device: str | None) -> list[pytest.Item]:
    from pagedcore.conformance.runner import (
        list_cases,
        list_graph_cases,
        resolve_backend,
        resolve_device,
    )

    cls = resolve_backend(name)
    why = cls.is_available()
    dev, no_device = resolve_device(cls, device)
    why = why or no_device
    if why is not None:
        return [ConformanceItem.from_parent(
            session, name=f"conformance[{name}]", backend=name, case=None, device=dev,
            skip=why)]
    cases: list[Any] = [*list_cases(cls, quick=quick, device=dev),
                        *list_graph_cases(cls, quick=quick, device=dev)]
    items: list[pytest.Item] = [
        ConformanceItem.from_parent(session, name=f"conformance[{name}:{c.name}]",
                                    backend=name, case=c, device=dev, skip=None)
        for c in cases
    ]
    if cls.supports_mla:
        items.append(ConformanceItem.from_parent(
            session, name=f"conformance[{name}:mla]", backend=name, case=None, device=dev,
            skip=None))
    return items


def pytest_collection_modifyitems(
    session: pytest.Session, config: pytest.Config, items: list[pytest.Item]
) -> None:
    names: list[str] = config.getoption("--pagedcore-backend")
    if not names:
        return
    quick: bool = config.getoption("--pagedcore-quick")
    device: str | None = config.getoption("--pagedcore-device")
    if config.getoption("--pagedcore-only"):
        config.hook.pytest_deselected(items=list(items))
        items.clear()
    for name in names:
        items.extend(_items(session, name, quick, device))


@pytest.fixture
def pagedcore_conformance() -> Callable[..., ConformanceReport]:
    """``check(backend, *, quick=True, device=None)``: run the suite, skip if unavailable,
    fail with the summary table unless it passed; returns the report."""

    def check(backend: Any, *, quick: bool = True,
              device: str | None = None) -> ConformanceReport:
        from pagedcore.conformance.runner import run_suite

        report = run_suite(backend, quick=quick, device=device)
        if report.skipped is not None:
            pytest.skip(f"{report.backend}: {report.skipped}")
        if not report.passed:
            pytest.fail(report.summary(), pytrace=False)
        return report

    return check

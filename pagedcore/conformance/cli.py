"""`pagedcore conformance NAME`: run the suite on one backend; exit 0 iff it passed."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

import click

from pagedcore.cli_types import OutputPath

if TYPE_CHECKING:
    from pagedcore.conformance.report import CaseResult


@click.command()
@click.argument("name")
@click.option("--quick", is_flag=True, help="One case per axis (seconds on CPU).")
@click.option(
    "--device", type=click.Choice(["cpu", "cuda"]), default=None,
    help="Where to run (default: CUDA when declared and present, else CPU).",
)
@click.option("--json", "json_path", type=OutputPath(), default=None,
              help="Also write the report as JSON to PATH (its directory must exist).")
@click.option("-k", "case_filter", default=None,
              help="Run only cases whose name contains this substring.")
@click.option("--list", "list_only", is_flag=True, help="Only list the cases.")
@click.option("-x", "--exitfirst", is_flag=True, help="Stop at the first failing case.")
@click.option("--progress", is_flag=True,
              help="Print each case's result to stderr as it finishes, with the time so far.")
@click.option("--allow-unavailable", is_flag=True,
              help="Exit 0 when the backend cannot run here (the report says why).")
def conformance(
    name: str,
    quick: bool,
    device: str | None,
    json_path: str | None,
    case_filter: str | None,
    list_only: bool,
    exitfirst: bool,
    progress: bool,
    allow_unavailable: bool,
) -> None:
    """Check backend NAME against the reference on every case its declarations call for."""
    from pagedcore.conformance.runner import (
        list_cases,
        list_graph_cases,
        resolve_backend,
        resolve_device,
        run_suite,
    )

    # Every user mistake is a usage error (exit 2) before the suite starts.
    try:
        cls = resolve_backend(name)
    except (KeyError, LookupError, ValueError, ImportError) as exc:
        raise click.BadParameter(str(exc), param_hint="NAME") from exc
    dev, _ = resolve_device(cls, device)
    # (name, why it is skipped here): the layer cases, then the graph-plan ones.
    cases = [(case.name, case.skip) for case in list_cases(cls, quick=quick, device=dev)]
    cases += [(case.name, None) for case in list_graph_cases(cls, quick=quick, device=dev)]
    if case_filter is not None:
        matching = [case for case in cases if case_filter in case[0]]
        if not matching and not (cls.supports_mla and "mla" in case_filter):
            examples = ", ".join(case_name for case_name, _ in cases[:3])
            raise click.BadParameter(
                f"{case_filter!r} matches none of the {len(cases)} cases of {cls.name!r} "
                f"(e.g. {examples}); `pagedcore conformance {cls.name} --list` shows them all",
                param_hint="-k",
            )
        cases = matching
    if list_only:
        for case_name, skip in cases:
            click.echo(case_name + (f"  (skipped: {skip})" if skip else ""))
        return

    start = time.perf_counter()

    def show(result: CaseResult) -> None:
        err = "" if result.max_rel_error is None else f" {result.max_rel_error:.2e}"
        click.echo(f"[{time.perf_counter() - start:6.1f} s] {result.status} {result.name}{err}",
                   err=True)

    from pagedcore.cli_progress import progress_bar

    try:
        # The bar by default; --progress prints a line per case instead (logs, CI).
        with progress_bar(f"conformance {cls.name}", len(cases), enabled=not progress) as bar:
            report = run_suite(
                name, quick=quick, device=device, case_filter=case_filter,
                exitfirst=exitfirst, on_result=show if progress else lambda _r: bar(1),
            )
    except (KeyError, LookupError, ValueError, ImportError) as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(report.summary())
    if json_path is not None:
        Path(json_path).write_text(report.to_json() + "\n")
        click.echo(f"wrote {json_path}")
    if report.skipped is not None and allow_unavailable:
        return
    if not report.passed:
        raise SystemExit(1)

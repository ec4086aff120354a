"""The progress bar of every long-running `pagedcore` command (rich, on stderr, transient).

`progress_bar` is what the demo, the conformance suite and every bench show while they run;
``advance(n)`` moves it on. Off a terminal rich draws nothing, so logs and pipes stay clean.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

__all__ = ["progress_bar"]


@contextmanager
def progress_bar(description: str, total: int | None, *,
                 enabled: bool = True) -> Iterator[Callable[[int], None]]:
    """A bar of `total` steps (None: unknown) labelled `description`; yields ``advance``."""
    if not enabled:
        def ignore(n: int = 1) -> None:
            del n

        yield ignore
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    with Progress("[progress.description]{task.description}", BarColumn(),
                  MofNCompleteColumn(), TimeElapsedColumn(), console=Console(stderr=True),
                  transient=True) as progress:
        task = progress.add_task(description, total=total)

        def advance(n: int = 1) -> None:
            progress.advance(task, n)

        yield advance

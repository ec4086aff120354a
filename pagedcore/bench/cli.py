"""`pagedcore bench ...`: every benchmark prints a table and, with --json, writes its figures."""

from __future__ import annotations

import click

from pagedcore.cli import LazyGroup

#: bench name -> "module:attribute" of a click command.
BENCHES: dict[str, str] = {
    "kv": "pagedcore.bench.kv:kv",
    "kernels": "pagedcore.bench.kernels:kernels",
    "engine": "pagedcore.bench.engine:engine",
    "step": "pagedcore.bench.step:step",
    "mla": "pagedcore.bench.mla:mla",
    "prefix": "pagedcore.bench.prefix:prefix",
    "chunked": "pagedcore.bench.chunked:chunked",
    "memory": "pagedcore.bench.memory:memory",
    "backends": "pagedcore.bench.backends:backends",
    "tp": "pagedcore.bench.tp:tp",
    "serve": "pagedcore.bench.serve:serve",
}

@click.group(cls=LazyGroup, lazy=BENCHES)
def bench() -> None:
    """Benchmarks shipped with pagedcore (each prints a table; --json PATH writes figures)."""

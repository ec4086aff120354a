"""The package layout: no import circles (DESIGN.md §1), counting every import statement.

An import inside a function or under ``TYPE_CHECKING`` still ties two modules together for a
reader, so this counts them all: a circle must be broken by moving the shared part out (as
`pagedcore.engine.runner.step_buffers` was), not by hiding one import in a function.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _packages() -> dict[str, Path]:
    roots = {"pagedcore": ROOT / "pagedcore"}
    for backend in sorted((ROOT / "backends").iterdir()):
        for package in backend.glob("pagedcore_*"):
            if (package / "__init__.py").is_file():
                roots[package.name] = package
    return roots


def _modules() -> dict[str, Path]:
    modules = {}
    for root in _packages().values():
        for path in root.rglob("*.py"):
            parts = list(path.relative_to(root.parent).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports anywhere (not counting its own parents,
    which Python imports first anyway)."""
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            for target in targets:
                if target in modules and target != name and not name.startswith(target + "."):
                    graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_cycle_finder_finds_a_planted_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c"]]


def test_no_import_circles() -> None:
    found = cycles(import_graph())
    assert not found, "import circles (break each by moving the shared part out):\n" + "\n".join(
        " <-> ".join(c) for c in found
    )


def test_engine_is_grouped_by_role() -> None:
    engine = ROOT / "pagedcore" / "engine"
    roles = {"scheduling", "runner", "models", "sampling", "distributed"}
    assert roles <= {p.name for p in engine.iterdir() if (p / "__init__.py").is_file()}
    flat = sorted(p.stem for p in engine.glob("*.py") if p.stem != "__init__")
    # The facade (LLM, its arguments, outputs, errors, CLI) stays at the top; every module of a
    # role lives in that role's package.
    for moved in ("scheduler", "model_runner", "sampler", "attention_hook", "input_batch"):
        assert moved not in flat, f"pagedcore/engine/{moved}.py belongs in a role package"

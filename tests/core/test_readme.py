"""README.md opens with the two commands, and .ci/run runs the README's test command verbatim."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _readme_commands() -> list[str]:
    lines = (ROOT / "README.md").read_text().splitlines()
    return [line.strip()[2:] for line in lines if line.strip().startswith("$ ")]


def test_readme_opens_with_the_main_job_and_the_tests() -> None:
    commands = _readme_commands()
    assert len(commands) == 2, commands
    assert commands[0].endswith("pagedcore demo")
    assert commands[1].endswith("python -m pytest")


def test_ci_runs_the_readme_test_command_verbatim() -> None:
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert _readme_commands()[1] in ci


def test_test_module_basenames_are_unique() -> None:
    # pytest's default import mode puts each test directory on sys.path; two test modules with
    # one basename in different directories then fail collection.
    seen: dict[str, Path] = {}
    for path in [*ROOT.glob("tests/**/*.py"), *ROOT.glob("backends/*/tests/**/*.py")]:
        if path.name == "conftest.py" or ".venv" in path.parts:
            continue
        assert path.name not in seen, f"{path} and {seen[path.name]} share a basename"
        seen[path.name] = path

"""The `pagedcore conformance` command, the report formats and the pytest plugin."""

from __future__ import annotations

import json
from pathlib import Path
from typing import ClassVar

import pytest
from click.testing import CliRunner

from pagedcore.conformance import ConformanceReport, list_cases, run_suite
from pagedcore.conformance.cases import TOLERANCES, build_cases
from pagedcore.conformance.cli import conformance
from pagedcore.reference import ReferenceBackend

pytest_plugins = ["pytester"]


class _Unavailable(ReferenceBackend):
    name: ClassVar[str] = "unavailable"

    @classmethod
    def is_available(cls) -> str | None:
        return "needs a device we do not have"


class _CudaOnly(ReferenceBackend):
    name: ClassVar[str] = "cuda_only"
    supported_devices: ClassVar[tuple[str, ...]] = ("cuda",)


def test_cli_passes_reference_and_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    result = CliRunner().invoke(
        conformance, ["reference", "--quick", "--device", "cpu", "-k", "decode",
                      "--json", str(out)]
    )
    assert result.exit_code == 0, result.output
    assert "PASSED" in result.output and "decode/" in result.output
    data = json.loads(out.read_text())
    assert data["schema_version"] == 1  # documented in docs/conformance.md
    assert data["passed"] is True and data["backend"] == "reference"
    assert data["results"] and all(r["status"] == "PASS" for r in data["results"])


def test_cli_progress_prints_each_case_as_it_finishes() -> None:
    result = CliRunner().invoke(
        conformance, ["reference", "--quick", "--device", "cpu", "-k", "mixed", "--progress"]
    )
    assert result.exit_code == 0, result.output
    lines = [line for line in result.stderr.splitlines() if line.startswith("[")]
    names = [c.name for c in list_cases(ReferenceBackend, quick=True, device="cpu")
             if "mixed" in c.name]
    assert len(lines) == len(names) > 1
    assert all(" PASS " in line for line in lines) and names[0] in lines[0]
    quiet = CliRunner().invoke(
        conformance, ["reference", "--quick", "--device", "cpu", "-k", "mixed"])
    assert not [line for line in quiet.stderr.splitlines() if line.startswith("[")]


def test_cli_unknown_backend_exits_nonzero() -> None:
    result = CliRunner().invoke(conformance, ["no_such_backend_xyz", "--quick"])
    assert result.exit_code != 0
    assert "no_such_backend_xyz" in result.output


def test_unavailable_backend_is_skipped_not_passed() -> None:
    report = run_suite(_Unavailable, quick=True)
    assert report.skipped == "needs a device we do not have"
    assert not report.passed and not report.results
    assert "SKIPPED" in report.summary()


def test_cuda_only_backend_without_cuda_is_skipped() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    report = run_suite(_CudaOnly, quick=True)
    assert report.skipped is not None and "CUDA" in report.skipped


def test_case_list_follows_declarations() -> None:
    names = [c.name for c in build_cases(ReferenceBackend, quick=False, device="cpu")]
    for part in ("decode/", "prefill/", "mixed/", "chunked_prefill/", "float16", "bfloat16",
                 "hs64", "hs80", "hs256", "bs1/", "h2kv2", "h14kv2", "h16kv2", "h8kv1",
                 "window", "alibi", "softcap", "int32_overflow", "out_buffer"):
        assert any(part in n for n in names), part
    assert len(names) == len(set(names))

    class Plain(ReferenceBackend):
        supports_alibi: ClassVar[bool] = False
        supports_sliding_window: ClassVar[bool] = False
        supports_logits_soft_cap: ClassVar[bool] = False
        supported_dtypes: ClassVar[tuple[str, ...]] = ("bfloat16",)
        supported_head_sizes: ClassVar[tuple[int, ...] | None] = (96,)

    plain = build_cases(Plain, quick=True, device="cpu")
    assert all(c.dtype == "bfloat16" and c.head_size == 96 for c in plain)
    assert not any(c.alibi or c.sliding_window or c.logits_soft_cap for c in plain)
    assert set(TOLERANCES) == {"float32", "float16", "bfloat16"}
    assert len(list_cases(ReferenceBackend, quick=True)) < len(names)


def test_report_json_round_trips() -> None:
    report = run_suite(ReferenceBackend, quick=True, device="cpu", case_filter="prefill/")
    assert isinstance(report, ConformanceReport) and report.passed
    data = json.loads(report.to_json())
    assert [r["name"] for r in data["results"]] == [r.name for r in report.results]
    assert all(r["max_rel_error"] is not None for r in data["results"])


def test_pytest_plugin_generates_one_test_per_case(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_other="def test_other():\n    pass\n")
    result = pytester.runpytest_inprocess(
        "-p", "no:cacheprovider", "--pagedcore-backend", "reference", "--pagedcore-quick",
        "--pagedcore-device", "cpu", "--pagedcore-only", "-k", "prefill and not fp8",
    )
    result.assert_outcomes(passed=2)
    result.stdout.no_fnmatch_line("*test_other*PASSED*")


def test_pytest_plugin_is_inert_by_default(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_other="def test_other():\n    pass\n")
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)


def test_fixture_skips_unavailable_and_passes_reference(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_fx="""
from typing import ClassVar
from pagedcore.reference import ReferenceBackend

class Gone(ReferenceBackend):
    name: ClassVar[str] = "gone"
    @classmethod
    def is_available(cls):
        return "not installed"

def test_gone(pagedcore_conformance):
    pagedcore_conformance(Gone)

def test_reference(pagedcore_conformance):
    assert pagedcore_conformance(ReferenceBackend, quick=True, device="cpu").passed
""")
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-rs")
    result.assert_outcomes(passed=1, skipped=1)
    result.stdout.fnmatch_lines(["*not installed*"])


def test_cli_lists_cases() -> None:
    result = CliRunner().invoke(conformance, ["reference", "--list", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert any("int32_overflow" in line and "skipped" in line for line in lines)
    assert len(lines) == len(list_cases(ReferenceBackend, device="cpu"))


def test_large_offset_case_places_blocks_above_the_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """The int32-overflow case, shrunk so it runs on the CPU: every block lies past the limit."""
    import attrs

    from pagedcore.conformance import harness

    monkeypatch.setattr(harness, "OFFSET_LIMIT", 1 << 18)
    case = next(c for c in build_cases(ReferenceBackend, device="cuda") if c.large_offsets)
    case = attrs.evolve(case, skip=None)
    batch = harness.make_batch(case, 1)
    per_block = case.block_size * case.num_kv_heads * case.head_size
    assert min(min(ids) for ids in batch.block_ids) * per_block >= 1 << 18
    result = harness.run_case(ReferenceBackend, case, device="cpu")
    assert result.passed, result.message


def test_pytest_plugin_reports_a_broken_backend(pytester: pytest.Pytester) -> None:
    """``module:Class`` names an unregistered backend; its failing cases fail as tests."""
    result = pytester.runpytest_inprocess(
        "-p", "no:cacheprovider", "--pagedcore-backend", "broken_backends:IgnoresBlockTable",
        "--pagedcore-quick", "--pagedcore-device", "cpu",
        "-k", "decode and not shared and not fp8 and not sinks",
    )
    result.assert_outcomes(failed=3)  # the decode batch, in each dtype (an output= buffer)
    result.stdout.fnmatch_lines(["*IgnoresBlockTable: decode*NaN in*"])


def test_cli_unavailable_backend_exit_codes() -> None:
    target = f"{__name__}:_Unavailable"
    result = CliRunner().invoke(conformance, [target, "--quick"])
    assert result.exit_code == 1 and "SKIPPED (needs a device we do not have)" in result.output
    result = CliRunner().invoke(conformance, [target, "--quick", "--allow-unavailable"])
    assert result.exit_code == 0, result.output

"""`tools/engine_backends.py`: one `pagedcore bench engine` per backend, forced, in one
process; a failing backend does not stop the next."""

from __future__ import annotations

import importlib.util
import pathlib
import sys
from typing import Any

import pytest

import pagedcore.bench.engine as engine_bench

_PATH = pathlib.Path(__file__).parents[1] / "tools" / "engine_backends.py"
_spec = importlib.util.spec_from_file_location("engine_backends", _PATH)
assert _spec is not None and _spec.loader is not None
tool = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tool)


def test_each_backend_forced_with_its_own_json(monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    seen: list[dict[str, Any]] = []

    def fake(**kw: Any) -> None:
        seen.append(kw)
        if kw["backend"] == "cuda_paged":
            raise RuntimeError("no such kernel")

    monkeypatch.setattr(engine_bench, "_run_engine_bench", fake)
    monkeypatch.setattr(sys, "argv", ["x"])
    names = "triton,cuda_paged,nonesuch,flashinfer"
    rc = tool.main(["/tmp/e_", names, "--small", "--only", "prefill"])
    assert rc == 1  # two failed: one in its run, one an unknown name (a usage error)
    assert [k["backend"] for k in seen] == ["triton", "cuda_paged", "flashinfer"]
    assert [k["json_path"] for k in seen] == ["/tmp/e_triton.json", "/tmp/e_cuda_paged.json",
                                              "/tmp/e_flashinfer.json"]
    assert all(k["stages"] == frozenset({"prefill"}) and k["small"] for k in seen)
    out = capsys.readouterr().out
    assert "cuda_paged failed: RuntimeError: no such kernel" in out and "flashinfer ok" in out
    assert "nonesuch failed: BadParameter" in out
    assert tool.main([]) == 2

"""The kernel bench's primitives and cases at a chosen block size (timing stubbed)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

from pagedcore.bench import kernel_primitives, kernels
from pagedcore.bench.memory import measure_kernel_speed
from pagedcore.reference.backend import ReferenceBackend

CPU = torch.device("cpu")


def _once(fn: Any, device: torch.device, **_: Any) -> float:
    fn()
    return 1.0


@pytest.fixture
def no_timing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernels, "time_ms", _once)
    monkeypatch.setattr(kernel_primitives, "time_ms", _once)


@pytest.mark.parametrize("block_size", [8, 32])
def test_paged_kv_lays_tokens_out_in_blocks_of_the_given_size(block_size: int) -> None:
    torch.manual_seed(0)
    lens = [5, 40, 17]
    kv = kernel_primitives.PagedKV(lens, torch.float32, CPU, block_size=block_size)
    assert kv.num_blocks == 1 + sum(math.ceil(n / block_size) for n in lens)
    assert not (kv.block_table[:, 0] == 0).any()  # block 0 is the null block
    paged = kv.paged()
    assert paged.shape[2] == block_size
    for r, n in enumerate(lens):
        blocks = kv.block_table[r, : math.ceil(n / block_size)]
        keys = paged[0][blocks].reshape(-1, *paged.shape[3:])[:n]
        torch.testing.assert_close(keys, kv.key[kv.token_slice(r)], rtol=0, atol=0)
    under = kernel_primitives.BackendUnderTest(ReferenceBackend, kv)
    assert under.kv_cache.shape[2] == block_size


def test_backend_under_test_takes_the_fp8_alias() -> None:
    """``--kv-cache-dtype fp8`` reaches the backend as ``fp8_e4m3`` (as from the engine)."""
    torch.manual_seed(0)
    kv = kernel_primitives.PagedKV([20, 9], torch.float32, CPU, block_size=16)
    seen: list[str] = []

    class Recording(ReferenceBackend):
        @staticmethod
        def get_kv_cache_shape(*args: Any) -> tuple[int, ...]:
            seen.append(args[-1])  # cuda_paged's layout knows the normalized names only
            return ReferenceBackend.get_kv_cache_shape(*args)

    under = kernel_primitives.BackendUnderTest(Recording, kv, kv_cache_dtype="fp8")
    assert seen == ["fp8_e4m3"]
    assert under.kv_cache.dtype == torch.float8_e4m3fn


def test_paged_kv_rejects_a_bad_block_size() -> None:
    with pytest.raises(ValueError, match="block_size must be a positive"):
        kernel_primitives.PagedKV([4], torch.float32, CPU, block_size=0)


@pytest.mark.parametrize("block_size", [8, 32])
def test_cases_agree_with_sdpa_at_any_block_size(no_timing: None, block_size: int) -> None:
    torch.manual_seed(0)
    rows = kernels.bench_uniform("decode", 2, 40, [ReferenceBackend], CPU, 1.0,
                                 block_size=block_size)
    rows += kernels.bench_uniform("prefill", 1, 24, [ReferenceBackend], CPU, 1.0,
                                  block_size=block_size)
    ours = [r for r in rows if r["impl"] == "reference"]
    assert len(ours) == 2 and all(r["rel_err_vs_sdpa"] < 1e-4 for r in ours), ours
    (mixed,) = kernels.bench_mixed(2, 40, 16, 8, [ReferenceBackend], CPU, block_size=block_size)
    assert mixed["rel_err_mixed_vs_separate"] < 1e-4
    assert kernels.BLOCK_SIZE == 16  # nothing overrides the default any more


def test_memory_sweep_measures_each_block_size(no_timing: None) -> None:
    rows = measure_kernel_speed([8, 32], batch=2, ctx=40, device=CPU)
    ref = {r["block_size"]: r for r in rows if r["backend"] == "reference"}
    assert set(ref) == {8, 32}
    assert all(r["ms"] == 1.0 and r["shape"] == "2x40" for r in ref.values())
    assert kernel_primitives.BLOCK_SIZE == 16


def test_cli_quick_writes_json(no_timing: None, tmp_path: Path) -> None:
    from pagedcore.cli import main

    out = tmp_path / "k.json"
    res = CliRunner().invoke(
        main, ["bench", "kernels", "--backend", "reference", "--quick", "--json", str(out)]
    )
    assert res.exit_code == 0, res.output
    info = json.loads(out.read_text())
    assert info["config"]["block_size"] == 16
    cases = {(r["case"], r["impl"]) for r in info["results"] if "error" not in r}
    assert {("decode", "reference"), ("prefill", "reference"), ("mixed", "reference")} <= cases


def test_json_holds_the_shapes_measured_before_a_cut(no_timing: None, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The report is rewritten after every shape: a run killed at its time cap (as on a GPU
    slot) keeps the shapes it finished."""
    from pagedcore.cli import main

    monkeypatch.setitem(kernels.QUICK, "decode", [(2, 64), (2, 128)])
    real = kernels.bench_uniform

    def cut_at_the_second(kind: str, batch: int, length: int, *a: Any, **kw: Any) -> Any:
        if length == 128:
            raise KeyboardInterrupt  # what the cap's signal looks like to the run
        return real(kind, batch, length, *a, **kw)

    monkeypatch.setattr(kernels, "bench_uniform", cut_at_the_second)
    out = tmp_path / "k.json"
    CliRunner().invoke(main, ["bench", "kernels", "--backend", "reference", "--quick",
                              "--case", "decode", "--json", str(out)])
    shapes = {r["shape"] for r in json.loads(out.read_text())["results"]}
    assert shapes == {"2x64"}


def test_fp8_decode_counts_fp8_bytes_and_stays_close_to_sdpa(no_timing: None) -> None:
    torch.manual_seed(0)
    (auto,) = [r for r in kernels.bench_uniform("decode", 2, 40, [ReferenceBackend], CPU, 1.0)
               if r["impl"] == "reference"]
    (fp8,) = [r for r in kernels.bench_uniform("decode", 2, 40, [ReferenceBackend], CPU, 1.0,
                                               kv_cache_dtype="fp8")
              if r["impl"] == "reference"]
    assert fp8["kv_GBps"] == pytest.approx(auto["kv_GBps"] / 4)  # float32 -> 1 byte, same ms
    assert 1e-3 < fp8["rel_err_vs_sdpa"] < 0.1  # quantized, by about e4m3's precision
    (sinks,) = [r for r in kernels.bench_uniform("decode", 2, 40, [ReferenceBackend], CPU, 1.0,
                                                 sinks=True) if r["impl"] == "reference"]
    assert sinks["rel_err_vs_sdpa"] is None  # SDPA has no sinks to compare with


def test_cli_records_the_fp8_and_sink_flags(no_timing: None, tmp_path: Path) -> None:
    from pagedcore.cli import main

    out = tmp_path / "k.json"
    res = CliRunner().invoke(main, [
        "bench", "kernels", "--backend", "reference", "--quick", "--case", "decode",
        "--kv-cache-dtype", "fp8", "--sinks", "--json", str(out),
    ])
    assert res.exit_code == 0, res.output
    info = json.loads(out.read_text())
    assert info["config"]["kv_cache_dtype"] == "fp8" and info["config"]["sinks"] is True
    assert "--kv-cache-dtype fp8" in info["command"] and "--sinks" in info["command"]
    assert {r["case"] for r in info["results"]} == {"decode"}


def test_cascade_case_checks_both_plans_against_sdpa(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ``cascade`` case: the tables share exactly the prefix, the unshared copy shares
    nothing, every result (from a NaN-filled cache) matches SDPA; a backend without cascade
    gets no row."""
    from pagedcore.bench import kernels_cascade

    monkeypatch.setattr(kernels_cascade, "time_ms", _once)
    torch.manual_seed(0)
    plain = type("NoCascade", (ReferenceBackend,), {"supports_cascade": False, "name": "x"})
    (row,) = kernels_cascade.bench_cascade(3, 32, 5, [ReferenceBackend, plain], CPU)
    assert row["impl"] == "reference" and row["shape"] == "3x(32+5)"
    assert row["common_prefix_len"] == 32 and not row["nan"]
    for key in ("rel_err_vs_sdpa", "rel_err_plain_vs_sdpa", "rel_err_unshared_vs_sdpa"):
        assert row[key] < 1e-5, (key, row)
    with pytest.raises(ValueError, match="multiple of the block size"):
        kernels_cascade.bench_cascade(3, 30, 5, [ReferenceBackend], CPU)


def test_every_case_runs_the_heads_it_is_given(no_timing: None,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """``heads`` (here the Qwen2-0.5B shape: 14 query / 2 KV heads of 64, GQA 7) reaches the
    cache, the query and the backend in each case, and each result still matches SDPA."""
    from pagedcore.bench import kernels_cascade

    monkeypatch.setattr(kernels_cascade, "time_ms", _once)
    torch.manual_seed(0)
    heads = kernels.HeadShape(14, 2, 64)
    caches: list[tuple[int, ...]] = []

    class Recording(ReferenceBackend):
        @staticmethod
        def get_kv_cache_shape(*args: Any) -> tuple[int, ...]:
            caches.append(args[2:4])  # (num_kv_heads, head_size)
            return ReferenceBackend.get_kv_cache_shape(*args)

    rows = kernels.bench_uniform("decode", 2, 40, [Recording], CPU, 1.0, heads=heads)
    rows += kernels.bench_uniform("prefill", 1, 24, [Recording], CPU, 1.0, heads=heads)
    ours = [r for r in rows if r["impl"] == "reference"]
    assert len(ours) == 2 and all(r["rel_err_vs_sdpa"] < 1e-4 for r in ours), ours
    decode = next(r for r in rows if r["case"] == "decode" and r["impl"] == "reference")
    assert decode["kv_GBps"] == pytest.approx(2 * 2 * 40 * 2 * 64 * 4 / 1e6)  # ms is 1.0
    (mixed,) = kernels.bench_mixed(2, 40, 16, 8, [Recording], CPU, heads=heads)
    assert mixed["rel_err_mixed_vs_separate"] < 1e-4
    (casc,) = kernels_cascade.bench_cascade(3, 32, 5, [Recording], CPU, heads=heads)
    assert casc["rel_err_vs_sdpa"] < 1e-5 and casc["rel_err_plain_vs_sdpa"] < 1e-5
    assert caches and set(caches) == {(2, 64)}
    with pytest.raises(ValueError, match="whole multiple"):
        kernels.HeadShape(14, 4, 64)


def test_cli_heads_and_decode_shapes(no_timing: None, tmp_path: Path) -> None:
    from pagedcore.cli import main

    out = tmp_path / "k.json"
    res = CliRunner().invoke(main, [
        "bench", "kernels", "--backend", "reference", "--quick", "--case", "decode",
        "--heads", "14/2", "--head-size", "64", "--decode-shapes", "3x40,2x17",
        "--json", str(out)])
    assert res.exit_code == 0, res.output
    info = json.loads(out.read_text())
    cfg = info["config"]
    assert (cfg["num_heads"], cfg["num_kv_heads"], cfg["head_size"]) == (14, 2, 64)
    assert "--heads 14/2 --head-size 64" in info["command"]
    assert "--decode-shapes 3x40,2x17" in info["command"]
    ours = [r for r in info["results"] if r["impl"] == "reference"]
    assert [r["shape"] for r in ours] == ["3x40", "2x17"]
    assert all(r["rel_err_vs_sdpa"] < 1e-4 for r in ours)


@pytest.mark.parametrize(("args", "message"), [
    (["--heads", "14"], "give query heads / KV heads"),
    (["--heads", "14/4"], "whole multiple"),
    (["--heads", "0/0"], "must be > 0"),
    (["--decode-shapes", "256"], "give batch x context"),
    (["--decode-shapes", "256x0"], "give batch x context"),
])
def test_cli_rejects_bad_heads_and_shapes(args: list[str], message: str) -> None:
    from pagedcore.cli import main

    res = CliRunner().invoke(main, ["bench", "kernels", "--backend", "reference", "--quick",
                                    *args])
    assert res.exit_code == 2, res.output
    assert message in res.output and "Traceback" not in res.output

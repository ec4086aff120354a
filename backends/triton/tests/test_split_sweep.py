"""`tools/split_sweep.py` (the split-KV sweep behind the long-context decode plan): its plans
are the ones it names, its check rejects NaN-poisoned reads, its rows agree with SDPA."""

from __future__ import annotations

import importlib.util
import pathlib
from typing import Any

import pytest
import torch
from pagedcore_triton import TritonAttentionBackend

from pagedcore.bench import kernel_primitives as kp

_PATH = pathlib.Path(__file__).parents[1] / "tools" / "split_sweep.py"
_spec = importlib.util.spec_from_file_location("split_sweep", _PATH)
assert _spec is not None and _spec.loader is not None
sweep = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sweep)


def _once(fn: Any, device: torch.device, **_: Any) -> float:
    fn()
    return 1.0


@pytest.mark.parametrize("heads", [(32, 8, 128), (14, 2, 64)])
def test_rows_use_the_named_plans_and_match_sdpa(monkeypatch: pytest.MonkeyPatch,
                                                 tmp_path: pathlib.Path,
                                                 heads: tuple[int, int, int]) -> None:
    """The bench's heads and Qwen2-0.5B's (``--heads 14,2,64``: GQA 7, head size 64)."""
    monkeypatch.setattr(kp, "time_ms", _once)
    monkeypatch.setattr(sweep, "HEADS", heads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    out = sweep.Sweep(str(tmp_path / "s.json"), {})
    variants = [sweep.parse_variant(v) for v in ("default", "S2@32,4,2,i32")]
    sweep.run_shape(out, 1, 40, variants, device=device, copy_gbps=None, flashinfer=False,
                    graphs=False, deadline=float("inf"))
    rows = {r["variant"]: r for r in out.rows}
    assert [rows[v]["segments"] for v in ("default", "S2@32,4,2,i32")] == [1, 2], rows
    assert all(r.get("rel_err", 1.0) < 1e-3 for r in out.rows), out.rows
    assert (tmp_path / "s.json").exists()


def test_poisoned_cache_and_check() -> None:
    kv = kp.PagedKV([20, 7], torch.float32, torch.device("cpu"))
    under = sweep.poisoned(TritonAttentionBackend, kv)
    cache = under.kv_cache
    assert torch.isnan(cache).any()  # the null block and the last blocks' tails
    ref = torch.ones(2, 4, 8)
    bad = ref.clone()
    bad[0, 0, 0] = float("nan")
    with pytest.raises(RuntimeError, match="non-finite"):
        sweep.check(bad, ref)
    with pytest.raises(RuntimeError, match="relative error"):
        sweep.check(ref * 1.1, ref)
    assert sweep.check(ref, ref) == 0.0


@pytest.mark.parametrize("bad", ["14,3,64", "14,2", "8,2,48", "a,b,c"])
def test_bad_heads_are_a_clear_error(bad: str) -> None:
    with pytest.raises(SystemExit, match="--heads"):
        sweep.parse_heads(bad)


@pytest.mark.parametrize("bad", ["S3", "balanced:x", "S8@", "foo"])
def test_bad_variant_is_a_clear_error(bad: str) -> None:
    with pytest.raises(SystemExit, match="--variant"):
        sweep.parse_variant(bad)

"""The runner's per-step cascade decision (`CascadePlanner`): from the block tables, per group."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from pagedcore.attention.cascade import CASCADE_ENV
from pagedcore.engine.runner.cascade_plan import CascadePlanner
from pagedcore.engine.scheduling.scheduler_types import DecodeBatch
from pagedcore.kv_cache.spec import FullAttentionSpec, KVCacheGroupSpec, SlidingWindowSpec
from pagedcore.reference import ReferenceBackend

FULL = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype="float32")
WINDOW = SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=64, dtype="float32",
                           sliding_window=32)


class _NoCascade(ReferenceBackend):
    supports_cascade = False


def _planner(monkeypatch: pytest.MonkeyPatch, mode: str, *groups: Any) -> CascadePlanner:
    monkeypatch.setenv(CASCADE_ENV, mode)
    specs = [KVCacheGroupSpec(layer_names=(f"model.layers.{i}.attn",), spec=spec)
             for i, (spec, _) in enumerate(groups)]
    return CascadePlanner(specs, [b for _, b in groups])


def _decodes(n: int, context: int) -> DecodeBatch:
    reqs = [SimpleNamespace(request_id=f"r{i}") for i in range(n)]
    return DecodeBatch(reqs, [context] * n)  # type: ignore[arg-type]


def test_shared_blocks_per_group_and_who_may_cascade(monkeypatch: pytest.MonkeyPatch) -> None:
    planner = _planner(monkeypatch, "always", (FULL, ReferenceBackend),
                       (WINDOW, ReferenceBackend), (FULL, _NoCascade))
    shared_ids = list(range(1, 70))

    def block_ids(rid: str) -> tuple[list[int], ...]:
        own = 100 + int(rid[1:])
        table = [*shared_ids[:65], own]
        return (table, table, table)

    shared, use = planner.plan(_decodes(4, 1050), block_ids)
    # 65 shared blocks, capped by the context 1050 -> 65 full blocks (1040 tokens); the
    # sliding-window group and the backend without cascade get 0.
    assert shared == (1040, 0, 0) and use == (1040, 0, 0)
    assert planner.plan(_decodes(1, 1050), block_ids) == ((0, 0, 0), (0, 0, 0))


def test_auto_follows_the_rule_and_off_never_cascades(monkeypatch: pytest.MonkeyPatch) -> None:
    def block_ids(rid: str) -> tuple[list[int], ...]:
        return ([*range(1, 300), 1000 + int(rid[1:])],)

    auto = _planner(monkeypatch, "auto", (FULL, ReferenceBackend))
    assert auto.plan(_decodes(64, 4352), block_ids) == ((4352,), (4352,))
    # 2 requests x 1024 shared: 1024 saved reads per layer, below the rule's threshold.
    assert auto.plan(_decodes(2, 1024), block_ids) == ((0,), (0,))
    forced = _planner(monkeypatch, "always", (FULL, ReferenceBackend))
    assert forced.plan(_decodes(2, 1024), block_ids) == ((1024,), (1024,))
    off = _planner(monkeypatch, "off", (FULL, ReferenceBackend))
    assert off.plan(_decodes(64, 4352), block_ids) == ((0,), (0,))

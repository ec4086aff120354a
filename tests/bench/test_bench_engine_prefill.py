"""`pagedcore bench engine`'s prefill-heavy stage (long prompts, one new token each)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

import pagedcore.bench.engine as engine_bench
from pagedcore.bench.engine_runs import run_prefill


class _FakeLLM:
    """Counts what `run_prefill` asks of an engine: prompts, their token budget, steps."""

    def __init__(self, **kw: Any) -> None:
        self.kw = kw
        self.device = torch.device("cpu")
        self.num_steps = 0
        self.calls: list[tuple[int, int]] = []

    def generate(self, prompts: list[list[int]], params: Any) -> list[Any]:
        self.calls.append((len(prompts), params.max_tokens))
        self.num_steps += sum(-(-len(p) // 64) for p in prompts)
        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[p[0] + 1])]) for p in prompts]


def test_run_prefill_counts_prompt_tokens_after_a_warmup() -> None:
    llm = _FakeLLM()
    fig = run_prefill(llm, [[11] * 300, [12] * 100], warmup=[[13] * 300])
    assert llm.calls == [(1, 1), (2, 1)]  # the warm-up first, one new token each
    assert fig["prompt_tokens"] == 400 and fig["prompts"] == 2 and fig["steps"] == 7
    assert fig["prompt_tok_s"] == pytest.approx(400 / fig["seconds"])
    assert fig["first_tokens"] == [[12], [13]]  # the timed prompts' own tokens


def test_prefill_stage_runs_its_own_eager_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[_FakeLLM] = []

    def fake_llm(model: Any, **kw: Any) -> _FakeLLM:
        made.append(_FakeLLM(**kw))
        return made[-1]

    monkeypatch.setattr(engine_bench, "_llm", fake_llm)
    added: dict[str, Any] = {}

    class Report:
        def add(self, key: str, value: Any, row: Any = None) -> None:
            added[key] = value

    engine_bench._prefill_stage(Report(), torch.nn.Linear(1, 1),  # type: ignore[arg-type]
                                {"max_model_len": 608, "backend": "triton"}, small=False,
                                vocab=1000)
    n, length = engine_bench.PREFILL_WORKLOAD
    (llm,) = made
    assert llm.kw["enforce_eager"] and llm.kw["max_model_len"] == length + 64
    assert llm.kw["backend"] == "triton"
    assert added["prefill_heavy"]["prompt_tokens"] == n * length
    assert "prefill" in engine_bench.STAGES

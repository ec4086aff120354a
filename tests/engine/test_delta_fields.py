"""`LLM.step(deltas=...)`: the raw delta tuples a server's engine loop takes instead of output
objects carry exactly what the `RequestOutput`s would (tokens, text, finish and stop reasons,
counts), and the requests the fast path does not cover still come back as outputs."""

from __future__ import annotations

from typing import Any

import pytest
from engine_helpers import assert_no_leak

from pagedcore import LLM, SamplingParams
from pagedcore.engine.output_builder import DELTA_FIELDS


def _requests(stop: str) -> list[tuple[str, str, SamplingParams]]:
    return [
        ("plain", "Hello there", SamplingParams(max_tokens=9, temperature=0, ignore_eos=True)),
        ("stop", "Hello there", SamplingParams(max_tokens=30, temperature=0, ignore_eos=True,
                                               stop=[stop])),
        ("eos", "Once upon", SamplingParams(max_tokens=20, temperature=0)),
        ("sampled", "Hi", SamplingParams(max_tokens=7, temperature=1.0, seed=3,
                                         ignore_eos=True)),
        ("logprobs", "Hi", SamplingParams(max_tokens=5, temperature=0, logprobs=2,
                                          ignore_eos=True)),
        ("n2", "Hey", SamplingParams(max_tokens=6, temperature=1.0, seed=5, n=2,
                                     ignore_eos=True)),
    ]


def _as_fields(out: Any) -> tuple[Any, ...]:
    c = out.outputs[0]
    return (out.request_id, c.text, list(c.token_ids), c.finish_reason, c.stop_reason,
            len(out.prompt_token_ids), out.num_cached_tokens)


def _run(llm: LLM, stop: str, *, raw: bool) -> tuple[list[Any], set[str]]:
    for rid, prompt, params in _requests(stop):
        llm.add_request(rid, prompt, params, delta=True)
    steps: list[Any] = []
    via_outputs: set[str] = set()
    while llm.has_unfinished_requests():
        sink: list[tuple[Any, ...]] | None = [] if raw else None
        outs = llm.step(deltas=sink)
        step = {o.request_id: _as_fields(o) if len(o.outputs) == 1 else o for o in outs}
        via_outputs.update(step)
        for d in sink or []:
            fields = dict(zip(DELTA_FIELDS, d, strict=True))
            assert fields["logprobs"] is None and fields["prompt_logprobs"] is None
            step[d[0]] = (d[0], d[1], list(d[2]), d[4], d[5], d[6], d[7])
        steps.append({k: v for k, v in step.items() if k not in ("logprobs", "n2")})
    return steps, via_outputs


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_raw_deltas_equal_the_outputs(overlap: bool) -> None:
    # Overlap scheduling (the GPU default) collects its outputs one call later, elsewhere.
    llm = LLM("demo", device="cpu", max_model_len=128, kv_cache_memory_bytes=4 << 20,
              backend="reference", seed=0, async_scheduling=overlap)
    assert llm.async_scheduling is overlap
    text = llm.generate(["Hello there"], SamplingParams(max_tokens=30, temperature=0,
                                                        ignore_eos=True))[0].outputs[0].text
    stop = text[5:8]  # a stop string the greedy text reaches mid-stream
    assert len(stop) == 3
    expected, _ = _run(llm, stop, raw=False)
    got, via_outputs = _run(llm, stop, raw=True)
    assert got == expected
    # Only what the fast path does not cover came back as objects.
    assert via_outputs == {"logprobs", "n2"}
    stopped = [s["stop"] for s in expected if "stop" in s][-1]
    assert stopped[3:5] == ("stop", stop)
    assert_no_leak(llm)

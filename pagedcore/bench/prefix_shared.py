"""The "shared-prefix decode" workload of `pagedcore bench prefix`: cascade on vs off.

``num_reqs`` requests share one system prompt of ``shared`` tokens (served from the prefix
cache after a priming request) plus ``own`` tokens each, and decode together. Decode
throughput is the extra tokens of a ``1 + max_tokens`` run over a prefill-only run
(``max_tokens=1``) of the same requests, divided by the extra time, so prefill is not counted.
Run once with cascade off and once with it forced on (`CascadePlanner.set_mode`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

__all__ = ["measure_shared_decode"]

#: The timer of the timed runs (a module attribute: tests replace it).
_clock = time.perf_counter


def _tokens(n: int, *, vocab: int, seed: int) -> list[int]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab, (n,), generator=g).tolist()


def measure_shared_decode(
    llm: Any, *, num_reqs: int, shared: int, own: int, max_tokens: int, vocab: int,
    sync: Callable[[], None] | None = None, auto: bool = False,
) -> dict[str, Any]:
    """Decode tokens/s of the shared-prefix batch, cascade off and on (``always``), and the
    speedup; with `auto` also the default mode's (``cascade_auto``), which with CUDA graphs
    weighs the lost replay (`pagedcore.attention.cascade.cascade_beats_graph`)."""
    from pagedcore.engine.sampling.sampling_params import SamplingParams

    system = _tokens(shared, vocab=vocab, seed=501)
    planner = llm.runner.cascade
    before = planner.mode

    def replays() -> int | None:  # cascade-graph replays so far (None: no cascade graphs)
        graphs = getattr(llm.runner, "cascade_graphs", None)
        return None if graphs is None else int(graphs.num_replays)

    rows: dict[str, Any] = {}
    try:
        for mode in ("off", "always", *(("auto",) if auto else ())):
            planner.set_mode(mode)
            # One untimed run of the same shape first: a mode's first cascade step compiles
            # its kernels, which must not land in one of the two timed runs.
            warm = [system + _tokens(own, vocab=vocab, seed=90_000 + i + 7 * len(rows))
                    for i in range(num_reqs)]
            llm.generate(warm, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
            times = []
            replays_before = replays()
            for rep, n_out in enumerate((1, 1 + max_tokens)):
                prompts = [system + _tokens(own, vocab=vocab, seed=1000 * rep + i + 7 * len(rows))
                           for i in range(num_reqs)]
                llm.generate([system + prompts[0][shared:shared + 1]],
                             SamplingParams(max_tokens=1, temperature=0.0))  # cache the prompt
                params = SamplingParams(max_tokens=n_out, temperature=0.0, ignore_eos=True)
                if sync:
                    sync()
                start = _clock()
                outs = llm.generate(prompts, params)
                if sync:
                    sync()
                times.append(_clock() - start)
                cached = [o.num_cached_tokens for o in outs]
            decode_s = times[1] - times[0]
            rows[mode] = {"decode_tokens_per_s": num_reqs * max_tokens / decode_s
                          if decode_s > 0 else None,
                          "prefill_only_s": times[0], "with_decode_s": times[1],
                          "num_cached_tokens_min": min(cached),
                          # Decode steps that replayed a cascade graph in the two timed runs.
                          "cascade_graph_replays": None if replays_before is None
                          else (replays() or 0) - replays_before}
            if decode_s <= 0:  # (noise or a stall in the shorter run: no figure, say why)
                rows[mode]["error"] = ("the run with decode steps took no longer than the "
                                       "prefill-only one: no decode time to report")
    finally:
        planner.set_mode(before)
    extra = {"cascade_auto": rows["auto"]} if auto else {}
    return {
        **extra,
        "workload": f"{num_reqs} requests x ({shared} shared + {own} own tokens), "
                    f"{max_tokens} decode steps",
        "num_reqs": num_reqs, "shared": shared, "own": own, "max_tokens": max_tokens,
        "cascade_off": rows["off"], "cascade_on": rows["always"],
        "speedup": _ratio(rows["always"]["decode_tokens_per_s"],
                          rows["off"]["decode_tokens_per_s"]),
        **({"speedup_auto": _ratio(rows["auto"]["decode_tokens_per_s"],
                                   rows["off"]["decode_tokens_per_s"])} if auto else {}),
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a / b

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
    rows: dict[str, Any] = {}
    try:
        for mode in ("off", "always", *(("auto",) if auto else ())):
            planner.set_mode(mode)
            times = []
            for rep, n_out in enumerate((1, 1 + max_tokens)):
                prompts = [system + _tokens(own, vocab=vocab, seed=1000 * rep + i + 7 * len(rows))
                           for i in range(num_reqs)]
                llm.generate([system + prompts[0][shared:shared + 1]],
                             SamplingParams(max_tokens=1, temperature=0.0))  # cache the prompt
                params = SamplingParams(max_tokens=n_out, temperature=0.0, ignore_eos=True)
                if sync:
                    sync()
                start = time.perf_counter()
                outs = llm.generate(prompts, params)
                if sync:
                    sync()
                times.append(time.perf_counter() - start)
                cached = [o.num_cached_tokens for o in outs]
            decode_s = max(times[1] - times[0], 1e-9)
            rows[mode] = {"decode_tokens_per_s": num_reqs * max_tokens / decode_s,
                          "prefill_only_s": times[0], "with_decode_s": times[1],
                          "num_cached_tokens_min": min(cached)}
    finally:
        planner.set_mode(before)
    extra = {"cascade_auto": rows["auto"]} if auto else {}
    return {
        **extra,
        "workload": f"{num_reqs} requests x ({shared} shared + {own} own tokens), "
                    f"{max_tokens} decode steps",
        "num_reqs": num_reqs, "shared": shared, "own": own, "max_tokens": max_tokens,
        "cascade_off": rows["off"], "cascade_on": rows["always"],
        "speedup": rows["always"]["decode_tokens_per_s"] / rows["off"]["decode_tokens_per_s"],
    }

"""The "shared-prefix decode" workload of `pagedcore bench prefix`: cascade on vs off.

``num_reqs`` requests share one system prompt of ``shared`` tokens (served from the prefix
cache after a priming request) plus ``own`` tokens each, and decode together. Decode
throughput is the extra tokens of a ``1 + max_tokens`` run over a prefill-only run
(``max_tokens=1``) of the same requests, divided by the extra time, so prefill is not counted.
Run with cascade off, forced on and (optionally) auto (`CascadePlanner.set_mode`); with
``reps`` the median decode time of that many pairs of runs.
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
    sync: Callable[[], None] | None = None, auto: bool = False, reps: int = 1,
) -> dict[str, Any]:
    """Decode tokens/s of the shared-prefix batch, cascade off and on (``always``), and the
    speedup; with `auto` also the default mode's (``cascade_auto``: with CUDA graphs a
    decode step replays its bucket's cascade graph when the backend declares
    ``supports_cascade_cudagraph``, else it weighs the lost replay,
    `pagedcore.attention.cascade.cascade_beats_graph`). With `reps` > 1 the decode time is
    the median over that many (prefill-only, with-decode) pairs of runs, each on its own
    prompts."""
    import numpy as np

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
            replays_before = replays()
            pairs = []  # (prefill-only s, with-decode s) per repetition
            for rep in range(reps):
                times = []
                for n_out in (1, 1 + max_tokens):
                    seed = 1000 * (2 * rep + (n_out > 1)) + 7 * len(rows)
                    prompts = [system + _tokens(own, vocab=vocab, seed=seed + i)
                               for i in range(num_reqs)]
                    llm.generate([system + prompts[0][shared:shared + 1]],
                                 SamplingParams(max_tokens=1, temperature=0.0))  # the prompt
                    params = SamplingParams(max_tokens=n_out, temperature=0.0,
                                            ignore_eos=True)
                    if sync:
                        sync()
                    start = _clock()
                    outs = llm.generate(prompts, params)
                    if sync:
                        sync()
                    times.append(_clock() - start)
                    cached = [o.num_cached_tokens for o in outs]
                    short = [len(o.outputs[0].token_ids) for o in outs
                             if len(o.outputs[0].token_ids) != n_out]
                    if short:
                        raise ValueError(
                            f"shared-prefix decode: {len(short)} of {num_reqs} requests "
                            f"generated {min(short)} tokens, not {n_out} (max_model_len "
                            f"{llm.max_model_len} < {shared + own + n_out} tokens a "
                            "request needs?): the decode rate would count tokens that were "
                            "never generated; give the engine room for them")
                pairs.append((times[0], times[1]))
            decodes = [b - a for a, b in pairs]
            decode_s = float(np.median(decodes))
            rows[mode] = {"decode_tokens_per_s": num_reqs * max_tokens / decode_s
                          if decode_s > 0 else None,
                          "prefill_only_s": float(np.median([a for a, _ in pairs])),
                          "with_decode_s": float(np.median([b for _, b in pairs])),
                          "decode_s": decodes,
                          "num_cached_tokens_min": min(cached),
                          # Decode steps that replayed a cascade graph in the timed runs.
                          "cascade_graph_replays": None if replays_before is None
                          else (replays() or 0) - replays_before}
            if decode_s <= 0:  # (noise or a stall in the shorter run: no figure, say why)
                rows[mode]["error"] = ("the runs with decode steps took no longer than the "
                                       "prefill-only ones: no decode time to report")
    finally:
        planner.set_mode(before)
    extra = {"cascade_auto": rows["auto"]} if auto else {}
    return {
        **extra,
        "workload": f"{num_reqs} requests x ({shared} shared + {own} own tokens), "
                    f"{max_tokens} decode steps",
        "reps": reps,
        "num_reqs": num_reqs, "shared": shared, "own": own, "max_tokens": max_tokens,
        "cascade_off": rows["off"], "cascade_on": rows["always"],
        "speedup": _ratio(rows["always"]["decode_tokens_per_s"],
                          rows["off"]["decode_tokens_per_s"]),
        **({"speedup_auto": _ratio(rows["auto"]["decode_tokens_per_s"],
                                   rows["off"]["decode_tokens_per_s"])} if auto else {}),
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a / b

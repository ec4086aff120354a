"""Mixed steps over a shared prefix on a GPU (issue #26): the mixed cascade graph
(`pagedcore.engine.runner.cascade_mixed_graphs`) against the plain mixed graph (cascade off)
and against the previous rule (no mixed cascade graphs: a shared-prefix mixed step replays
the plain mixed graph unless an eager cascade outweighs it).

Two steps, each timed alone (device synced around `LLM.step`), median of `--reps`:

* ``join``: `--decoding` requests decode over a `--prefix`-token shared prefix while
  `--joining` new requests over the same prefix (+ `--own` tokens each) arrive: one mixed
  step of ``decoding + joining * own`` tokens;
* ``prefill``: `--joining` * 4 requests over the prefix arrive at once (one prompt-only step).

Also checks that every mode generates the same tokens (greedy) in its last join run, and
where one differs says how close a call it was (`first_differences`: the position, the top-2
logprob gap there in the ``off`` run, and how far the two runs' logprobs of that token lie).

    python3 gpu/cascade_mixed.py --json out.json [--model-shape llama3-8b]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

import torch

from pagedcore import LLM, SamplingParams
from pagedcore.bench.report import engine_bench_model, environment

MODES = ("off", "auto", "auto_no_mixed_graphs")


def _tokens(n: int, seed: int, vocab: int = 500) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed_step(llm: LLM) -> tuple[float, float, list[Any]]:
    """One step: its wall seconds (host work included) and the device seconds of its
    forward (`ModelRunner.execute`, CUDA events; the wall time on the CPU)."""
    runner: Any = llm.runner
    execute = runner.execute
    device_s: list[float] = []

    def timed(inputs: Any) -> Any:
        if not torch.cuda.is_available():
            t = time.perf_counter()
            out = execute(inputs)
            device_s.append(time.perf_counter() - t)
            return out
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record()
        out = execute(inputs)
        end.record()
        end.synchronize()
        device_s.append(start.elapsed_time(end) / 1e3)
        return out

    runner.execute = timed
    try:
        _sync()
        t0 = time.perf_counter()
        outs = llm.step()
        _sync()
    finally:
        del runner.execute
    return time.perf_counter() - t0, sum(device_s), list(outs)


def _drain(llm: LLM) -> list[Any]:
    outs: list[Any] = []
    while llm.has_unfinished_requests():
        outs += llm.step()
    return outs


def run_mode(llm: LLM, mode: str, args: argparse.Namespace, shared: list[int]) -> dict[str, Any]:
    runner: Any = llm.runner
    saved = runner.cascade_mixed_graphs
    runner.cascade.set_mode("off" if mode == "off" else "auto")
    if mode == "auto_no_mixed_graphs":
        runner.cascade_mixed_graphs = None
    # Every mode sees the same prompts, and only the shared prefix cached (no hits on an
    # earlier mode's prompts).
    kv: Any = llm.scheduler.kv
    if not kv.reset_prefix_cache():
        raise RuntimeError("the prefix cache could not be reset (blocks in use)")
    llm.generate([shared + _tokens(args.own, 2)], SamplingParams(max_tokens=1))
    paths0 = dict(runner.step_paths)
    decode = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    one = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, logprobs=2)
    join_ms, prefill_ms, join_dev, prefill_dev, tokens = [], [], [], [], []
    try:
        for rep in range(args.reps + 1):  # the first rep warms up (captures, compiles)
            base = 10_000 * (rep + 1)
            for i in range(args.decoding):
                llm.add_request(f"{mode}-d{rep}-{i}", shared + _tokens(args.own, base + i),
                                decode)
            while any(r.num_computed_tokens < r.num_prompt_tokens
                      for r in llm.scheduler.running) or llm.scheduler.waiting:
                llm.step()
            for i in range(args.joining):
                llm.add_request(f"{mode}-j{rep}-{i}", shared + _tokens(args.own, base + 500 + i),
                                one)
            seconds, dev_s, _ = _timed_step(llm)
            outs = _drain(llm)
            if rep:
                join_ms.append(seconds * 1e3)
                join_dev.append(dev_s * 1e3)
            tokens = sorted((o.request_id.split("-", 2)[2], list(o.outputs[0].token_ids),
                             [{int(t): float(lp) for t, lp in step.items()}
                              for step in o.outputs[0].logprobs or []])
                            for o in outs if o.finished)
            for i in range(4 * args.joining):
                llm.add_request(f"{mode}-p{rep}-{i}", shared + _tokens(args.own, base + 900 + i),
                                one)
            seconds, dev_s, _ = _timed_step(llm)
            _drain(llm)
            if rep:
                prefill_ms.append(seconds * 1e3)
                prefill_dev.append(dev_s * 1e3)
    finally:
        runner.cascade_mixed_graphs = saved
    paths = {k: v - paths0.get(k, 0) for k, v in runner.step_paths.items()
             if v - paths0.get(k, 0)}
    return {"join_step_ms_median": statistics.median(join_ms), "join_step_ms": join_ms,
            "prefill_step_ms_median": statistics.median(prefill_ms),
            "prefill_step_ms": prefill_ms,
            "join_forward_ms_median": statistics.median(join_dev), "join_forward_ms": join_dev,
            "prefill_forward_ms_median": statistics.median(prefill_dev),
            "prefill_forward_ms": prefill_dev, "step_paths": paths, "join_tokens": tokens}


def first_differences(off: list[Any], other: list[Any]) -> list[dict[str, Any]]:
    """Per join request whose greedy tokens differ from the ``off`` run's: the first position
    that differs, the top-2 logprob gap there in the ``off`` run (a near-tie flips on a
    rounding difference), and the two runs' logprobs of the ``off`` run's token there.

    >>> a = [("j1-0", [5, 6], [{5: -0.1, 7: -0.2}, {6: -0.5, 8: -2.0}])]
    >>> b = [("j1-0", [7, 6], [{7: -0.1, 5: -0.15}, {6: -0.5, 8: -2.0}])]
    >>> row = first_differences(a, b)[0]
    >>> (row["position"], row["off_token"], row["token"], round(row["off_top2_gap"], 3))
    (0, 5, 7, 0.1)
    """
    rows: list[dict[str, Any]] = []
    for (rid, toks_a, lps_a), (_, toks_b, lps_b) in zip(off, other, strict=True):
        for pos, (ta, tb) in enumerate(zip(toks_a, toks_b, strict=False)):
            if ta == tb:
                continue
            la = lps_a[pos] if pos < len(lps_a) else {}
            lb = lps_b[pos] if pos < len(lps_b) else {}
            top = sorted(la.values(), reverse=True)
            rows.append({"request": rid, "position": pos, "off_token": ta, "token": tb,
                         "off_top2_gap": top[0] - top[1] if len(top) > 1 else None,
                         "off_token_logprob": la.get(ta), "its_logprob_here": lb.get(ta)})
            break
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", required=True)
    ap.add_argument("--model-shape", default="llama3-8b")
    ap.add_argument("--prefix", type=int, default=4096)
    ap.add_argument("--own", type=int, default=64)
    ap.add_argument("--decoding", type=int, default=56)
    ap.add_argument("--joining", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny model (no graphs)")
    args = ap.parse_args()
    shape = "qwen2-0.5b" if args.smoke else args.model_shape
    dev, dtype, config = engine_bench_model(args.smoke, "cpu" if args.smoke else "cuda", shape)
    max_len = args.prefix + args.own + 128
    config.max_position_embeddings = max(int(config.max_position_embeddings), max_len)
    t0 = time.perf_counter()
    llm = LLM(config, device=dev, dtype=dtype, max_model_len=max_len, max_num_seqs=64,
              max_num_batched_tokens=2048)
    setup_s = time.perf_counter() - t0
    llm.set_async_scheduling(False)  # each timed step is the step itself
    shared = _tokens(args.prefix, 1)
    report: dict[str, Any] = {
        "command": "python3 gpu/cascade_mixed.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "json"),
        "commit": os.environ.get("PAGEDCORE_GIT_COMMIT"), "environment": environment(dev),
        "setup_s": setup_s, "args": vars(args), "modes": {},
    }
    for mode in MODES:
        report["modes"][mode] = run_mode(llm, mode, args, shared)
        row = report["modes"][mode]
        print(f"{mode}: join {row['join_step_ms_median']:.3f} ms (forward "
              f"{row['join_forward_ms_median']:.3f}), prefill {row['prefill_step_ms_median']:.3f}"
              f" ms (forward {row['prefill_forward_ms_median']:.3f}), paths {row['step_paths']}",
              flush=True)
    toks = {m: r.pop("join_tokens") for m, r in report["modes"].items()}
    report["same_tokens_as_off"] = {
        m: [t[:2] for t in toks[m]] == [t[:2] for t in toks["off"]] for m in MODES}
    report["first_differences"] = {m: first_differences(toks["off"], toks[m]) for m in MODES}
    print("same tokens as off:", report["same_tokens_as_off"])
    for mode, rows in report["first_differences"].items():
        for row in rows:
            print(f"  {mode}: {row}")
    with open(args.json, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()

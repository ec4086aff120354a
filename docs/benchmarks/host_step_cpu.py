"""The engine's host time per decode step at batch 256 (issue #22), on the CPU: each phase of
`LLM.step` per step, medians over many steps.

A tiny random Qwen2 (hidden 64, 2 layers, vocab 1,000, ``initializer_range`` 0.1) serves
`--batch` greedy requests of `--context`-token prompts; once all decode, `--steps` steps are
timed one by one from the engine's own phase clocks (``LLM.phase_time``): schedule, prepare,
launch (the execute phase less the model's forward: the sampler's call, on the CPU its argmax
too, and the placeholders), update (less the wait for the step in flight) and their sum,
``host``. Decode steps take the GPU's
path: decode "graphs" are emulated on the CPU (`EagerCapturer`), so inputs are padded to the
bucket as for a CUDA-graph replay, and overlap scheduling is on unless ``--overlap off``.
``--outputs`` picks how each step returns its outputs: ``all`` (every running request's
`RequestOutput`), ``deltas`` (the OpenAI server's loop: ``step(deltas=[])``) and
``finished`` (``LLM.generate``'s loop). ``--tokenizer`` adds text (a byte-level BPE trained
on the spot, as the tests do; the model's vocabulary is then its size).

The model's forward on the CPU is not host work and is left out. On a shared machine other
processes inflate wall-clock phases: ``--cpu-clock`` times them in this thread's CPU time
instead, and ``--trees A,B --rounds N`` compares source trees (each a checkout's root) by
running this script under each in turn, N times, pooling the per-step samples:

    python docs/benchmarks/host_step_cpu.py [--outputs all,deltas] [--json OUT.json]
    python docs/benchmarks/host_step_cpu.py --trees /tmp/before,. --rounds 3 --cpu-clock \\
        --json docs/benchmarks/host_step_cpu.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from tree_ab import commit_of, interleave, medians  # (beside this script)

PHASES = ("schedule", "prepare", "launch", "update", "host")


def measure(args: argparse.Namespace) -> dict[str, dict[str, list[float]]]:
    """Per-step microseconds of each phase, per ``overlap=..., outputs=...`` row."""
    if args.cpu_clock:  # before the engine binds it: its phase clocks become CPU time
        time.perf_counter = time.thread_time
    import torch

    from pagedcore import LLM, SamplingParams
    from pagedcore.engine.models.loading import random_model, tiny_config
    from pagedcore.engine.runner.cuda_graph import EagerCapturer

    torch.set_num_threads(1)
    tokenizer, vocab = None, 1000
    if args.tokenizer:
        sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "helpers"))
        from tokenizer_helpers import train_tokenizer

        tokenizer = train_tokenizer()
        vocab = len(tokenizer)
    config = tiny_config("qwen2", vocab_size=vocab, max_position_embeddings=4096)
    model = random_model(config, dtype=torch.float32, device=torch.device("cpu"), seed=0)
    llm = LLM(model, device="cpu", max_model_len=args.context + 2048,
              max_num_seqs=args.batch, max_num_batched_tokens=max(2048, args.batch),
              kv_cache_memory_bytes=256 << 20, tokenizer=tokenizer)
    llm.runner.enable_cudagraphs(capturer=EagerCapturer(), sizes=[args.batch])
    forward = {"s": 0.0}
    execute = llm.runner.execute

    def timed_execute(*a: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return execute(*a, **kw)
        finally:
            forward["s"] += time.perf_counter() - t0

    llm.runner.execute = timed_execute  # type: ignore[method-assign]
    rows: dict[str, dict[str, list[float]]] = {}
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=2000, temperature=0.0, ignore_eos=True)
    for overlap in args.overlap.split(","):
        for kind in args.outputs.split(","):
            llm.set_async_scheduling(overlap == "on")
            ids = [f"{overlap}-{kind}-{i}" for i in range(args.batch)]
            for rid in ids:
                prompt = torch.randint(3, vocab, (args.context,), generator=gen).tolist()
                llm.add_request(rid, prompt, params, delta=kind == "deltas")
            while llm.scheduler.waiting or any(
                    r.num_computed_tokens < r.num_prompt_tokens for r in llm.scheduler.running):
                llm.step()
            samples: dict[str, list[float]] = {p: [] for p in PHASES}
            for k in range(args.warmup + args.steps):
                before, fwd = dict(llm.phase_time), forward["s"]
                llm.step(finished_only=kind == "finished",
                         deltas=[] if kind == "deltas" else None)
                if k < args.warmup:
                    continue
                d = {p: v - before.get(p, 0.0) for p, v in llm.phase_time.items()}
                step = {"schedule": d["schedule"], "prepare": d["prepare"],
                        "launch": d["execute"] - (forward["s"] - fwd),
                        "update": d["update"] - d.get("wait", 0.0)}
                step["host"] = sum(step.values())
                for p in PHASES:
                    samples[p].append(step[p] * 1e6)
            rows[f"overlap={overlap} outputs={kind}"] = samples
            for rid in ids:
                llm.abort(rid)
            llm.set_async_scheduling(False)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--outputs", default="all,deltas,finished")
    ap.add_argument("--overlap", default="on", help="on, off or on,off")
    ap.add_argument("--tokenizer", action="store_true")
    ap.add_argument("--cpu-clock", action="store_true")
    ap.add_argument("--trees", help="comma list of source trees to compare")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--samples", help=argparse.SUPPRESS)  # (a --trees child's output)
    ap.add_argument("--json")
    args = ap.parse_args()
    if not args.trees:
        rows = measure(args)
        if args.samples:
            Path(args.samples).write_text(json.dumps(rows))
            return
        result: dict[str, Any] = {k: medians(v) for k, v in rows.items()}
    else:
        trees = [str(Path(t).resolve()) for t in args.trees.split(",")]
        pooled: dict[str, dict[str, dict[str, list[float]]]] = {t: {} for t in trees}
        child = ["--batch", str(args.batch), "--context", str(args.context),
                 "--steps", str(args.steps), "--warmup", str(args.warmup),
                 "--outputs", args.outputs, "--overlap", args.overlap]
        child += ["--tokenizer"] * args.tokenizer + ["--cpu-clock"] * args.cpu_clock
        for t, run in interleave(__file__, child, trees, args.rounds):
            for key, phases in run.items():
                for p, v in phases.items():
                    pooled[t].setdefault(key, {}).setdefault(p, []).extend(v)
        result = {"trees": {f"{t} ({commit_of(t)})": {k: medians(v) for k, v in rows.items()}
                            for t, rows in pooled.items()}}
    result["settings"] = {k: getattr(args, k) for k in (
        "batch", "context", "steps", "outputs", "overlap", "tokenizer", "cpu_clock", "rounds")}
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()

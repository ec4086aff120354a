"""Host time of a warm 4K prefix hit's first token (issue #22), on the CPU: medians per phase.

A tiny random Qwen2 (hidden 64, 2 layers, vocab 1,000) with prefix caching on (block 16,
``max_model_len`` 4,352) first computes a `--prefix`-token prompt (plus `--user` own tokens); then
`--reps` requests, each alone on the engine, share those `--prefix` tokens and add `--user`
new random ones (``max_tokens=1``, greedy). Every request's hit is checked to be exactly the
prefix (``RequestOutput.num_cached_tokens``); its blocks are freed when it finishes, so each
repetition is the same warm hit. The step runs eagerly (the CPU's reference backend captures
no mixed-step graph, so ``prepare`` takes the unpadded path, and its attention metadata is the
reference backend's: that phase is not the GPU's). Overlap scheduling is off (on a GPU the
warm hit's first token is the same with it on or off).

Per request, in microseconds (medians over the repetitions):

``add``
    `LLM.add_request` (prompt check and copy, `Request`);
``schedule``
    `Scheduler.schedule` (block hashes of the prompt, the prefix lookup, allocation);
``prepare``
    `ModelRunner.prepare` (host buffers, block-table rows, the uploads);
``sample``
    `Sampler.sample`;
``update``
    `Scheduler.update_from_output`;
``other``
    the rest of `LLM.step` (its `RequestOutput`, bookkeeping);
``host``
    their sum. ``execute`` (the model's forward, on the CPU real compute, on a GPU a graph
    replay) is reported apart and not counted as host time.

Then the pieces of ``schedule`` alone, on a fresh request each time (no engine step):
``hash`` (`BlockHasher.hashes` of the whole prompt), ``lookup`` (`get_computed_blocks` with
the hashes already computed) and ``computed_blocks`` (`get_computed_blocks` from scratch).

On a shared machine other processes inflate wall-clock times: ``--cpu-clock`` reads this
thread's CPU time instead. ``--trees A,B --rounds N`` compares source trees (each a checkout's
root) by running this script under each in turn, N times, pooling the samples.
``--profile OUT`` writes a cProfile of the repetitions (``--profile-sort``: its order).

    python docs/benchmarks/prefix_hit_cpu.py [--reps 200] [--cpu-clock] [--json OUT.json]
    python docs/benchmarks/prefix_hit_cpu.py --trees /tmp/before,. --rounds 3 --cpu-clock \\
        --json docs/benchmarks/prefix_hit_cpu.json
"""

from __future__ import annotations

import argparse
import json
import time
from array import array
from pathlib import Path
from typing import Any

from tree_ab import commit_of, interleave, medians  # (beside this script)

PHASES = ("add", "schedule", "prepare", "sample", "update", "other", "host", "execute")
PIECES = ("hash", "lookup", "computed_blocks")


def measure(args: argparse.Namespace) -> dict[str, list[float]]:
    """Microsecond samples per phase and per piece."""
    if args.cpu_clock:  # before the engine binds it: its clocks become CPU time
        time.perf_counter = time.thread_time
    import torch

    from pagedcore import LLM, SamplingParams
    from pagedcore.bench.prefix_phases import timed_phases
    from pagedcore.engine.models.loading import random_model, tiny_config
    from pagedcore.engine.scheduling.request import Request

    torch.set_num_threads(1)
    vocab, block, max_len = 1000, 16, 4352
    config = tiny_config("qwen2", vocab_size=vocab, max_position_embeddings=max_len)
    model = random_model(config, dtype=torch.float32, device=torch.device("cpu"), seed=0)
    llm = LLM(model, device="cpu", max_model_len=max_len, max_num_seqs=8,
              max_num_batched_tokens=8192, block_size=block, enable_prefix_caching=True,
              kv_cache_memory_bytes=64 << 20)
    llm.set_async_scheduling(False)
    gen = torch.Generator().manual_seed(0)

    def tokens(n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=gen).tolist()

    shared = tokens(args.prefix)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    expected = args.prefix // block * block

    def run(rid: str, prompt: list[int], sink: dict[str, float]) -> int | None:
        cached = None
        with timed_phases(llm, None, sink):
            t0 = time.perf_counter()
            llm.add_request(rid, prompt, params)
            t1 = time.perf_counter()
            sink["add"] = t1 - t0
            while llm.has_unfinished_requests():
                for out in llm.step():
                    if out.finished:
                        cached = out.num_cached_tokens
            sink["step"] = time.perf_counter() - t1
        return cached

    run("prime", shared + tokens(args.user), {})
    for k in range(args.warmup):
        run(f"warm{k}", shared + tokens(args.user), {})
    prompts = [shared + tokens(args.user) for _ in range(args.reps)]
    samples: dict[str, list[float]] = {p: [] for p in PHASES + PIECES}
    prof = None
    if args.profile:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    for k, prompt in enumerate(prompts):
        sink: dict[str, float] = {}
        cached = run(f"hit{k}", prompt, sink)
        if cached != expected:
            raise AssertionError(f"request {k} hit {cached} tokens, expected {expected}")
        inner = sum(sink.get(p, 0.0) for p in ("schedule", "prepare", "execute", "sample",
                                               "update"))
        sink["other"] = sink.pop("step") - inner
        sink["host"] = sum(sink.get(p, 0.0) for p in PHASES[:6])
        for p in PHASES:
            samples[p].append(sink.get(p, 0.0) * 1e6)
    if prof is not None:
        prof.disable()
        import pstats

        with open(args.profile, "w") as f:
            pstats.Stats(prof, stream=f).sort_stats(args.profile_sort).print_stats(80)

    # The pieces of `schedule`, on requests the scheduler never sees.
    kv = llm.kv_cache_manager
    (hasher,) = kv._hashers.values()
    for k in range(args.reps):
        prompt = shared + tokens(args.user)  # (own tokens never cached)
        # (Its ids packed as the engine's prompt check leaves them, where it keeps them.)
        packed = {"prompt_bytes": array("q", prompt).tobytes()} if hasattr(
            Request, "prompt_bytes") else {}
        request = Request(f"piece{k}", prompt, params, arrival_index=0, **packed)
        t0 = time.perf_counter()
        hasher.hashes(request.request_id, request)
        t1 = time.perf_counter()
        _, hit = kv.get_computed_blocks(request)
        t2 = time.perf_counter()
        kv.free(request)
        t3 = time.perf_counter()
        _, hit2 = kv.get_computed_blocks(request)
        t4 = time.perf_counter()
        kv.free(request)
        if hit != expected or hit2 != expected:
            raise AssertionError(f"piece {k} hit {hit} / {hit2} tokens, expected {expected}")
        samples["hash"].append((t1 - t0) * 1e6)
        samples["lookup"].append((t2 - t1) * 1e6)
        samples["computed_blocks"].append((t4 - t3) * 1e6)
    return samples


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefix", type=int, default=4096)
    ap.add_argument("--user", type=int, default=64)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--cpu-clock", action="store_true")
    ap.add_argument("--profile", help="write a cProfile of the repetitions here")
    ap.add_argument("--profile-sort", default="cumulative", help="pstats order (tottime, ...)")
    ap.add_argument("--trees", help="comma list of source trees to compare")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--samples", help=argparse.SUPPRESS)  # (a --trees child's output)
    ap.add_argument("--note", help="a line kept in the JSON (what the trees are)")
    ap.add_argument("--json")
    args = ap.parse_args()
    if not args.trees:
        samples = measure(args)
        if args.samples:
            Path(args.samples).write_text(json.dumps(samples))
            return
        result: dict[str, Any] = {"us": medians(samples)}
    else:
        trees = [str(Path(t).resolve()) for t in args.trees.split(",")]
        pooled: dict[str, dict[str, list[float]]] = {t: {} for t in trees}
        child = ["--prefix", str(args.prefix), "--user", str(args.user), "--reps",
                 str(args.reps), "--warmup", str(args.warmup)] + ["--cpu-clock"] * args.cpu_clock
        for t, run in interleave(__file__, child, trees, args.rounds):
            for p, v in run.items():
                pooled[t].setdefault(p, []).extend(v)
        result = {"trees": {f"{t} ({commit_of(t)})": medians(s) for t, s in pooled.items()}}
    result["settings"] = {k: getattr(args, k) for k in (
        "prefix", "user", "reps", "warmup", "cpu_clock", "rounds")}
    if args.note:
        result["note"] = args.note
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()

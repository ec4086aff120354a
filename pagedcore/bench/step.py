"""`pagedcore bench step`: one decode step against what its bytes cost.

For a model shape (seeded random weights) and each batch size, `batch` requests with
`--context`-token prompts are prefilled until every one decodes; then `--steps` decode steps
are timed (synchronised at both ends: the steady-state time per step) with CUDA graphs and
eagerly, with overlap scheduling on and off. The bytes floor of a step is the weights it reads
(every parameter but an untied input embedding, of which a step reads `batch` rows) plus the
batch's KV cache, read once at the device's copy bandwidth ((read + write) / time of a large
device-to-device copy). Per row: the host's time per step (schedule, prepare, update, and the
time it waited for the device), the host share on the critical path (without overlap all of
the host time; with overlap the time the GPU sat idle, which is when the host was late), and
the GPU idle time between steps (from a profiled window of steps: the span not covered by any
kernel or copy). ``--profile`` adds a kernel-by-kernel summary of a few steps per
row. ``--prefix-hit N`` adds, per mode (graphs, eager), the first token of a request whose
first N prompt tokens are in the prefix cache (warm: a priming request wrote them), each run
alone: its wall time from `add_request` to the output (overlap on and off), the device time
of its step, where the host's time goes (`pagedcore.bench.prefix_phases`), and with
``--profile`` that step's kernels. On a machine without CUDA the same loop runs (no graphs,
no device timeline).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import click

from pagedcore.bench.kernel_primitives import kernel_summary
from pagedcore.cli_progress import progress_bar
from pagedcore.cli_types import IntList, OutputPath, positive_int
from pagedcore.engine.engine_args_cli import engine_options

if TYPE_CHECKING:
    import torch

__all__ = ["bytes_floor", "gpu_idle", "measure_prefix_hit", "measure_step", "step"]

#: Own (uncached) prompt tokens after the shared prefix of ``--prefix-hit``.
_PREFIX_USER = 64
#: Decode steps of the shared-prefix decode workload on CUDA (`--shared-decode`).
_SHARED_DECODE_STEPS = 48
#: `--model-shape` choices: the engine experiments' shapes and a tiny CPU-friendly one.
SHAPES = ("qwen2-0.5b", "llama3-8b", "tiny")


def _sync(device: torch.device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def weight_bytes(model: Any) -> int:
    """Bytes of the weights one decode step reads: every parameter, except an input
    embedding that is not tied to the output head (a step reads only its batch's rows)."""
    embed = model.get_input_embeddings()
    tied = embed.weight is getattr(model.get_output_embeddings(), "weight", None)
    total = 0
    for p in model.parameters():
        if p is embed.weight and not tied:
            continue
        total += p.numel() * p.element_size()
    return total


def kv_bytes_per_token(llm: Any) -> int:
    """KV-cache bytes per token over all layers (K and V)."""
    total = 0
    for group in llm.kv_cache_config.groups:
        total += len(group.layer_names) * group.spec.page_size_bytes // group.spec.block_size
    return int(total)


def bytes_floor(*, weights: int, kv_per_token: int, context_tokens: int,
                copy_gbps: float | None) -> dict[str, Any]:
    """The bytes one step reads and the time they take at `copy_gbps` (None: unknown)."""
    total = weights + kv_per_token * context_tokens
    ms = total / (copy_gbps * 1e6) if copy_gbps else None
    return {"weight_bytes": weights, "kv_bytes": kv_per_token * context_tokens,
            "bytes": total, "floor_ms": ms}


def gpu_idle(intervals: Sequence[tuple[float, float]]) -> dict[str, float] | None:
    """GPU time covered by device activity over the span of `intervals` (microsecond
    ``(start, end)`` pairs of kernels and copies): busy and idle microseconds."""
    if not intervals:
        return None
    spans = sorted(intervals)
    busy = 0.0
    cur_start, cur_end = spans[0]
    for start, end in spans[1:]:
        if start > cur_end:
            busy += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    busy += cur_end - cur_start
    span = spans[-1][1] - spans[0][0]
    span = max(span, max(e for _s, e in spans) - spans[0][0])
    return {"span_us": span, "busy_us": busy, "idle_us": max(span - busy, 0.0)}


def _device_intervals(prof: Any) -> list[tuple[float, float]]:
    out = []
    for ev in prof.events():
        if ev.device_type.name == "CUDA":
            out.append((float(ev.time_range.start), float(ev.time_range.end)))
    return out


def _fill(llm: Any, batch: int, context: int, max_new: int, vocab: int, seed: int,
          temperature: float = 0.0, delta: bool = False) -> list[str]:
    import torch

    from pagedcore import SamplingParams

    gen = torch.Generator().manual_seed(seed)
    params = SamplingParams(max_tokens=max_new, temperature=temperature, ignore_eos=True)
    ids = []
    for i in range(batch):
        rid = f"s{seed}-{i}"
        llm.add_request(rid, torch.randint(3, vocab, (context,), generator=gen).tolist(), params,
                        delta=delta)
        ids.append(rid)
    # Prefill until every request decodes (one token per step).
    for _ in range(10_000):
        running = llm.scheduler.running
        if (len(running) == batch and not llm.scheduler.waiting
                and all(r.num_computed_tokens >= r.num_prompt_tokens for r in running)):
            break
        llm.step()
    return ids


def measure_step(llm: Any, *, batch: int, context: int, steps: int, overlap: bool,
                 profile: bool = False, warmup: int = 3, seed: int = 0,
                 trace_path: str | None = None, temperature: float = 0.0,
                 finished_only: bool = False, deltas: bool = False) -> dict[str, Any]:
    """Time `steps` decode steps of `batch` requests (prompts of `context` tokens), sampled
    greedily (`temperature` 0) or at `temperature` (no seed, no filter). Each `LLM.step`
    builds every running request's output, or with `finished_only` only those of finished
    requests (``LLM.generate``'s loop), or with `deltas` every running request's new tokens
    and text as delta tuples (the requests are added with ``delta=True`` and each step is
    ``step(deltas=[])``: the OpenAI server's loop, `pagedcore.serve.core_loop`).

    Returns the wall time per step, the host phases per step, the mean context, and with
    `profile` (CUDA only) the GPU idle time and a kernel summary of a few profiled steps
    (their Chrome trace, gzipped, written to `trace_path` when given).
    """
    llm.set_async_scheduling(overlap)
    device = llm.device
    vocab = min(1000, int(llm.model.config.vocab_size))
    # Requests decode while later ones prefill: give them all the room max_model_len leaves.
    ids = _fill(llm, batch, context, llm.max_model_len - context, vocab, seed, temperature,
                delta=deltas)

    def one_step() -> None:
        llm.step(finished_only=finished_only, deltas=[] if deltas else None)

    for _ in range(warmup):
        one_step()
    _sync(device)
    before = dict(llm.phase_time)
    marks = StepMarks(llm) if device.type == "cuda" else None
    t0 = time.perf_counter()
    for _ in range(steps):
        one_step()
    _sync(device)
    wall = (time.perf_counter() - t0) / steps
    if marks is not None:
        marks.remove()
    phases = {k: (v - before.get(k, 0.0)) / steps * 1e3 for k, v in llm.phase_time.items()}
    seq = [r.num_computed_tokens for r in llm.scheduler.running]
    row: dict[str, Any] = {
        "batch": batch, "overlap": bool(llm.async_scheduling), "temperature": temperature,
        "outputs": "deltas" if deltas else "finished" if finished_only else "all",
        "step_ms": wall * 1e3,
        "host_ms": {k: round(v, 4) for k, v in phases.items()},
        "mean_context": sum(seq) / max(len(seq), 1),
    }
    # (With overlap, "update" includes waiting for the previous step: not host work.)
    phases["update"] = phases.get("update", 0.0) - phases.get("wait", 0.0)
    row["host_ms"]["update"] = round(phases["update"], 4)
    host = sum(phases.get(k, 0.0) for k in ("schedule", "prepare", "update"))
    row["host_ms_total"] = host
    if marks is not None:
        row.update(marks.summary())
    if profile and device.type == "cuda":
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        n = 6
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(n):
                one_step()
            _sync(device)
        idle = gpu_idle(_device_intervals(prof))
        if idle is not None:  # (the profiler slows the host: an upper bound)
            row["profiled_gpu_idle_pct"] = 100.0 * idle["idle_us"] / max(idle["span_us"], 1e-9)
            row["profiled_gpu_busy_ms_per_step"] = idle["busy_us"] / n / 1e3
        row["kernels"] = kernel_summary(prof, n)
        if trace_path is not None:
            _write_trace(prof, trace_path)
    for rid in ids:
        if rid in llm._parents:
            llm.abort(rid)
    llm.drain()
    return row


def _write_trace(prof: Any, path: str) -> None:
    """The profiled window as a gzipped Chrome trace (chrome://tracing, Perfetto)."""
    import gzip
    import os
    import shutil
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        raw = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(raw)
        with open(raw, "rb") as src, gzip.open(path, "wb") as dst:
            shutil.copyfileobj(src, dst)


def _step_paths(llm: Any, since: dict[str, int] | None = None) -> dict[str, int]:
    """The engine's steps by how they ran (``stats()["cudagraph"]["step_paths"]``), minus
    the counts in `since` (the steps of one measurement, warm-ups included)."""
    now: dict[str, int] = dict(llm.cudagraph_status().get("step_paths", {}))
    base = since or {}
    return {k: v - base.get(k, 0) for k, v in now.items() if v - base.get(k, 0)}


def measure_prefix_hit(llm: Any, *, prefix: int, user: int = 64, reps: int = 5,
                       seed: int = 0, profile: bool = False) -> dict[str, Any]:
    """The first token of a warm `prefix`-token prefix-cache hit, each request run alone.

    A priming request (the shared `prefix` tokens + `user` own ones, ``max_tokens=1``) writes
    the prefix; then `reps` requests with the same prefix and other `user` tokens each run
    alone, with overlap on and then off. Per mode: the wall time from `add_request` until
    `step` returns the finished output (median and all), the device time of the request's
    step (CUDA events, overlap off), the cached tokens (proof of the hit: the prefix rounded
    down to whole blocks) and the mixed-graph replays. Then the host phases of `reps` more
    (`pagedcore.bench.prefix_phases.phase_breakdown`, each phase closed by a device sync),
    and with `profile` (CUDA) the kernels of one request's step.
    """
    import statistics

    import torch

    from pagedcore import SamplingParams
    from pagedcore.bench.prefix_phases import phase_breakdown

    if llm.has_unfinished_requests():
        raise ValueError("measure_prefix_hit needs an idle engine")
    device = llm.device
    cuda = device.type == "cuda"
    vocab = min(1000, int(llm.model.config.vocab_size))
    gen = torch.Generator().manual_seed(10_000 + seed)

    def tokens(n: int) -> list[int]:
        return [int(t) for t in torch.randint(3, vocab, (n,), generator=gen)]

    shared = tokens(prefix)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    block = int(llm.kv_cache_config.groups[0].spec.block_size)
    mixed = getattr(llm.runner, "mixed_graphs", None)

    def run_one(rid: str, prompt: list[int]) -> tuple[float, int | None, int]:
        _sync(device)
        t0 = time.perf_counter()
        llm.add_request(rid, prompt, params)
        cached = None
        steps = 0
        while llm.has_unfinished_requests():
            steps += 1
            for out in llm.step():
                if out.finished:
                    cached = out.num_cached_tokens
        return time.perf_counter() - t0, cached, steps

    before = llm.async_scheduling
    rows: dict[str, Any] = {"prefix_tokens": prefix, "user_tokens": user, "reps": reps,
                            "expected_cached_tokens": prefix // block * block}
    try:
        llm.set_async_scheduling(False)
        run_one(f"hit{seed}-prime", shared + tokens(user))
        for overlap in (True, False):
            llm.set_async_scheduling(overlap)
            run_one(f"hit{seed}-{overlap}-warmup", shared + tokens(user))
            replays = 0 if mixed is None else mixed.num_replays
            marks = StepMarks(llm) if cuda and not overlap else None
            walls, cached, steps = [], [], []
            for r in range(reps):
                wall, hit, n = run_one(f"hit{seed}-{overlap}-{r}", shared + tokens(user))
                walls.append(wall * 1e3)
                cached.append(hit)
                steps.append(n)
            key = "overlap" if overlap else "no_overlap"
            row: dict[str, Any] = {
                "first_token_ms_median": statistics.median(walls), "first_token_ms": walls,
                "num_cached_tokens": cached, "steps": steps,
                "mixed_graph_replays": None if mixed is None else mixed.num_replays - replays,
            }
            if marks is not None:
                _sync(device)
                marks.remove()
                busy = marks.busy_ms()
                if busy:
                    row["gpu_step_ms_median"] = statistics.median(busy)
            rows[key] = row
        llm.set_async_scheduling(False)
        breakdown = phase_breakdown(llm, [shared + tokens(user) for _ in range(reps)],
                                    label=f"hit{seed}-phases",
                                    sync=torch.cuda.synchronize if cuda else None)
        rows["phases_ms"] = breakdown["phases_ms"]
        rows["phases_total_ms"] = breakdown["total_ms"]
        if profile and cuda:
            from torch.profiler import ProfilerActivity
            from torch.profiler import profile as torch_profile

            with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                run_one(f"hit{seed}-profiled", shared + tokens(user))
                _sync(device)
            idle = gpu_idle(_device_intervals(prof))
            if idle is not None:
                rows["profiled_gpu_busy_ms"] = idle["busy_us"] / 1e3
            rows["kernels"] = kernel_summary(prof, 1)
    finally:
        llm.set_async_scheduling(before)
    rows["hits_proven"] = all(
        c == rows["expected_cached_tokens"]
        for k in ("overlap", "no_overlap") for c in rows.get(k, {}).get("num_cached_tokens", ()))
    return rows


class StepMarks:
    """CUDA events at the start of each step's device work (before its input upload) and at
    its end (after sampling), recorded by wrapping the runner's `prepare` and the sampler:
    the device's gaps between steps, unprofiled."""

    def __init__(self, llm: Any) -> None:
        import torch

        self._llm = llm
        self.starts: list[Any] = []
        self.ends: list[Any] = []
        runner, sampler = llm.runner, llm.sampler
        prepare, sample = runner.prepare, sampler.sample_device

        def marked_prepare(*args: Any, **kw: Any) -> Any:
            event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            event.record()
            self.starts.append(event)
            return prepare(*args, **kw)

        def marked_sample(*args: Any, **kw: Any) -> Any:
            out = sample(*args, **kw)
            event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            event.record()
            self.ends.append(event)
            return out

        runner.prepare = marked_prepare
        sampler.sample_device = marked_sample

    def remove(self) -> None:
        del self._llm.runner.prepare
        del self._llm.sampler.sample_device

    def busy_ms(self) -> list[float]:
        """Device milliseconds of each marked step, from its start to its end mark."""
        return [s.elapsed_time(e) for s, e in zip(self.starts, self.ends, strict=False)]

    def summary(self) -> dict[str, float]:
        """Mean device time per step from its start to its end mark, and the idle time
        between one step's end and the next one's start (a share of the wall per step)."""
        pairs = list(zip(self.starts, self.ends, strict=False))
        if len(pairs) < 2:
            return {}
        busy = [s.elapsed_time(e) for s, e in pairs]
        gaps = [max(0.0, pairs[i][1].elapsed_time(pairs[i + 1][0]))
                for i in range(len(pairs) - 1)]
        span = pairs[0][0].elapsed_time(pairs[-1][1])
        return {"gpu_step_ms": sum(busy) / len(busy),
                "gpu_idle_ms_per_step": sum(gaps) / len(gaps),
                "gpu_idle_pct": 100.0 * sum(gaps) / max(span, 1e-9)}


def _critical_host_pct(row: dict[str, Any]) -> float | None:
    if not row["overlap"]:
        return 100.0 * float(row["host_ms_total"]) / float(row["step_ms"])
    idle: float | None = row.get("gpu_idle_pct")
    return idle


@click.command("step")
@click.option("--model-shape", "shape", default="qwen2-0.5b", show_default=True,
              type=click.Choice(SHAPES), help="Model shape (seeded random weights).")
@click.option("--batch-sizes", default="1,64,256", show_default=True, type=IntList(1),
              help="Comma-separated running-request counts.")
@click.option("--context", default=512, show_default=True, type=positive_int(),
              help="Prompt tokens per request.")
@click.option("--steps", default=20, show_default=True, type=positive_int(),
              help="Timed decode steps per row.")
@click.option("--temperatures", default="0", show_default=True,
              help="Comma-separated sampling temperatures, a row each (0: greedy; others "
                   "sample every row at that temperature, unseeded).")
@click.option("--outputs", "outputs", default="all", show_default=True,
              help="Comma list of all (each step builds every running request's "
                   "RequestOutput), finished (only finished ones, as LLM.generate) and deltas "
                   "(every running request's new tokens as delta tuples, as the OpenAI "
                   "server's loop).")
@click.option("--no-eager", is_flag=True,
              help="Skip the eager (no CUDA graph) rows (which take the first temperature "
                   "and outputs setting only).")
@click.option("--profile", is_flag=True,
              help="Profile a few steps per row: GPU idle time and kernel summary (CUDA).")
@click.option("--prefix-hit", default=0, show_default=True, type=click.IntRange(min=0),
              help="Also time the first token of a warm prefix-cache hit of this many "
                   "tokens (+ 64 own), per mode; 0: off.")
@click.option("--prefix-reps", default=5, show_default=True, type=positive_int(),
              help="With --prefix-hit: requests timed per overlap setting.")
@click.option("--shared-decode", is_flag=True,
              help="With --prefix-hit: also decode min(64, largest batch) requests sharing "
                   "that prefix (+64 own tokens, 48 steps; median of 3 pairs of runs on CUDA) "
                   "with cascade off, always and auto (decode tokens/s; not in the eager pass).")
@click.option("--json", "json_path", default=None, type=OutputPath(),
              help="Write the figures to this JSON file.")
@click.option("--trace-dir", default=None, type=click.Path(file_okay=False),
              help="With --profile: write each overlapped row's profiled steps there as a "
                   "gzipped Chrome trace (step_<mode>_b<batch>_t<temperature>_<outputs>.json.gz).")
@engine_options(model=None, overrides=True, exclude=(
    "enforce_eager", "async_scheduling", "cudagraph_capture_sizes", "max_num_seqs"))
def step(shape: str, batch_sizes: list[int], context: int, steps: int, temperatures: str,
         outputs: str, no_eager: bool,
         profile: bool, prefix_hit: int, prefix_reps: int, shared_decode: bool,
         json_path: str | None,
         trace_dir: str | None, engine_overrides: dict[str, Any]) -> None:
    """Decode-step time vs the bytes floor: graphs and eager, overlap on and off (the bench
    switches CUDA graphs and overlap itself; the other engine options given apply)."""
    from rich.console import Console
    from rich.table import Table

    from pagedcore.bench.kernel_primitives import copy_bandwidth_gbps
    from pagedcore.bench.report import (
        engine_bench_model,
        environment,
        model_shape,
        with_overrides,
        write_json,
    )
    from pagedcore.engine.llm import LLM

    sizes = sorted(set(batch_sizes))
    try:
        temps = [float(t) for t in temperatures.split(",") if t.strip()]
    except ValueError:
        raise click.BadParameter(f"{temperatures!r} is not a comma list of numbers",
                                 param_hint="--temperatures") from None
    kinds = [k.strip() for k in outputs.split(",") if k.strip()]
    if not kinds or set(kinds) - {"all", "finished", "deltas"}:
        raise click.BadParameter(f"{outputs!r}: give a comma list of all, finished, deltas",
                                 param_hint="--outputs")
    if not temps or any(not 0.0 <= t <= 100.0 for t in temps):
        raise click.BadParameter(f"{temperatures!r}: give temperatures in [0, 100]",
                                 param_hint="--temperatures")
    small = shape == "tiny"
    device = engine_overrides.get("device")
    dev, dtype, config = engine_bench_model(small, device, "qwen2-0.5b" if small else shape,
                                            dtype=engine_overrides.get("dtype"))
    # Room for every request to decode while the last ones prefill, then the timed steps.
    # (The shared-prefix decode adds up to 1 + _SHARED_DECODE_STEPS tokens to a prompt.)
    max_len = max(context + 512,
                  prefix_hit + _PREFIX_USER + _SHARED_DECODE_STEPS + 16 if prefix_hit else 0)
    config.max_position_embeddings = max(int(config.max_position_embeddings), max_len)
    cuda = dev.type == "cuda"
    copy_gbps = copy_bandwidth_gbps(dev, quick=not cuda) if cuda else None
    kv_budget = None if cuda else 64 << 20
    report: dict[str, Any] = {"environment": environment(dev), "copy_bandwidth_GBps": copy_gbps,
                              "context": context, "steps": steps, "rows": [],
                              "prefix_hit": []}
    modes = [("graphs", False)] + ([] if no_eager or not cuda else [("eager", True)])
    llm = LLM(config, device=dev, dtype=dtype, **with_overrides(dict(
        backend=None, max_model_len=max_len, max_num_seqs=max(sizes),
        kv_cache_memory_bytes=kv_budget, max_num_batched_tokens=max(2048, max(sizes)),
        cudagraph_capture_sizes=sizes if cuda else None), engine_overrides))
    report["model"] = model_shape(config, dtype=dtype, kv_dtype=dtype, name=shape)
    report["max_model_len"] = max_len  # (sizes the block tables and the capture plans)
    report["backends"] = llm.backend_names
    weights = weight_bytes(llm.model)
    kv_tok = kv_bytes_per_token(llm)
    advance = click.get_current_context().with_resource(
        progress_bar("bench step", len(sizes) * len(temps) * len(kinds) * 2 + (
            len(sizes) * 2 if len(modes) > 1 else 0) + (len(modes) if prefix_hit else 0)))
    for mode, eager in modes:
        if eager:
            runner: Any = llm.runner  # (one process: a ModelRunner)
            runner.release_graphs()
        # (Eager rows: the first temperature and outputs setting.)
        axes = (temps, kinds) if not eager else (temps[:1], kinds[:1])
        for batch, temperature, kind, overlap in itertools.product(sizes, *axes,
                                                                   (True, False)):
            advance(1)
            trace = None
            if trace_dir is not None and overlap and profile and cuda:
                import os

                os.makedirs(trace_dir, exist_ok=True)
                trace = os.path.join(
                    trace_dir, f"step_{mode}_b{batch}_t{temperature:g}_{kind}.json.gz")
            paths = _step_paths(llm)
            row = measure_step(llm, batch=batch, context=context, steps=steps,
                               overlap=overlap, profile=profile and cuda, trace_path=trace,
                               temperature=temperature, finished_only=kind == "finished",
                               deltas=kind == "deltas")
            row["mode"] = mode if llm.cudagraph_status()["enabled"] else "eager"
            row["step_paths"] = _step_paths(llm, since=paths)
            row.update(bytes_floor(weights=weights, kv_per_token=kv_tok,
                                   context_tokens=int(row["mean_context"] * batch),
                                   copy_gbps=copy_gbps))
            floor = row["floor_ms"]
            row["ratio"] = row["step_ms"] / floor if floor else None
            row["critical_host_pct"] = _critical_host_pct(row)
            report["rows"].append(row)
            click.echo(f"  {row['mode']} batch {batch} temperature {temperature} "
                       f"outputs {kind} overlap {overlap}: "
                       f"{row['step_ms']:.3f} ms", err=True)
            if json_path:
                write_json(json_path, report)
        if prefix_hit:
            advance(1)
            # (Another seed per mode: the eager pass must not hit the graph pass's prompts.)
            paths = _step_paths(llm)
            hit = measure_prefix_hit(llm, prefix=prefix_hit, user=_PREFIX_USER,
                                     reps=prefix_reps, profile=profile and cuda,
                                     seed=len(report["prefix_hit"]))
            hit["mode"] = "graphs" if llm.cudagraph_status()["enabled"] else "eager"
            hit["step_paths"] = _step_paths(llm, since=paths)
            report["prefix_hit"].append(hit)
            for key in ("overlap", "no_overlap"):
                click.echo(f"  {hit['mode']} prefix hit {prefix_hit} {key}: first token "
                           f"{hit[key]['first_token_ms_median']:.3f} ms (cached "
                           f"{hit[key]['num_cached_tokens']})", err=True)
            if json_path:
                write_json(json_path, report)
            if shared_decode and not eager:  # (without graphs, auto is always's rule)
                from pagedcore.bench.prefix_shared import measure_shared_decode

                row = measure_shared_decode(
                    llm, num_reqs=min(64, max(sizes)), shared=prefix_hit, own=_PREFIX_USER,
                    max_tokens=_SHARED_DECODE_STEPS if cuda else 16,
                    vocab=min(1000, int(config.vocab_size)),
                    sync=(lambda: _sync(dev)), auto=True, reps=3 if cuda else 1)
                row["mode"] = hit["mode"]
                report.setdefault("shared_decode", []).append(row)
                rates = {k: row["cascade_" + k]["decode_tokens_per_s"]
                         for k in ("off", "on", "auto")}
                click.echo(f"  {row['mode']} shared-prefix decode {row['workload']}: tok/s "
                           + " ".join(f"{k} {'-' if v is None else format(v, '.0f')}"
                                      for k, v in rates.items()), err=True)
                if json_path:
                    write_json(json_path, report)
    table = Table(title=f"decode step vs bytes floor: {shape}, context ~{context}")
    for col in ("mode", "batch", "temp.", "outputs", "overlap", "step ms", "floor ms", "ratio",
                "host ms",
                "critical host %", "GPU idle %"):
        table.add_column(col, justify="right")

    def fmt(v: Any, spec: str = ".2f") -> str:
        return "-" if v is None else format(v, spec)

    for r in report["rows"]:
        table.add_row(r["mode"], str(r["batch"]), f"{r['temperature']:g}", r["outputs"],
                      "on" if r["overlap"] else "off",
                      fmt(r["step_ms"], ".3f"), fmt(r["floor_ms"], ".3f"), fmt(r["ratio"]),
                      fmt(r["host_ms_total"], ".3f"), fmt(r["critical_host_pct"], ".1f"),
                      fmt(r.get("gpu_idle_pct"), ".1f"))
    Console(width=140).print(table)
    if report["prefix_hit"]:
        hits = Table(title=f"first token of a warm {prefix_hit}-token prefix hit "
                           f"(+{_PREFIX_USER} own tokens), medians of {prefix_reps}")
        for col in ("mode", "overlap on ms", "overlap off ms", "GPU step ms", "hits proven",
                    "host phases ms (synced)"):
            hits.add_column(col, justify="right")
        for h in report["prefix_hit"]:
            phases = " ".join(f"{k} {v:.2f}" for k, v in h["phases_ms"].items())
            hits.add_row(h["mode"], fmt(h["overlap"]["first_token_ms_median"], ".3f"),
                         fmt(h["no_overlap"]["first_token_ms_median"], ".3f"),
                         fmt(h["no_overlap"].get("gpu_step_ms_median"), ".3f"),
                         str(h["hits_proven"]), phases)
        Console(width=160).print(hits)
    if json_path:
        write_json(json_path, report)

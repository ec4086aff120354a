"""GPU checks and timings of the Triton backend, one step per call (writes STEP.json to OUT).

Usage: ``python backends/triton/tools/gpu_check.py STEP OUT_DIR [--small]`` with STEP one of

* ``graph``: `forward` captured in a ``torch.cuda.CUDAGraph`` for a uniform decode batch (plan
  from ``build_for_cudagraph_capture``), the step's buffers rewritten in place with other
  lengths, block tables and padding requests, replayed, and compared with a float64 formula
  on NaN-poisoned caches (bf16 and fp32; with and without split-KV);
* ``decode``: `pagedcore.bench.kernels.bench_uniform` at 64x4096, 8x32768, 256x1024 (copy
  bandwidth, SDPA, naive gather, our forward eager and replayed from a CUDA graph);
* ``prefill``: causal 4x2048 and 4x8192, SDPA and every prefill tile variant of `VARIANTS`;
* ``mixed``: `pagedcore.bench.kernels.bench_mixed`;
* ``warm``: compiles the prefill variants on a small batch (run beside ``graph``).

``--small`` shrinks every shape (a logic check, also on CPU under ``TRITON_INTERPRET=1``).
Each step rewrites its JSON after every measurement, so a timeout keeps what was done.
"""

from __future__ import annotations

import functools
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

#: Prefill variants (PAGEDCORE_TRITON_PREFILL_TILES), most informative first; "" = default
#: (256 rows, 8 warps, int32 offsets); "128,64,4,3" = session 2's default (int64 offsets).
#: Session 3's sweep: docs/benchmarks/triton.md, backends/triton/tools/prefill_variants.py.
VARIANTS = ["", "128,64,4,3", "128,64,4,3,i32", "256,64,8,3,m1,i32"]


class _Out:
    """Collects a step's records and rewrites OUT/STEP.json after each."""

    def __init__(self, out_dir: str, step: str) -> None:
        self.path = Path(out_dir) / f"{step}.json"
        self.t0 = time.time()
        import triton

        self.info: dict[str, Any] = {
            "step": step, "device": _device_name(), "torch": torch.__version__,
            "triton": triton.__version__, "rows": [],
        }

    def add(self, row: dict[str, Any]) -> None:
        row["t_s"] = round(time.time() - self.t0, 1)
        self.info["rows"].append(row)
        print(json.dumps(row, default=str), flush=True)
        self.path.write_text(json.dumps(self.info, indent=1, default=str))


def _device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def step_graph(out: _Out, small: bool) -> None:
    dims = (8, 2, 64, 16) if small else (32, 8, 128, 16)
    # (dtype, num_reqs, max_model_len): few long requests split the KV; many short ones don't.
    f32, bf16 = torch.float32, torch.bfloat16
    configs = [(f32, 4, 256), (f32, 8, 64)] if small else [
        (f32, 4, 4096), (bf16, 4, 8192), (bf16, 32, 1024)]
    for dtype, num_reqs, max_len in configs:
        _graph_config(out, dims, dtype, num_reqs, max_len)


def _graph_config(
    out: _Out, dims: tuple[int, int, int, int], dtype: torch.dtype, num_reqs: int, max_len: int
) -> None:
    from _reference import make_batch, reference_attention, rel_error
    from pagedcore_triton import TritonAttentionBackend

    from pagedcore.attention import CommonAttentionMetadata
    from pagedcore.kv_cache.spec import FullAttentionSpec

    dev = _device()
    heads, kv_heads, head_size, bs = dims
    max_blocks = math.ceil(max_len / bs) + 1
    spec = FullAttentionSpec(block_size=bs, num_kv_heads=kv_heads, head_size=head_size,
                             dtype=dtype)
    builder = TritonAttentionBackend.get_builder_cls()(spec, ["l0"], dev)
    impl = TritonAttentionBackend.get_impl_cls()(heads, head_size, head_size**-0.5,
                                                 num_kv_heads=kv_heads)
    qsl = torch.arange(num_reqs + 1, dtype=torch.int32, device=dev)
    lens = torch.ones(num_reqs, dtype=torch.int32, device=dev)
    table = torch.zeros((num_reqs, max_blocks), dtype=torch.int32, device=dev)
    slots = torch.full((num_reqs,), -1, dtype=torch.int64, device=dev)
    query = torch.zeros((num_reqs, heads, head_size), dtype=dtype, device=dev)
    key = torch.zeros((num_reqs, kv_heads, head_size), dtype=dtype, device=dev)
    value = torch.zeros_like(key)
    output = torch.zeros_like(query)
    cache_blocks = num_reqs * max_blocks + 8
    cache = torch.full((2, cache_blocks, bs, kv_heads, head_size), float("nan"),
                       dtype=dtype, device=dev)
    common = CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl.cpu(), seq_lens=lens,
        seq_lens_cpu=lens.cpu(), num_reqs=num_reqs, num_actual_tokens=num_reqs,
        max_query_len=1, max_seq_len=max_len, block_table=table, slot_mapping=slots,
        positions=torch.zeros(num_reqs, dtype=torch.int64, device=dev),
    )
    metadata = builder.build_for_cudagraph_capture(common)
    segments = metadata.parts[0].num_segments

    def step() -> None:
        impl.do_kv_cache_update(key, value, cache, slots)
        impl.forward(query, key, value, cache, metadata, output=output)

    g = torch.Generator().manual_seed(num_reqs)
    graph = None
    for trial in range(3):
        n = num_reqs - (trial % 2)  # odd trials keep one padding request
        ctx = torch.randint(0, max_len, (n,), generator=g).tolist()
        if trial == 1:
            ctx[0] = max_len - 1  # the longest sequence the plan allows
        batch = make_batch([(c, 1) for c in ctx], num_heads=heads, num_kv_heads=kv_heads,
                           head_size=head_size, block_size=bs, dtype=dtype,
                           device=str(dev), seed=trial, extra_blocks=0)
        nb = batch.kv_cache.shape[1]
        cache.fill_(float("nan"))
        cache[:, :nb] = batch.kv_cache
        c = batch.common
        lens.fill_(1)
        table.zero_()
        slots.fill_(-1)
        lens[:n] = c.seq_lens
        width = min(c.block_table.shape[1], max_blocks)
        table[:n, :width] = c.block_table[:, :width]
        slots[:n] = c.slot_mapping
        query.normal_()
        query[:n] = batch.query
        key[:n] = batch.key
        value[:n] = batch.value
        output.fill_(float("nan"))
        if graph is None and dev.type == "cuda":
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                step()  # warm-up: compiles outside the capture
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            cache[:, :nb] = batch.kv_cache  # undo the warm-up's write
            output.fill_(float("nan"))
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
        if graph is not None:
            graph.replay()
            torch.cuda.synchronize()
        else:
            step()
        ref = reference_attention(batch, scale=head_size**-0.5)
        err = rel_error(output[:n], ref)
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
        out.add({"check": "cudagraph_replay", "dtype": str(dtype), "num_reqs": num_reqs,
                 "real_reqs": n, "max_model_len": max_len, "segments": segments,
                 "max_ctx": max(ctx), "graph": graph is not None, "rel_err": err,
                 "tol": tol, "ok": bool(err < tol)})


def step_decode(out: _Out, small: bool) -> None:
    from pagedcore_triton import TritonAttentionBackend

    from pagedcore.bench import kernels as k

    dev = _device()
    copy = k.copy_bandwidth_gbps(dev, quick=small)
    out.add({"copy_bandwidth_GBps": copy})
    shapes = [(2, 64)] if small else [(8, 32768), (64, 4096), (256, 1024)]
    for batch, ctx in shapes:
        for row in k.bench_uniform("decode", batch, ctx, [TritonAttentionBackend], dev, copy):
            out.add(row)
        if dev.type == "cuda":
            torch.cuda.empty_cache()


def step_prefill(out: _Out, small: bool) -> None:
    from pagedcore_triton import TritonAttentionBackend

    from pagedcore.bench import kernels as k

    dev = _device()
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    shapes = [(1, 48)] if small else [(4, 2048), (4, 8192)]
    variants = ["", "64,16,4,3", "32,32,4,2,fwd"] if small else VARIANTS
    for batch, length in shapes:
        kv = k.PagedKV([length] * batch, dtype, dev)
        query = torch.randn((batch * length, k.NUM_HEADS, k.HEAD_SIZE), dtype=dtype, device=dev)
        q4 = query.view(batch, length, k.NUM_HEADS, k.HEAD_SIZE).transpose(1, 2)
        k4 = kv.key.view(batch, length, k.NUM_KV_HEADS, k.HEAD_SIZE).transpose(1, 2).contiguous()
        v4 = kv.value.view(batch, length, k.NUM_KV_HEADS, k.HEAD_SIZE).transpose(1, 2)
        v4 = v4.contiguous()
        ref = k._sdpa(q4, k4, v4, causal=True).transpose(1, 2).reshape(query.shape)
        flops = 4 * k.HEAD_SIZE * k.NUM_HEADS * batch * length * (length + 1) // 2
        sdpa_ms = k.time_ms(functools.partial(k._sdpa, q4, k4, v4, causal=True), dev)
        shape = f"{batch}x{length}"
        out.add({"case": "prefill", "shape": shape, "impl": "sdpa", "ms": sdpa_ms,
                 "TFLOPs": flops / sdpa_ms / 1e9})
        under = k.BackendUnderTest(TritonAttentionBackend, kv)
        for variant in variants:
            if variant:
                os.environ["PAGEDCORE_TRITON_PREFILL_TILES"] = variant
            else:
                os.environ.pop("PAGEDCORE_TRITON_PREFILL_TILES", None)
            try:
                run = under.runner(kv, [length] * batch, list(range(batch)), query)
                err = k._rel(run(), ref)
                ms = k.time_ms(run, dev, budget_ms=150)
                out.add({"case": "prefill", "shape": shape, "impl": "triton",
                         "variant": variant or "default", "ms": ms, "TFLOPs": flops / ms / 1e9,
                         "speed_vs_sdpa": sdpa_ms / ms, "rel_err_vs_sdpa": err})
            except Exception as exc:  # e.g. out of shared memory for one tile shape
                out.add({"case": "prefill", "shape": shape, "variant": variant,
                         "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
        os.environ.pop("PAGEDCORE_TRITON_PREFILL_TILES", None)
        del under, kv
        if dev.type == "cuda":
            torch.cuda.empty_cache()


def step_warm(out: _Out, small: bool) -> None:
    """Compile every prefill variant on a small batch with the same specializations."""
    from pagedcore_triton import TritonAttentionBackend

    from pagedcore.bench import kernels as k

    dev = _device()
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    batch, length = (1, 32) if small else (4, 256)
    kv = k.PagedKV([length] * batch, dtype, dev)
    query = torch.randn((batch * length, k.NUM_HEADS, k.HEAD_SIZE), dtype=dtype, device=dev)
    under = k.BackendUnderTest(TritonAttentionBackend, kv)
    for variant in VARIANTS[:2] if small else VARIANTS:
        os.environ["PAGEDCORE_TRITON_PREFILL_TILES"] = variant
        if not variant:
            os.environ.pop("PAGEDCORE_TRITON_PREFILL_TILES")
        try:
            under.runner(kv, [length] * batch, list(range(batch)), query)()
            out.add({"warm": variant or "default"})
        except Exception as exc:
            out.add({"warm": variant, "error": f"{type(exc).__name__}: {str(exc)[:300]}"})


def step_mixed(out: _Out, small: bool) -> None:
    from pagedcore_triton import TritonAttentionBackend

    from pagedcore.bench import kernels as k

    args = (2, 40, 16, 8) if small else (64, 4096, 2048, 2048)
    for row in k.bench_mixed(*args, [TritonAttentionBackend], _device()):
        out.add(row)


STEPS = {"graph": step_graph, "decode": step_decode, "prefill": step_prefill,
         "mixed": step_mixed, "warm": step_warm}


def main() -> None:
    step, out_dir = sys.argv[1], sys.argv[2]
    small = "--small" in sys.argv[3:]
    if step not in STEPS:
        raise SystemExit(f"unknown step {step!r}; choose from {', '.join(STEPS)}")
    torch.manual_seed(0)
    out = _Out(out_dir, step)
    STEPS[step](out, small)
    print(f"{step} done in {time.time() - out.t0:.1f}s", flush=True)


if __name__ == "__main__":
    main()

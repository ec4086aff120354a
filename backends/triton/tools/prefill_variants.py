"""Prefill tile variants on the GPU: correctness first, then timing against SDPA.

Usage::

    python backends/triton/tools/prefill_variants.py check OUT VARIANT... [--small]
    python backends/triton/tools/prefill_variants.py time OUT VARIANT... [--small]

A VARIANT is a ``PAGEDCORE_TRITON_PREFILL_TILES`` value (``default`` = no override), see
`pagedcore_triton.plan.parse_tiles`.

* ``check`` runs, for each variant, a ragged batch (prefills, chunks continuing a cached
  prefix, decodes, padding tokens; lengths that are not multiples of the tile) in bf16 and
  fp16, and in bf16 with a sliding window, soft-cap and ALiBi; 32 query / 8 KV heads, head
  size 128, block size 16, on a NaN-poisoned, randomly permuted cache, against the float64
  formula of the tests; then one call at the benchmark's 4x2048 shape (so the timing step
  finds the kernel compiled). Writes ``OUT/check_<n>.json`` (n = a hash of the variant
  list, so parallel runs don't collide).
* ``time`` times causal 4x2048 and 4x8192 prefill of every variant over the paged cache
  (`pagedcore.bench.kernels` timing, bf16) with torch SDPA on contiguous K/V re-timed between
  every two variants (it drifts by a few percent); writes ``OUT/time.json`` after each row.

``--small`` shrinks every shape for a logic check on CPU (``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

ENV = "PAGEDCORE_TRITON_PREFILL_TILES"
#: (context, query) of the check batch: prefills, prefix-continuing chunks, decodes.
RAGGED = [(0, 300), (517, 211), (1000, 77), (35, 1), (0, 64), (130, 1000), (4000, 1), (7, 33)]
RAGGED_SMALL = [(0, 21), (17, 9), (3, 1), (40, 16)]


def _select(variant: str) -> None:
    if variant == "default":
        os.environ.pop(ENV, None)
    else:
        os.environ[ENV] = variant


class _Out:
    def __init__(self, path: Path) -> None:
        import triton

        self.path, self.t0 = path, time.time()
        dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        self.info: dict[str, Any] = {"device": dev, "torch": torch.__version__,
                                     "triton": triton.__version__, "rows": []}

    def add(self, row: dict[str, Any]) -> None:
        row["t_s"] = round(time.time() - self.t0, 1)
        self.info["rows"].append(row)
        print(json.dumps(row, default=str), flush=True)
        self.path.write_text(json.dumps(self.info, indent=1, default=str))


#: Every masking feature at once (a window shorter than most prefills, soft-cap, ALiBi).
FEATURES: dict[str, Any] = {"sliding_window": 200, "logits_soft_cap": 30.0}


def _check_one(
    variant: str, dtype: torch.dtype, small: bool, features: bool = False
) -> dict[str, Any]:
    from _reference import make_batch, reference_attention, rel_error
    from pagedcore_triton import TritonAttentionBackend

    from pagedcore.kv_cache.spec import FullAttentionSpec

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    heads, kv_heads, head_size = (8, 2, 64) if small else (32, 8, 128)
    reqs = RAGGED_SMALL if small else RAGGED
    batch = make_batch(reqs, num_heads=heads, num_kv_heads=kv_heads, head_size=head_size,
                       block_size=16, dtype=dtype, device=dev, num_padding=3, seed=7)
    spec = FullAttentionSpec(block_size=16, num_kv_heads=kv_heads, head_size=head_size,
                             dtype=dtype)
    builder = TritonAttentionBackend.get_builder_cls()(spec, ["l0"], torch.device(dev))
    metadata = builder.build(batch.common)
    scale = head_size**-0.5
    extra = dict(FEATURES) if features else {}
    if features:
        extra["alibi_slopes"] = [2.0 ** (-8.0 * (h + 1) / heads) for h in range(heads)]
    impl = TritonAttentionBackend.get_impl_cls()(
        heads, head_size, scale, num_kv_heads=kv_heads, **extra
    )
    impl.do_kv_cache_update(batch.key, batch.value, batch.kv_cache, batch.common.slot_mapping)
    out = torch.full_like(batch.query, float("nan"))
    impl.forward(batch.query, batch.key, batch.value, batch.kv_cache, metadata, output=out)
    ref = reference_attention(batch, scale=scale, **extra)
    n = batch.common.num_actual_tokens
    err = rel_error(out[:n], ref)
    tol = {torch.bfloat16: 2e-2, torch.float16: 3e-3}.get(dtype, 1e-4)
    prefill = [c for c in (la.constexprs for la in metadata.launches.values())
               if c["BLOCK_M"] > 16] if hasattr(metadata, "launches") else []
    return {"check": "ragged+features" if features else "ragged", "variant": variant,
            "dtype": str(dtype), "rel_err": err,
            "tol": tol, "finite": bool(torch.isfinite(out[:n]).all()),
            "ok": bool(err < tol and torch.isfinite(out[:n]).all()),
            "prefill_launch": {k: prefill[0][k] for k in ("BLOCK_M", "TILE_N", "num_warps",
                               "num_stages", "EDGE_STAGES", "OFF32")
                               if k in prefill[0]} if prefill else None}


def _prefill_case(batch: int, length: int) -> tuple[Any, torch.Tensor, Any, torch.Tensor, int]:
    from pagedcore.bench import kernels as k

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    kv = k.PagedKV([length] * batch, dtype, dev)
    query = torch.randn((batch * length, k.NUM_HEADS, k.HEAD_SIZE), dtype=dtype, device=dev)
    q4 = query.view(batch, length, k.NUM_HEADS, k.HEAD_SIZE).transpose(1, 2)
    k4 = kv.key.view(batch, length, k.NUM_KV_HEADS, k.HEAD_SIZE).transpose(1, 2).contiguous()
    v4 = kv.value.view(batch, length, k.NUM_KV_HEADS, k.HEAD_SIZE).transpose(1, 2).contiguous()
    sdpa = functools.partial(k._sdpa, q4, k4, v4, causal=True)
    ref = sdpa().transpose(1, 2).reshape(query.shape)
    flops = 4 * k.HEAD_SIZE * k.NUM_HEADS * batch * length * (length + 1) // 2
    return kv, query, sdpa, ref, flops


def step_check(out_dir: Path, variants: list[str], small: bool) -> None:
    from pagedcore_triton import TritonAttentionBackend

    from pagedcore.bench import kernels as k

    tag = hashlib.sha1(",".join(variants).encode()).hexdigest()[:8]
    out = _Out(out_dir / f"check_{tag}.json")
    dtypes = [torch.float32] if small else [torch.bfloat16, torch.float16]
    cases = [(dtype, False) for dtype in dtypes] + [(dtypes[0], True)]
    for variant in variants:
        _select(variant)
        for dtype, features in cases:
            try:
                out.add(_check_one(variant, dtype, small, features))
            except Exception as exc:
                out.add({"check": "ragged", "variant": variant, "dtype": str(dtype),
                         "features": features, "ok": False,
                         "error": f"{type(exc).__name__}: {str(exc)[:400]}"})
    # Warm the timing step's specialization (same ints as the 4x2048 / 4x8192 bench).
    shape = (1, 48) if small else (4, 2048)
    kv, query, _, ref, _ = _prefill_case(*shape)
    under = k.BackendUnderTest(TritonAttentionBackend, kv)
    for variant in variants:
        _select(variant)
        try:
            err = k._rel(under.runner(kv, [shape[1]] * shape[0], list(range(shape[0])), query)(),
                         ref)
            out.add({"warm": variant, "shape": f"{shape[0]}x{shape[1]}", "rel_err_vs_sdpa": err})
        except Exception as exc:
            out.add({"warm": variant, "error": f"{type(exc).__name__}: {str(exc)[:400]}"})


def step_time(out_dir: Path, variants: list[str], small: bool) -> None:
    from pagedcore_triton import TritonAttentionBackend

    from pagedcore.bench import kernels as k

    out = _Out(out_dir / "time.json")
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shapes = [(1, 48)] if small else [(4, 2048), (4, 8192)]
    for batch, length in shapes:
        kv, query, sdpa, ref, flops = _prefill_case(batch, length)
        shape = f"{batch}x{length}"
        under = k.BackendUnderTest(TritonAttentionBackend, kv)
        sdpa_runs: list[float] = []

        def time_sdpa(shape: str = shape, sdpa: Any = sdpa, flops: int = flops,
                      sdpa_runs: list[float] = sdpa_runs) -> None:
            ms = k.time_ms(sdpa, dev, budget_ms=150)
            sdpa_runs.append(ms)
            out.add({"shape": shape, "impl": "sdpa", "ms": ms, "TFLOPs": flops / ms / 1e9})

        time_sdpa()
        for i, variant in enumerate(variants):
            _select(variant)
            try:
                run = under.runner(kv, [length] * batch, list(range(batch)), query)
                err = k._rel(run(), ref)
                ms = k.time_ms(run, dev, budget_ms=150)
                near = sdpa_runs[-1]
                out.add({"shape": shape, "impl": "triton", "variant": variant, "ms": ms,
                         "TFLOPs": flops / ms / 1e9, "speed_vs_sdpa_last": near / ms,
                         "rel_err_vs_sdpa": err})
            except Exception as exc:
                out.add({"shape": shape, "variant": variant,
                         "error": f"{type(exc).__name__}: {str(exc)[:400]}"})
            if i % 2 == 1:
                time_sdpa()
        time_sdpa()
        out.add({"shape": shape, "sdpa_ms_runs": sdpa_runs,
                 "sdpa_ms_median": sorted(sdpa_runs)[len(sdpa_runs) // 2]})
        _select("default")
        del under, kv
        if dev.type == "cuda":
            torch.cuda.empty_cache()


def main() -> None:
    args = [a for a in sys.argv[1:] if a != "--small"]
    small = "--small" in sys.argv[1:]
    if len(args) < 3 or args[0] not in ("check", "time"):
        raise SystemExit(__doc__)
    out_dir = Path(args[1])
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    t0 = time.time()
    (step_check if args[0] == "check" else step_time)(out_dir, args[2:], small)
    print(f"{args[0]} done in {time.time() - t0:.1f}s", flush=True)


if __name__ == "__main__":
    main()

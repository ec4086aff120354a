"""Short queries over long contexts (a prefix hit's remainder, a chat turn): split-KV sweep.

A warm 4K prefix hit on the Qwen2-0.5B shape computes 64 new tokens over 4,096 cached ones.
Its prefill part has a handful of q-blocks per KV head (``cdiv(64, BLOCK_Q)``), each walking
the whole context alone; on the H200 that step's attention took ~19 us per layer from the
mixed graph and ~100 us eager (the Hopper prefill kernel, unsplit), against ~1 us of bytes
(``docs/benchmarks/step_h200_r2/step_qwen.json``). This tool times such steps through the
backend's own builder and impl under several plans:

* ``default``: the builder's plan (`TritonMetadataBuilder.build`);
* ``S<n>``: the prefill part on the classic grid with exactly ``n`` split-KV segments (the
  Hopper kernel off: it serves unsplit parts only);
* ``flat`` / ``flat:<target_programs>``: the captured mixed plan (`_plan_mixed_capture`,
  ``max_model_len`` 32,768), eager and replayed from a CUDA graph;
* ``sdpa``: torch SDPA on contiguous K/V with a bottom-right causal mask (a comparator).

Every plan is first checked against float32 attention over each request's own K/V, with every
cache slot the batch does not own NaN-poisoned; a failing plan gets an error row, not a time.

    python backends/triton/tools/extend_probe.py OUT.json [--case NAME ...] [--seconds 200]
    python backends/triton/tools/extend_probe.py OUT.json --device cpu   # interpreter, tiny
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

#: ``name: (query heads, KV heads, head size, requests, context tokens, new tokens)``.
CASES: dict[str, tuple[int, int, int, int, int, int]] = {
    "qwen_1x4096+64": (14, 2, 64, 1, 4096, 64),
    "qwen_1x4096+16": (14, 2, 64, 1, 4096, 16),
    "qwen_1x16384+64": (14, 2, 64, 1, 16384, 64),
    "qwen_4x4096+64": (14, 2, 64, 4, 4096, 64),
    "qwen_1x1024+512": (14, 2, 64, 1, 1024, 512),
    "qwen_1x0+2048": (14, 2, 64, 1, 0, 2048),
    "llama_1x4096+64": (32, 8, 128, 1, 4096, 64),
    "llama_1x16384+128": (32, 8, 128, 1, 16384, 128),
    "llama_4x4096+64": (32, 8, 128, 4, 4096, 64),
    "llama_1x0+2048": (32, 8, 128, 1, 0, 2048),
}
CPU_CASES: dict[str, tuple[int, int, int, int, int, int]] = {
    "cpu_1x96+8": (4, 2, 64, 1, 96, 8),
    "cpu_2x64+5": (4, 1, 64, 2, 64, 5),
}
VARIANTS = ["default", "S1", "S2", "S4", "S8", "S16", "S32", "S64", "flat", "flat:128", "flat:256",
            "flat:1024", "sdpa"]


def reference(kv: Any, query: Any, q_len: int, hq: int) -> Any:
    """Float32 attention of each request's last `q_len` tokens over its whole sequence."""
    import torch
    import torch.nn.functional as F

    outs = []
    for r, n in enumerate(kv.seq_lens):
        sl = kv.token_slice(r)
        k = kv.key[sl].float().transpose(0, 1)  # [Hkv, S, D]
        v = kv.value[sl].float().transpose(0, 1)
        q = query[r * q_len:(r + 1) * q_len].float().transpose(0, 1)  # [Hq, L, D]
        pos_q = torch.arange(n - q_len, n, device=q.device)[:, None]
        mask = torch.arange(n, device=q.device)[None, :] <= pos_q
        o = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask,
                                           enable_gqa=True)
        outs.append(o[0].transpose(0, 1))
    return torch.cat(outs)


def check(out: Any, ref: Any) -> float:
    import torch

    if not bool(torch.isfinite(out).all()):
        raise RuntimeError("non-finite output (a NaN-poisoned slot was read)")
    err = float((out.float() - ref.float()).norm() / ref.float().norm())
    if err > 1e-2:
        raise RuntimeError(f"relative error {err:.3g} against float32 attention")
    return err


def plans(under: Any, common: Any, variant: str) -> Any:
    """`TritonAttentionMetadata` of `variant` for the step `common`."""
    import attrs
    from pagedcore_triton.metadata import TritonAttentionMetadata
    from pagedcore_triton.plan import SplitRule

    builder = under.builder
    if variant == "default":
        return builder.build(common)
    if variant.startswith("S"):
        meta = builder.build(common)
        parts = [attrs.evolve(p, num_segments=int(variant[1:]), tma_prefill=False)
                 if p.max_query_len > 1 else p for p in meta.parts]
        return TritonAttentionMetadata.from_common(common, parts)
    if variant.startswith("flat"):
        target = int(variant.split(":")[1]) if ":" in variant else SplitRule().target_programs
        fields = {a.name: getattr(common, a.name) for a in attrs.fields(type(common))}
        capture = type(common)(**{**fields, "max_seq_len": 32768})
        saved = builder.split_rule
        builder.split_rule = attrs.evolve(saved, target_programs=target)
        try:
            meta = builder._plan_mixed_capture(capture)
        finally:
            builder.split_rule = saved
        return TritonAttentionMetadata.from_common(common, meta.parts)
    raise ValueError(f"unknown variant {variant!r}")


def run_case(name: str, shape: tuple[int, ...], variants: list[str], *, device: Any,
             rows: list[dict[str, Any]], save: Any, deadline: float) -> None:
    import torch
    import torch.nn.functional as F
    from pagedcore_triton import TritonAttentionBackend

    from pagedcore.bench import kernel_primitives as kp
    from pagedcore.bench.kernel_primitives import BackendUnderTest, PagedKV

    hq, hkv, d, batch, ctx, q_len = shape
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    kv = PagedKV([ctx + q_len] * batch, dtype, device, num_kv_heads=hkv, head_size=d)
    query = torch.randn((batch * q_len, hq, d), dtype=dtype, device=device)
    ref = reference(kv, query, q_len, hq)
    under = BackendUnderTest(TritonAttentionBackend, kv, num_heads=hq)
    under.kv_cache.fill_(float("nan"))
    for start in range(0, kv.key.shape[0], 1 << 16):
        sl = slice(start, start + (1 << 16))
        under.impl.do_kv_cache_update(kv.key[sl], kv.value[sl], under.kv_cache, kv.slots[sl])
    reqs = list(range(batch))
    common = kv.common([q_len] * batch, reqs)
    idx = kv.new_tokens([q_len] * batch, reqs)
    key, value = kv.key[idx], kv.value[idx]
    flops = 4 * hq * d * sum(q_len * ctx + q_len * (q_len + 1) // 2 for _ in reqs)
    base = {"case": name, "heads": f"{hq}/{hkv}", "head_size": d, "batch": batch,
            "context": ctx, "new_tokens": q_len}

    def add(row: dict[str, Any]) -> None:
        rows.append({**base, **row})
        print(json.dumps(rows[-1]), flush=True)
        save()

    impl, cache = under.impl, under.kv_cache
    k4 = kv.key.view(batch, ctx + q_len, hkv, d).transpose(1, 2)
    v4 = kv.value.view(batch, ctx + q_len, hkv, d).transpose(1, 2)
    q4 = query.view(batch, q_len, hq, d).transpose(1, 2)

    def sdpa() -> Any:
        from torch.nn.attention.bias import causal_lower_right

        return F.scaled_dot_product_attention(q4, k4, v4, enable_gqa=True,
                                              attn_mask=causal_lower_right(q_len, ctx + q_len))

    for variant in variants:
        if time.time() > deadline:
            add({"variant": variant, "skipped": "time"})
            continue
        try:
            if variant == "sdpa":
                if not cuda:
                    continue
                out = sdpa().transpose(1, 2).reshape(query.shape)
                err = check(out, ref)
                ms = kp.time_ms(sdpa, device)
                add({"variant": "sdpa", "mode": "eager", "us": round(ms * 1e3, 2),
                     "tflops": round(flops / ms / 1e9, 1), "rel_err": round(err, 6)})
                continue
            meta = plans(under, common, variant)
            out = torch.empty_like(query)

            def run(meta: Any = meta, out: Any = out) -> Any:
                return impl.forward(query, key, value, cache, meta, output=out)

            plan = [{"segments": p.num_segments, "flat": p.flat_programs, "tma": p.tma_prefill,
                     "max_q": p.max_query_len} for p in meta.parts]
            modes = ["eager", "graph"] if cuda and variant.startswith("flat") else ["eager"]
            for mode in modes:
                out.fill_(float("nan"))
                err = check(run(), ref)
                if not cuda:
                    add({"variant": variant, "mode": mode, "rel_err": round(err, 6),
                         "plan": plan})
                    continue
                ms = kp.graph_time_ms(run, device) if mode == "graph" else kp.time_ms(run, device)
                add({"variant": variant, "mode": mode, "us": round(ms * 1e3, 2),
                     "tflops": round(flops / ms / 1e9, 1), "rel_err": round(err, 6),
                     "plan": plan})
        except Exception as exc:  # one failing plan must not sink the others
            add({"variant": variant, "error": f"{type(exc).__name__}: {exc}"[:400]})
    del under
    if cuda:
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="JSON file (rewritten after every row)")
    parser.add_argument("--case", action="append", default=[], help="a name of CASES")
    parser.add_argument("--variant", action="append", default=[], help="a plan (see above)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--seconds", type=float, default=300.0, help="time budget")
    args = parser.parse_args(argv)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    device = torch.device(args.device)
    table = CPU_CASES if device.type == "cpu" else CASES
    names = args.case or list(table)
    unknown = [n for n in names if n not in table]
    if unknown:
        parser.error(f"unknown case(s) {unknown}; choose from {sorted(table)}")
    deadline = time.time() + args.seconds
    rows: list[dict[str, Any]] = []
    info = {"tool": "backends/triton/tools/extend_probe.py", "argv": sys.argv[1:],
            "commit": os.environ.get("PAGEDCORE_GIT_COMMIT"),
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"}

    def save() -> None:
        with open(args.out, "w") as f:
            json.dump({**info, "rows": rows}, f, indent=1)

    for name in names:
        torch.manual_seed(0)
        run_case(name, table[name], args.variant or VARIANTS, device=device, rows=rows,
                 save=save, deadline=deadline)
    save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

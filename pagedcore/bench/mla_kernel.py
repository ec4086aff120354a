"""The Triton MLA decode kernel's variants: correctness and bandwidth (for `pagedcore bench mla`).

Shapes are DeepSeek-V2-Lite decode: 16 query heads, latent 512 + rope 64, bf16, block size 16,
one query token per request over randomly permuted physical blocks. Each variant is a
`pagedcore_triton.mla.MLAKernelConfig` (tile, warps, pipeline stages, register cap, split-KV
rule), timed on every shape with its own split-KV target and twice that. Bandwidth is latent
cache bytes read / median device time of the whole ``forward`` (decode kernel, and the merge
kernel when the context is split), against a device-to-device copy (bytes read + written).

`check_variant` runs the MLA conformance specs (NaN in every unused slot, relative error
against the reference) for one variant; `warm_variant` compiles its kernels at the bench's
shapes, so that several processes can compile variants in parallel before one times them.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from pagedcore.kv_cache.spec import cdiv

if TYPE_CHECKING:
    import torch

BLOCK_SIZE = 16
NUM_HEADS = 16
LATENT = 512
ROPE = 64
#: Decode shapes (batch, context): few long, medium, many short; QUICK runs in the interpreter.
FULL_CASES = ((64, 4096), (4, 32768), (256, 1024), (16, 16384), (128, 2048))
QUICK_CASES = ((2, 64),)


def _decode_batch(batch: int, context: int, device: torch.device, dtype: torch.dtype) -> Any:
    """A decode step of `batch` requests of `context` tokens over permuted blocks; the null
    block and the slots past each context hold NaN."""
    import torch

    from pagedcore.attention import CommonAttentionMetadata

    dim = LATENT + ROPE
    blocks = cdiv(context, BLOCK_SIZE)
    num_blocks = 1 + batch * blocks
    table = (torch.randperm(num_blocks - 1) + 1).to(torch.int32).view(batch, blocks)
    cache = torch.randn(num_blocks, BLOCK_SIZE, dim, dtype=dtype, device=device)
    cache[0] = float("nan")
    if context % BLOCK_SIZE:
        cache[table[:, -1].to(device).long(), context % BLOCK_SIZE:] = float("nan")
    query = torch.randn(batch, NUM_HEADS, dim, dtype=dtype, device=device)
    qsl = torch.arange(batch + 1, dtype=torch.int32)
    seq = torch.full((batch,), context, dtype=torch.int32)
    pos = torch.full((batch,), context - 1, dtype=torch.int64)
    slots = table[:, -1].long() * BLOCK_SIZE + (context - 1) % BLOCK_SIZE
    common = CommonAttentionMetadata(
        query_start_loc=qsl.to(device), query_start_loc_cpu=qsl, seq_lens=seq.to(device),
        seq_lens_cpu=seq, num_reqs=batch, num_actual_tokens=batch, max_query_len=1,
        max_seq_len=context, block_table=table.to(device), slot_mapping=slots.to(device),
        positions=pos.to(device),
    )
    return cache, query, common


def _plans(common: Any, device: torch.device, dtype: torch.dtype) -> tuple[Any, Any]:
    from pagedcore_triton.mla import TritonMLABackend

    from pagedcore.kv_cache.spec import MLAAttentionSpec
    from pagedcore.reference.mla import ReferenceMLABackend

    spec = MLAAttentionSpec(block_size=BLOCK_SIZE, kv_lora_rank=LATENT, rope_head_dim=ROPE,
                            dtype=dtype)
    layer = ["model.layers.0.self_attn"]
    meta = TritonMLABackend.get_builder_cls()(spec, layer, device).build(common)
    ref = ReferenceMLABackend.get_builder_cls()(spec, layer, device).build(common)
    return meta, ref


def _impl(config: Any, kv_cache_dtype: str = "auto", k_scale: float = 1.0) -> Any:
    from pagedcore_triton.mla import TritonMLAImpl

    impl = TritonMLAImpl(NUM_HEADS, LATENT + ROPE, (128 + ROPE) ** -0.5, kv_lora_rank=LATENT,
                         kv_cache_dtype=kv_cache_dtype, k_scale=k_scale, v_scale=k_scale)
    impl.kernel_config = config
    return impl


def quantized_cache(cache: torch.Tensor, kv_cache_dtype: str) -> tuple[torch.Tensor, float]:
    """`cache` stored as `kv_cache_dtype` (``"auto"``: unchanged, scale 1.0): the fp8 rows
    ``quantize_fp8(row, k_scale)`` with ``k_scale = max|row| / fp8 max`` (NaN slots stay
    NaN), and that scale."""
    import torch

    if kv_cache_dtype == "auto":
        return cache, 1.0
    from pagedcore.attention.kv_quant import (
        FP8_MAX,
        kv_cache_torch_dtype,
        normalize_kv_cache_dtype,
        quantize_fp8,
    )

    name = normalize_kv_cache_dtype(kv_cache_dtype)
    amax = float(torch.nan_to_num(cache.float(), nan=0.0).abs().amax())
    scale = max(amax / FP8_MAX[name], 1e-12)
    return quantize_fp8(cache, scale, kv_cache_torch_dtype(name, cache.dtype)), scale


def resolve_variants(names: str | None) -> list[Any]:
    """``None`` -> the shipped default; ``"all"`` -> every config; else comma-separated names."""
    from pagedcore_triton.mla import DEFAULT_MLA_KERNEL, MLA_KERNEL_CONFIGS

    if names is None:
        return [DEFAULT_MLA_KERNEL]
    if names == "all":
        return list(MLA_KERNEL_CONFIGS.values())
    out = []
    for name in names.split(","):
        if name not in MLA_KERNEL_CONFIGS:
            raise ValueError(f"unknown MLA kernel variant {name!r}; known: "
                             f"{', '.join(MLA_KERNEL_CONFIGS)} (or 'all')")
        out.append(MLA_KERNEL_CONFIGS[name])
    return out


def warm_variant(config: Any, device: torch.device, *, quick: bool = False) -> None:
    """Compile `config`'s kernels as the timing will launch them: every bench case with each of
    its split targets (the merge kernel's chunk depends on the split count)."""
    import torch

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    for batch, context in QUICK_CASES if quick else FULL_CASES:
        cache, query, common = _decode_batch(batch, context, device, dtype)
        meta, _ = _plans(common, device, dtype)
        for cfg in _target_configs(config, quick=quick):
            _impl(cfg).forward(query, query, query, cache, meta)
        del cache, query
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def check_variant(config: Any, device: torch.device, *, quick: bool) -> list[dict[str, Any]]:
    """The MLA conformance specs for `config` (bf16 on CUDA, with the offsets-past-2^31 case
    unless `quick`; float32 in the interpreter), as JSON rows."""
    from pagedcore_triton.mla import TritonMLABackend, TritonMLAImpl

    from pagedcore.conformance.mla import run_mla_suite

    old = TritonMLAImpl.kernel_config
    TritonMLAImpl.kernel_config = config
    try:
        results = run_mla_suite(TritonMLABackend, device=device, quick=quick,
                                dtypes=["bfloat16"] if device.type == "cuda" else None)
    finally:
        TritonMLAImpl.kernel_config = old
    return [{"variant": config.name, "case": f"{r.spec}/{r.dtype}/bs{r.block_size}",
             "passed": r.passed, "rel_err": r.rel_err, "detail": r.detail} for r in results]


def _target_configs(config: Any, *, quick: bool, one_target: bool = False) -> list[Any]:
    """`config` with its split-KV target and with twice that (just the first when `quick` or
    `one_target`)."""
    import attrs

    base = config.split.target_programs
    targets = (base,) if quick or one_target else (base, 2 * base)
    return [attrs.evolve(config, split=attrs.evolve(config.split, target_programs=t))
            for t in targets]


def kernel_rows(
    device: torch.device,
    variants: Sequence[Any],
    *,
    quick: bool,
    copy_gbps: float | None,
    on_row: Callable[[dict[str, Any]], None] | None = None,
    one_target: bool = False,
    kv_cache_dtype: str = "auto",
) -> list[dict[str, Any]]:
    """Time every variant on every case, with its split-KV target and twice that (only the
    first with `one_target`), and check
    each result against the reference MLA. The cases are built once; the variants are the outer
    loop, so a run cut short has every shape of the first variants. The fastest row of each
    shape carries ``best_for_shape``; `on_row` sees each row as soon as it is measured.
    An fp8 `kv_cache_dtype` stores the latent cache in fp8 (`quantized_cache`); the reference
    reads the same fp8 rows, and ``kv_bytes`` counts one byte per element."""
    import torch

    from pagedcore.reference.mla import MLAImpl

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cases = []
    for batch, context in QUICK_CASES if quick else FULL_CASES:
        cache, query, common = _decode_batch(batch, context, device, dtype)
        cache, k_scale = quantized_cache(cache, kv_cache_dtype)
        meta, ref_meta = _plans(common, device, dtype)
        ref = MLAImpl(NUM_HEADS, LATENT + ROPE, (128 + ROPE) ** -0.5, kv_lora_rank=LATENT,
                      kv_cache_dtype=kv_cache_dtype, k_scale=k_scale, v_scale=k_scale)
        ref_cache = cache if kv_cache_dtype != "auto" else cache.float()
        want = ref.forward(query.float(), query, query, ref_cache, ref_meta).float()
        cases.append((batch, context, cache, query, meta, want, k_scale))
    rows: list[dict[str, Any]] = []
    for config in variants:
        for batch, context, cache, query, meta, want, k_scale in cases:
            kv_bytes = batch * context * (LATENT + ROPE) * cache.element_size()
            for cfg in _target_configs(config, quick=quick, one_target=one_target):
                impl = _impl(cfg, kv_cache_dtype, k_scale)
                plan = impl.plan_launch(query, meta)
                splits, split_len = plan.splits, plan.split_len
                row: dict[str, Any] = {
                    "variant": config.name, "batch": batch, "context": context,
                    "block_n": cfg.block_n,
                    "num_stages": cfg.num_stages, "maxnreg": cfg.maxnreg,
                    "lat_split": cfg.lat_split, "pdl": cfg.pdl,
                    "merge_chunk": cfg.merge_chunk, "fused_fanin": cfg.fused_fanin,
                    "num_warps": cfg.launch_warps(splits, split_len),
                    "target_programs": cfg.split.target_programs, "num_splits": splits,
                    "heads_per_program": plan.heads_per_program,
                    "half_partials": cfg.half_partials,
                    "kv_cache_dtype": kv_cache_dtype,
                    "kv_bytes": kv_bytes,
                }
                del plan
                measure_row(row, _forward_fn(impl, query, cache, meta), want, device,
                            copy_gbps=copy_gbps, after_first=_kernels_of(impl))
                rows.append(row)
                if on_row is not None:
                    on_row(row)
    mark_best(rows)
    del cases
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def measure_row(
    row: dict[str, Any], forward: Callable[[], Any], want: torch.Tensor, device: torch.device,
    *, copy_gbps: float | None,
    after_first: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Fill `row` (which has ``kv_bytes``) from one `forward` call checked against `want`
    (relative error; rows past ``want``'s are padding) and its timing; an exception (a
    configuration the device cannot run) becomes ``row["error"]``."""
    from pagedcore.bench.kernel_primitives import time_ms

    try:
        got = forward()[: want.shape[0]].float()
        rel = float((got - want).norm() / want.norm())
        if after_first is not None:
            after_first(row)
        ms = time_ms(forward, device)
    except Exception as exc:  # reported in the row, the bench goes on
        row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    else:
        gbps = row["kv_bytes"] / ms / 1e6
        row.update(ms=ms, kv_GBps=gbps, rel_err=rel,
                   pct_copy=None if copy_gbps is None else 100 * gbps / copy_gbps)
    return row


def breakdown_rows(
    device: torch.device,
    variants: Sequence[Any],
    *,
    quick: bool,
    copy_gbps: float | None,
    on_row: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """Per variant and shape (at the variant's own split target): device time of the decode
    kernel alone, of the merge kernel alone (split shapes) and of the whole ``forward``, so
    that a shape's gap to the copy bandwidth can be put on one kernel or the other; on CUDA
    also the ``forward`` replayed from a captured CUDA graph (``forward_graph_ms``), the way
    the engine runs decode steps (back-to-back launches are the bench's headline figure)."""
    import attrs
    import torch

    from pagedcore.bench.kernel_primitives import graph_time_ms, time_ms

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows: list[dict[str, Any]] = []
    for batch, context in QUICK_CASES if quick else FULL_CASES:
        cache, query, common = _decode_batch(batch, context, device, dtype)
        meta, _ = _plans(common, device, dtype)
        kv_bytes = batch * context * (LATENT + ROPE) * cache.element_size()
        for config in variants:
            impl = _impl(config)
            launch = impl.plan_launch(query, meta)
            out = query.new_empty(batch, NUM_HEADS, LATENT)
            row: dict[str, Any] = {"variant": config.name, "batch": batch, "context": context,
                                   "num_splits": launch.splits,
                                   "heads_per_program": launch.heads_per_program,
                                   "kv_bytes": kv_bytes}
            row["decode_ms"] = time_ms(
                functools.partial(impl.launch_decode, launch, query, cache, meta, out), device)
            # The decode's fixed cost: the same grid with empty segments (queries loaded,
            # no cache rows, partials or output written).
            empty = attrs.evolve(launch, split_len=0)
            row["empty_decode_ms"] = time_ms(
                functools.partial(impl.launch_decode, empty, query, cache, meta, out), device)
            if launch.splits > 1 and launch.counters is None:  # else merged in the decode
                row["merge_ms"] = time_ms(functools.partial(impl.launch_merge, launch, out),
                                          device)
            row["forward_ms"] = time_ms(_forward_fn(impl, query, cache, meta), device)
            if device.type == "cuda":  # as the engine runs decode steps: a captured graph
                try:
                    row["forward_graph_ms"] = graph_time_ms(
                        _forward_fn(impl, query, cache, meta), device)
                except RuntimeError as exc:  # a variant that cannot be captured: say so
                    row["forward_graph_error"] = f"{type(exc).__name__}: {exc}"
            if copy_gbps is not None:
                for key in ("decode", "forward", "forward_graph"):
                    if f"{key}_ms" in row:
                        gbps = kv_bytes / row[f"{key}_ms"] / 1e6
                        row[f"{key}_pct_copy"] = 100 * gbps / copy_gbps
            rows.append(row)
            if on_row is not None:
                on_row(row)
        del cache, query
    return rows


def mark_best(rows: list[dict[str, Any]]) -> None:
    """Flag the fastest correct row of each shape with ``best_for_shape``."""
    shapes: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for r in rows:
        if "ms" in r and r["rel_err"] < 3e-2:
            shapes.setdefault((r["batch"], r["context"]), []).append(r)
    for timed in shapes.values():
        min(timed, key=lambda r: r["ms"])["best_for_shape"] = True


def kernel_resources(compiled: Any) -> dict[str, Any]:
    """Registers per thread, spills and shared memory of a compiled Triton kernel (what
    decides how many programs fit on an SM); empty under the interpreter."""
    out: dict[str, Any] = {}
    meta = getattr(compiled, "metadata", None)
    for key, obj, attr in (("regs", compiled, "n_regs"), ("spills", compiled, "n_spills"),
                           ("shared", meta, "shared"), ("num_warps", meta, "num_warps")):
        value = getattr(obj, attr, None)
        if isinstance(value, int):
            out[key] = value
    ptx = getattr(compiled, "asm", {}).get("ptx", "")
    if isinstance(ptx, str) and ptx:
        out["mma"] = ("wgmma" if "wgmma.mma_async" in ptx else
                      "mma.sync" if "mma.sync" in ptx else "none")
    return out


def _forward_fn(impl: Any, query: torch.Tensor, cache: torch.Tensor, meta: Any) -> Any:
    return lambda: impl.forward(query, query, query, cache, meta)


def _kernels_of(impl: Any) -> Callable[[dict[str, Any]], None]:
    """Record the resources of the kernels `impl` launched last into a row."""
    def record(row: dict[str, Any]) -> None:
        row["kernels"] = [kernel_resources(k) for k in impl.last_kernels]

    return record


def summarize(rows: list[dict[str, Any]], target_pct: float = 80.0) -> dict[str, Any]:
    """Best % of copy per shape (any variant), per variant its worst shape's best %, and the
    variant with the best mean over the shapes."""
    best: dict[str, float] = {}
    per_variant: dict[str, dict[str, float]] = {}
    for r in rows:
        if r.get("pct_copy") is None or r.get("rel_err", 1.0) >= 3e-2:
            continue
        shape = f"{r['batch']}x{r['context']}"
        best[shape] = max(best.get(shape, 0.0), round(r["pct_copy"], 1))
        v = per_variant.setdefault(r["variant"], {})
        v[shape] = max(v.get(shape, 0.0), round(r["pct_copy"], 1))
    worst = {k: min(v.values()) for k, v in per_variant.items()}
    return {
        "best_pct_of_copy_per_shape": best,
        "variant_pct_of_copy_per_shape": per_variant,
        "variant_worst_shape_pct": worst,
        # The variant with the highest mean % of copy over the shapes (the one to ship).
        "best_variant": max(per_variant, key=lambda k: sum(per_variant[k].values()),
                            default=None),
        "target_pct": target_pct,
        "met": bool(best) and min(best.values()) >= target_pct,
    }


def append_json_line(path: str, row: dict[str, Any]) -> None:
    """Append one row as a JSON line (results survive a run cut short)."""
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")

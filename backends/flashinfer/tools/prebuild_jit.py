"""Build, in one parallel ninja pass, every FlashInfer JIT module a pagedcore run will load.

FlashInfer builds a kernel module the first time a wrapper plans with a new combination of
dtype, head size, window and soft-cap, one module at a time; a conformance run therefore waits
for ~14 serial builds. This tool lists those modules up front (from the backends' own
declarations, through the conformance case list) and hands them to FlashInfer's
``build_jit_specs`` as one ninja graph, so all their objects compile in parallel
(``MAX_JOBS``). With ``--pack FILE`` it also writes the built ``.so`` files as a tar.xz laid
out like FlashInfer's AOT directory (``aot/<module>/<module>.so``): unpacked into
``<flashinfer>/data/``, FlashInfer loads them without building (see README.md); ``--as-aot``
links them there on this machine, so that their first use does not rebuild them.

    python backends/flashinfer/tools/prebuild_jit.py --list
    MAX_JOBS=16 python backends/flashinfer/tools/prebuild_jit.py --prefill fa2 --mla
    python backends/flashinfer/tools/prebuild_jit.py --no-conformance --mla --extra bfloat16:64
    python backends/flashinfer/tools/prebuild_jit.py --prefill fa2 --mla --pack fi_aot.tar.xz
    python backends/flashinfer/tools/prebuild_jit.py --no-conformance --extra bfloat16:128 \
        --pack fi_aot.tar.xz --pack-only

``--prefill`` names the prefill wrapper's kernels (``fa2``, ``fa3`` or both, comma-separated);
the tensor-core decode always uses the FA2 module of the same variant. Needs only the CPU and
``nvcc`` (set ``FLASHINFER_CUDA_ARCH_LIST=9.0`` for the H200).
"""

from __future__ import annotations

import argparse
import os
import sys
import tarfile
import time
from typing import Any

#: dtype, head size, sliding window, soft-cap, KV-cache dtype ("auto" or an fp8 name).
Variant = tuple[str, int, bool, bool, str]


def conformance_variants(only: str | None = None) -> list[Variant]:
    """The (dtype, head size, window, soft-cap, cache dtype) kernel variants of the flashinfer
    backend's full conformance suite on CUDA, in case order (of the cases whose name has
    `only`)."""
    from pagedcore_flashinfer import FlashInferBackend

    from pagedcore.conformance.cases import build_cases

    seen: list[Variant] = []
    for case in build_cases(FlashInferBackend, quick=False, device="cuda"):
        if only is not None and only not in case.name:
            continue
        v = (case.dtype, case.head_size, case.sliding_window is not None,
             case.logits_soft_cap is not None, case.kv_cache_dtype)
        if v not in seen:
            seen.append(v)
    return seen


def mla_variants() -> list[tuple[str, int, int]]:
    """(dtype, kv_lora_rank, rope_head_dim) of the flashinfer_mla backend's conformance."""
    from pagedcore_flashinfer.mla_backend import FlashInferMLABackend

    dims = FlashInferMLABackend.supported_mla_dims or ()
    return [(d, lat, rope) for d in FlashInferMLABackend.supported_dtypes for lat, rope in dims]


def jit_specs(prefill: list[str], mla: bool, extra: list[Variant] | None = None, *,
              conformance: bool = True, only: str | None = None) -> list[Any]:
    """FlashInfer's JitSpec of every module those variants (the conformance ones unless not
    `conformance`, then `extra`) load: the FA2 module (decode, fa2 prefill), the FA3 prefill
    module, MLA."""
    import torch
    from flashinfer.jit.attention import modules

    from pagedcore.attention.kv_quant import kv_cache_torch_dtype

    specs: list[Any] = []
    variants = conformance_variants(only) if conformance else []
    for dtype_name, head, window, cap, kv in variants + list(extra or []):
        dtype = getattr(torch, dtype_name)
        kv_dtype = kv_cache_torch_dtype(kv, dtype)
        args = (dtype, kv_dtype, dtype, torch.int32, head, head, 0, window, cap, False)
        # The tensor-core decode wrapper and an fa2 prefill wrapper load the same module.
        specs.append(modules._gen_batch_prefill_primary_module("fa2", *args))
        # An fp8 cache's prefill always runs FA2 (FA3 takes fp8 K/V only with fp8 queries).
        if "fa3" in prefill and kv == "auto":
            specs.append(modules.gen_batch_prefill_module("fa3", *args))
    if mla:
        from pagedcore_flashinfer.mla import mla_kernel_backend

        for dtype_name, lat, rope in mla_variants():
            dtype = getattr(torch, dtype_name)
            specs.append(modules.gen_batch_mla_module(
                mla_kernel_backend(), dtype, dtype, dtype, torch.int32, lat, rope, False))
    unique: dict[str, Any] = {}
    for spec in specs:
        unique.setdefault(spec.name, spec)
    return list(unique.values())


def install_as_aot(specs: list[Any]) -> int:
    """Link each built module into FlashInfer's AOT directory (``<flashinfer>/data/aot/
    <name>/<name>.so``), where its loader takes it as is; returns how many were linked.

    Why: a module built here through `build_jit_specs` (one top-level ninja graph) is, for
    the wrapper that loads it later, a JIT module whose own ninja has no dependency log yet,
    so that ninja rebuilds it from scratch on first use (the H200 run of session 11: ~33 s
    per variant inside the conformance run, after the prebuild had built them all). An AOT
    module is loaded without asking ninja.
    """
    from flashinfer.jit import env

    linked = 0
    for spec in specs:
        so = spec.jit_library_path
        if not so.exists():
            continue  # an AOT module already (skipped by the build) or a failed one
        target = env.FLASHINFER_AOT_DIR / spec.name / f"{spec.name}.so"
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.is_symlink() or target.exists():
            target.unlink()
        target.symlink_to(so)
        linked += 1
    return linked


def pack(specs: list[Any], path: str) -> None:
    """Write the specs' built ``.so`` files as ``aot/<name>/<name>.so`` into a tar.xz."""
    with tarfile.open(path, "w:xz") as tar:
        for spec in specs:
            so = spec.jit_library_path
            if not so.exists():
                raise SystemExit(f"{spec.name} is not built ({so} missing); build it first")
            tar.add(str(so), arcname=f"aot/{spec.name}/{spec.name}.so")
    print(f"packed {len(specs)} modules into {path} ({os.path.getsize(path) / 2**20:.1f} MiB)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefill", default="fa2",
                        help="prefill kernels to build: fa2, fa3 or fa2,fa3 (default fa2)")
    parser.add_argument("--mla", action="store_true", help="also the flashinfer_mla modules")
    parser.add_argument("--no-conformance", action="store_true",
                        help="leave the conformance variants out (only --extra / --mla)")
    parser.add_argument("-k", dest="only", default=None, metavar="SUBSTR",
                        help="only the variants of conformance cases whose name has SUBSTR "
                             "(as `pagedcore conformance flashinfer -k`)")
    parser.add_argument("--extra", action="append", default=[], metavar="DTYPE:HEAD[:KV]",
                        help="one more variant without window / soft-cap, e.g. bfloat16:64 "
                             "(a model's) or bfloat16:128:fp8_e4m3 (an fp8 cache); repeatable")
    parser.add_argument("--fa3-only", default="", metavar="DTYPE:HEAD",
                        help="build FA3 prefill modules only for this plain variant")
    parser.add_argument("--list", action="store_true", help="print the modules, build nothing")
    parser.add_argument("--skip", default="",
                        help="comma-separated substrings: leave modules whose name has one out")
    parser.add_argument("--pack", metavar="FILE", help="write the built .so files as a tar.xz")
    parser.add_argument("--pack-only", action="store_true",
                        help="with --pack: build nothing, pack the modules already built")
    parser.add_argument("--as-aot", action="store_true",
                        help="link the built modules into FlashInfer's AOT directory, so "
                             "their first use loads them instead of rebuilding them")
    args = parser.parse_args(argv)
    prefill = [p.strip() for p in args.prefill.split(",") if p.strip()]
    bad = [p for p in prefill if p not in ("fa2", "fa3")]
    if bad:
        parser.error(f"--prefill takes fa2 and/or fa3, got {bad}")
    extra: list[Variant] = []
    for item in args.extra:
        dtype, _, rest = item.partition(":")
        head, _, kv = rest.partition(":")
        kv = kv or "auto"
        if (dtype not in ("float16", "bfloat16") or not head.isdigit()
                or kv not in ("auto", "fp8_e4m3", "fp8_e5m2")):
            parser.error(f"--extra takes DTYPE:HEAD[:KV] (float16 or bfloat16; auto, fp8_e4m3 "
                         f"or fp8_e5m2), got {item!r}")
        extra.append((dtype, int(head), False, False, kv))
    specs = jit_specs(prefill, args.mla, extra, conformance=not args.no_conformance,
                      only=args.only)
    if args.fa3_only:
        dtype, _, head = args.fa3_only.partition(":")
        short = {"float16": "f16", "bfloat16": "bf16"}.get(dtype, dtype)
        keep = (f"dtype_q_{short}_dtype_kv_{short}_dtype_o_{short}_dtype_idx_i32_head_dim_qk_"
                f"{head}_head_dim_vo_{head}_posenc_0_use_swa_False_use_logits_cap_False_")
        specs = [s for s in specs if not s.name.endswith("_sm90") or keep in s.name]
    skip = [s for s in args.skip.split(",") if s]
    specs = [s for s in specs if not any(k in s.name for k in skip)]
    for spec in specs:
        print(("built  " if spec.jit_library_path.exists() else "to build ") + spec.name)
    if args.list:
        return 0
    if args.pack_only:
        if not args.pack:
            parser.error("--pack-only needs --pack FILE")
        pack(specs, args.pack)
        return 0
    from flashinfer.jit.core import build_jit_specs

    start = time.perf_counter()
    build_jit_specs(specs, verbose=False, skip_prebuilt=True)
    print(f"built {len(specs)} modules in {time.perf_counter() - start:.0f} s "
          f"(MAX_JOBS={os.environ.get('MAX_JOBS', 'ninja default')})")
    if args.as_aot:
        print(f"linked {install_as_aot(specs)} modules into FlashInfer's AOT directory")
    if args.pack:
        pack(specs, args.pack)
    return 0


if __name__ == "__main__":
    sys.exit(main())

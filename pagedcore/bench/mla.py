"""`pagedcore bench mla`: what the latent cache saves, and the Triton MLA decode kernel's speed.

1. KV bytes per token, whole model, MLA (``kv_lora_rank + qk_rope_head_dim`` values per layer)
   against the same model caching decompressed per-head K (``qk_nope + qk_rope``) and V
   (``v_head_dim``), for DeepSeek-V2-Lite and DeepSeek-V3 shapes in bf16.
2. The most requests of ``--context`` tokens a ``--kv-gib`` KV budget holds, for both (whole
   blocks of 16 tokens, as the block pool allocates them).
3. On a GPU: the ``triton_mla`` decode kernel (DeepSeek-V2-Lite: 512 latent + 64 rope, 16 query
   heads, bf16, block size 16) on several batch x context shapes: achieved bandwidth (latent
   cache bytes read / time) against a measured device-to-device copy (bytes read + written /
   time), and its relative error against the reference MLA. A small sweep of tile configs
   (``BLOCK_N``, warps, stages, split-KV target) on the first shape picks the one used for the
   rest.
"""

from __future__ import annotations

import json
import subprocess
from typing import TYPE_CHECKING, Any

import attrs
import click

from pagedcore.kv_cache.spec import MLAAttentionSpec, cdiv

if TYPE_CHECKING:
    import torch

BLOCK_SIZE = 16


@attrs.frozen(kw_only=True)
class MLAModelShape:
    """The attention shapes of an MLA model that decide its KV-cache size."""

    name: str
    num_layers: int
    num_heads: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int

    def mla_bytes_per_token(self) -> int:
        """bf16 latent rows of every layer (from `MLAAttentionSpec`'s page size)."""
        spec = MLAAttentionSpec(block_size=BLOCK_SIZE, kv_lora_rank=self.kv_lora_rank,
                                rope_head_dim=self.qk_rope_head_dim, dtype="bfloat16")
        return self.num_layers * spec.page_size_bytes // BLOCK_SIZE

    def decompressed_bytes_per_token(self) -> int:
        """bf16 per-head K (nope + rope) and V of every layer."""
        k = self.qk_nope_head_dim + self.qk_rope_head_dim
        return self.num_layers * self.num_heads * (k + self.v_head_dim) * 2


MODELS = (
    MLAModelShape(name="DeepSeek-V2-Lite", num_layers=27, num_heads=16, kv_lora_rank=512,
                  qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128),
    MLAModelShape(name="DeepSeek-V3", num_layers=61, num_heads=128, kv_lora_rank=512,
                  qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128),
)

#: Decode shapes (batch, context) of the kernel bench; QUICK runs on CPU in the interpreter.
FULL_CASES = ((64, 4096), (128, 2048), (16, 16384), (4, 32768), (256, 1024))
QUICK_CASES = ((2, 64),)
#: (BLOCK_N, num_warps, num_stages, split-KV target programs) tried on the first shape.
SWEEP = ((32, 4, 2, 528), (64, 4, 2, 528), (32, 8, 2, 528), (64, 8, 2, 528), (32, 4, 3, 528),
         (32, 4, 2, 264), (32, 4, 2, 1056), (64, 8, 2, 1056))
#: Split-KV targets tried on the later shapes.
TARGETS = (264, 528, 1056)


def capacity_rows(kv_gib: float, context: int) -> list[dict[str, Any]]:
    """KV bytes per token and max concurrent requests per model, MLA vs decompressed."""
    budget = int(kv_gib * 2**30)
    rows = []
    for m in MODELS:
        mla, dec = m.mla_bytes_per_token(), m.decompressed_bytes_per_token()
        blocks = cdiv(context, BLOCK_SIZE)
        rows.append({
            "model": m.name,
            "mla_bytes_per_token": mla,
            "decompressed_bytes_per_token": dec,
            "ratio": dec / mla,
            "kv_budget_GiB": kv_gib,
            "context": context,
            "mla_max_requests": budget // (blocks * BLOCK_SIZE * mla),
            "decompressed_max_requests": budget // (blocks * BLOCK_SIZE * dec),
        })
    return rows


def _decode_batch(batch: int, context: int, device: torch.device, dtype: torch.dtype) -> Any:
    """A decode step of `batch` requests of `context` tokens over permuted blocks."""
    import torch

    from pagedcore.attention import CommonAttentionMetadata

    dim = 576
    blocks = cdiv(context, BLOCK_SIZE)
    num_blocks = 1 + batch * blocks
    table = (torch.randperm(num_blocks - 1) + 1).to(torch.int32).view(batch, blocks)
    cache = torch.randn(num_blocks, BLOCK_SIZE, dim, dtype=dtype, device=device)
    query = torch.randn(batch, 16, dim, dtype=dtype, device=device)
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


def kernel_rows(
    device: torch.device, *, quick: bool, copy_gbps: float | None
) -> list[dict[str, Any]]:
    """Time `triton_mla` decode on each case and check it against the reference.

    The first shape sweeps `SWEEP`; later shapes use its fastest tile config with each of
    `TARGETS`. The fastest row of each shape carries ``best_for_shape``.
    """
    import torch
    from pagedcore_triton.mla import TritonMLABackend, TritonMLAImpl, choose_mla_splits

    from pagedcore.bench.kernels import time_ms
    from pagedcore.kv_cache.spec import MLAAttentionSpec as Spec
    from pagedcore.reference.mla import MLAImpl, ReferenceMLABackend

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    spec = Spec(block_size=BLOCK_SIZE, kv_lora_rank=512, rope_head_dim=64, dtype=dtype)
    scale = 192**-0.5
    rows: list[dict[str, Any]] = []
    best: tuple[int, int, int, int] | None = None
    for i, (batch, context) in enumerate(QUICK_CASES if quick else FULL_CASES):
        cache, query, common = _decode_batch(batch, context, device, dtype)
        layer = ["model.layers.0.self_attn"]
        impl = TritonMLAImpl(16, 576, scale, kv_lora_rank=512)
        meta = TritonMLABackend.get_builder_cls()(spec, layer, device).build(common)
        ref_impl = MLAImpl(16, 576, scale, kv_lora_rank=512)
        ref_meta = ReferenceMLABackend.get_builder_cls()(spec, layer, device).build(common)
        want = ref_impl.forward(query, query, query, cache, ref_meta).float()
        if quick:
            configs: list[tuple[int, int, int, int]] = [SWEEP[0]]
        elif i == 0 or best is None:
            configs = list(SWEEP)
        else:  # the first shape's tile config, with each split-KV target
            configs = [(*best[:3], t) for t in TARGETS]
        kv_bytes = batch * context * 576 * cache.element_size()
        case_rows: list[dict[str, Any]] = []
        for block_n, warps, stages, target in configs:
            impl.block_n, impl.num_warps, impl.num_stages = block_n, warps, stages
            impl.split_rule = attrs.evolve(impl.split_rule, target_programs=target)
            splits = choose_mla_splits(impl.split_rule, num_tokens=batch, head_blocks=1,
                                       max_seq_len=context)
            row: dict[str, Any] = {"batch": batch, "context": context, "block_n": block_n,
                                   "num_warps": warps, "num_stages": stages,
                                   "target_programs": target, "num_splits": splits,
                                   "kv_bytes": kv_bytes}
            try:
                got = impl.forward(query, query, query, cache, meta).float()
                ms = time_ms(_forward_fn(impl, query, cache, meta), device)
            except Exception as exc:  # a config the device cannot compile is reported, not fatal
                row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                case_rows.append(row)
                continue
            gbps = kv_bytes / ms / 1e6
            row.update(ms=ms, kv_GBps=gbps,
                       pct_copy=None if copy_gbps is None else 100 * gbps / copy_gbps,
                       rel_err=float((got - want).norm() / want.norm()))
            case_rows.append(row)
        timed = [r for r in case_rows if "ms" in r]
        if timed:
            top = min(timed, key=lambda r: r["ms"])
            top["best_for_shape"] = True
            if i == 0:
                best = (top["block_n"], top["num_warps"], top["num_stages"],
                        top["target_programs"])
        rows += case_rows
        del cache, query, want
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def _forward_fn(impl: Any, query: torch.Tensor, cache: torch.Tensor, meta: Any) -> Any:
    return lambda: impl.forward(query, query, query, cache, meta)


def _print(capacity: list[dict[str, Any]], kernel: list[dict[str, Any]],
           copy_gbps: float | None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=120)
    t = Table(title="KV cache per token and concurrency (bf16, block size 16)")
    for c in ("model", "MLA B/token", "decompressed B/token", "ratio", "budget GiB", "context",
              "MLA max reqs", "decompressed max reqs"):
        t.add_column(c)
    for r in capacity:
        t.add_row(r["model"], f"{r['mla_bytes_per_token']:,}",
                  f"{r['decompressed_bytes_per_token']:,}", f"{r['ratio']:.1f}x",
                  f"{r['kv_budget_GiB']:g}", str(r["context"]), f"{r['mla_max_requests']:,}",
                  f"{r['decompressed_max_requests']:,}")
    console.print(t)
    if not kernel:
        return
    copy = "not measured" if copy_gbps is None else f"{copy_gbps:.0f} GB/s"
    k = Table(title=f"triton_mla decode, 16 heads, 512+64 (copy bandwidth {copy})")
    for c in ("batch x ctx", "BLOCK_N/warps/stages/target (splits)", "ms", "GB/s", "% copy",
              "rel err"):
        k.add_column(c)
    for r in kernel:
        cfg = (f"{r['block_n']}/{r['num_warps']}/{r['num_stages']}/{r['target_programs']} "
               f"({r['num_splits']})" + (" *" if r.get("best_for_shape") else ""))
        if "error" in r:
            k.add_row(f"{r['batch']}x{r['context']}", cfg, "error", r["error"][:40], "", "")
            continue
        pct = "" if r["pct_copy"] is None else f"{r['pct_copy']:.0f}%"
        k.add_row(f"{r['batch']}x{r['context']}", cfg, f"{r['ms']:.4f}", f"{r['kv_GBps']:.0f}",
                  pct, f"{r['rel_err']:.1e}")
    console.print(k)


@click.command()
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write figures here.")
@click.option("--quick", is_flag=True, help="Tiny kernel case (CPU: Triton interpreter).")
@click.option("--kv-gib", default=40.0, show_default=True, help="KV budget for concurrency.")
@click.option("--context", default=4096, show_default=True, help="Tokens per request.")
def mla(json_path: str | None, quick: bool, kv_gib: float, context: int) -> None:
    """MLA vs decompressed KV bytes and concurrency; Triton MLA decode bandwidth on a GPU."""
    import importlib.util

    import torch

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    capacity = capacity_rows(kv_gib, context)
    kernel: list[dict[str, Any]] = []
    copy_gbps: float | None = None
    skipped = None
    if importlib.util.find_spec("pagedcore_triton") is None:
        skipped = "pagedcore-triton is not installed"
    elif device.type == "cpu" and not quick:
        skipped = "no CUDA device (pass --quick for an interpreted smoke run)"
    else:
        if device.type == "cuda":
            from pagedcore.bench.kernels import copy_bandwidth_gbps

            copy_gbps = copy_bandwidth_gbps(device, quick=quick)
        torch.manual_seed(0)
        kernel = kernel_rows(device, quick=quick, copy_gbps=copy_gbps)
    if skipped:
        click.echo(f"kernel bench skipped: {skipped}", err=True)
    _print(capacity, kernel, copy_gbps)
    if json_path:
        command = ["pagedcore bench mla"] + (["--quick"] if quick else [])
        command += [f"--kv-gib {kv_gib:g}", f"--context {context}", f"--json {json_path}"]
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True)
        info = {
            "command": " ".join(command),
            "git_commit": commit.stdout.strip() if commit.returncode == 0 else None,
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "torch": torch.__version__,
            "copy_bandwidth_GBps": copy_gbps,
            "kernel_config": {"dtype": "bfloat16" if device.type == "cuda" else "float32",
                              "num_heads": 16, "kv_lora_rank": 512, "rope_head_dim": 64,
                              "block_size": BLOCK_SIZE,
                              "bandwidth": "latent cache bytes read / median kernel time "
                                           "(pagedcore.bench.kernels.time_ms)"},
            "kernel_skipped": skipped,
            "capacity": capacity,
            "kernel": kernel,
        }
        with open(json_path, "w") as f:
            json.dump(info, f, indent=2)
        click.echo(f"wrote {json_path}")

"""`pagedcore bench mla`: what the latent cache saves, and the Triton MLA decode kernel's speed.

1. KV bytes per token, whole model, MLA (``kv_lora_rank + qk_rope_head_dim`` values per layer)
   against the same model caching decompressed per-head K (``qk_nope + qk_rope``) and V
   (``v_head_dim``), for DeepSeek-V2-Lite and DeepSeek-V3 shapes in bf16.
2. The most requests of ``--context`` tokens a ``--kv-gib`` KV budget holds, for both (whole
   blocks of 16 tokens, as the block pool allocates them).
3. On a GPU: the ``triton_mla`` decode kernel variants (``--variants``; DeepSeek-V2-Lite: 512
   latent + 64 rope, 16 query heads, bf16, block size 16) on several batch x context shapes:
   achieved bandwidth (latent cache bytes read / time) against a measured device-to-device copy
   (bytes read + written / time), and their relative error against the reference MLA
   (`pagedcore.bench.mla_kernel`). ``--check`` adds the MLA conformance specs per variant.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

import attrs
import click

from pagedcore.bench.report import git_commit
from pagedcore.cli_progress import progress_bar
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

    def mla_bytes_per_token(self, dtype: str = "bfloat16") -> int:
        """Latent rows of every layer in `dtype` (a torch dtype name: ``"bfloat16"``, or
        ``"float8_e4m3fn"`` for an fp8 latent cache), from `MLAAttentionSpec`'s page size."""
        spec = MLAAttentionSpec(block_size=BLOCK_SIZE, kv_lora_rank=self.kv_lora_rank,
                                rope_head_dim=self.qk_rope_head_dim, dtype=dtype)
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

def capacity_rows(kv_gib: float, context: int) -> list[dict[str, Any]]:
    """KV bytes per token and max concurrent requests per model, MLA vs decompressed."""
    budget = int(kv_gib * 2**30)
    rows = []
    for m in MODELS:
        mla, dec = m.mla_bytes_per_token(), m.decompressed_bytes_per_token()
        fp8 = m.mla_bytes_per_token("float8_e4m3fn")
        blocks = cdiv(context, BLOCK_SIZE)
        rows.append({
            "model": m.name,
            "mla_bytes_per_token": mla,
            "mla_fp8_bytes_per_token": fp8,
            "mla_fp8_max_requests": budget // (blocks * BLOCK_SIZE * fp8),
            "decompressed_bytes_per_token": dec,
            "ratio": dec / mla,
            "kv_budget_GiB": kv_gib,
            "context": context,
            "mla_max_requests": budget // (blocks * BLOCK_SIZE * mla),
            "decompressed_max_requests": budget // (blocks * BLOCK_SIZE * dec),
        })
    return rows


def _print(capacity: list[dict[str, Any]], kernel: list[dict[str, Any]],
           copy_gbps: float | None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=120)
    t = Table(title="KV cache per token and concurrency (bf16 unless fp8, block size 16)")
    for c in ("model", "MLA B/token", "decompressed B/token", "ratio", "budget GiB", "context",
              "MLA max reqs", "MLA fp8 max reqs", "decompressed max reqs"):
        t.add_column(c)
    for r in capacity:
        t.add_row(r["model"], f"{r['mla_bytes_per_token']:,}",
                  f"{r['decompressed_bytes_per_token']:,}", f"{r['ratio']:.1f}x",
                  f"{r['kv_budget_GiB']:g}", str(r["context"]), f"{r['mla_max_requests']:,}",
                  f"{r['mla_fp8_max_requests']:,}", f"{r['decompressed_max_requests']:,}")
    console.print(t)
    if not kernel:
        return
    copy = "not measured" if copy_gbps is None else f"{copy_gbps:.0f} GB/s"
    k = Table(title=f"triton_mla decode, 16 heads, 512+64 (copy bandwidth {copy})")
    for c in ("batch x ctx", "variant", "target (splits)", "ms", "GB/s", "% copy", "rel err"):
        k.add_column(c)
    for r in kernel:
        cfg = f"{r['target_programs']} ({r['num_splits']})"
        name = r["variant"] + (" *" if r.get("best_for_shape") else "")
        if "error" in r:
            k.add_row(f"{r['batch']}x{r['context']}", name, cfg, "error", r["error"][:40], "",
                      "")
            continue
        pct = "" if r["pct_copy"] is None else f"{r['pct_copy']:.0f}%"
        k.add_row(f"{r['batch']}x{r['context']}", name, cfg, f"{r['ms']:.4f}",
                  f"{r['kv_GBps']:.0f}", pct, f"{r['rel_err']:.1e}")
    console.print(k)


def _kernel_part(
    device: torch.device, variants: str | None, *, quick: bool, check: bool, warm: bool,
    time_it: bool, json_path: str | None, breakdown: str | None = None,
    one_target: bool = False, kv_cache_dtype: str = "auto",
) -> dict[str, Any]:
    """Warm-up, conformance and timing of the selected decode variants (see `mla_kernel`)."""
    from pagedcore.bench import mla_kernel as mk

    configs = mk.resolve_variants(variants)
    split_configs = mk.resolve_variants(breakdown) if breakdown else []
    out: dict[str, Any] = {"variants": [attrs.asdict(c) for c in configs]}
    if warm:
        for c in configs:
            mk.warm_variant(c, device, quick=device.type != "cuda")
    if check:
        out["conformance"] = [row for c in configs
                              for row in mk.check_variant(c, device, quick=quick)]
        failed = [r for r in out["conformance"] if not r["passed"]]
        click.echo(f"conformance: {len(out['conformance']) - len(failed)} passed, "
                   f"{len(failed)} failed", err=True)
        for r in failed:
            click.echo(f"  FAIL {r['variant']} {r['case']}: {r['detail']}", err=True)
    if time_it:
        copy_gbps = None
        if device.type == "cuda":
            from pagedcore.bench.kernel_primitives import copy_bandwidth_gbps

            copy_gbps = copy_bandwidth_gbps(device, quick=quick)
            click.echo(f"copy bandwidth {copy_gbps:.0f} GB/s", err=True)
        lines = f"{json_path}.rows.jsonl" if json_path else None
        if lines and os.path.exists(lines):
            os.remove(lines)

        def on_row(row: dict[str, Any]) -> None:
            click.echo(f"  {row['variant']:>10} {row['batch']}x{row['context']} "
                       f"target {row['target_programs']}: "
                       + (row["error"] if "error" in row else
                          f"{row['ms']:.4f} ms {row['kv_GBps']:.0f} GB/s "
                          + ("" if row["pct_copy"] is None else f"{row['pct_copy']:.1f}% ")
                          + f"rel {row['rel_err']:.1e} {row.get('kernels', '')}"), err=True)
            if lines:
                mk.append_json_line(lines, row)

        out["copy_bandwidth_GBps"] = copy_gbps
        out["kernel"] = mk.kernel_rows(device, configs, quick=quick, copy_gbps=copy_gbps,
                                       on_row=on_row, one_target=one_target,
                                       kv_cache_dtype=kv_cache_dtype)
        out["summary"] = mk.summarize(out["kernel"])
    if split_configs:
        if "copy_bandwidth_GBps" not in out and device.type == "cuda":
            from pagedcore.bench.kernel_primitives import copy_bandwidth_gbps

            out["copy_bandwidth_GBps"] = copy_bandwidth_gbps(device, quick=quick)
        out["breakdown"] = mk.breakdown_rows(device, split_configs,
                                             quick=quick,
                                             copy_gbps=out.get("copy_bandwidth_GBps"),
                                             on_row=_echo_breakdown)
    return out


def _backend_part(device: torch.device, classes: list[Any], *, quick: bool) -> dict[str, Any]:
    """Copy bandwidth (CUDA) and the side-by-side rows of `classes` (see `mla_backends`)."""
    from pagedcore.bench.mla_backends import backend_rows

    copy_gbps = None
    if device.type == "cuda":
        from pagedcore.bench.kernel_primitives import copy_bandwidth_gbps

        copy_gbps = copy_bandwidth_gbps(device, quick=quick)
        click.echo(f"copy bandwidth {copy_gbps:.0f} GB/s", err=True)

    def on_row(row: dict[str, Any]) -> None:
        shape = f"{row['backend']:>16} {row['batch']}x{row['context']}"
        if "error" in row:
            click.echo(f"  {shape}: {row['error']}", err=True)
        else:
            pct = "" if row["pct_copy"] is None else f" {row['pct_copy']:.1f}% of copy"
            click.echo(f"  {shape}: {row['ms']:.4f} ms {row['kv_GBps']:.0f} GB/s{pct} "
                       f"rel {row['rel_err']:.1e}", err=True)

    rows = backend_rows(device, classes, quick=quick, copy_gbps=copy_gbps, on_row=on_row)
    return {"copy_bandwidth_GBps": copy_gbps, "backends": rows}


def _print_backends(rows: list[dict[str, Any]], copy_gbps: float | None) -> None:
    if not rows:
        return
    from rich.console import Console
    from rich.table import Table

    copy = "not measured" if copy_gbps is None else f"{copy_gbps:.0f} GB/s"
    t = Table(title=f"MLA backends, decode, 16 heads, 512+64 (copy bandwidth {copy})")
    for c in ("batch x ctx", "backend", "ms", "GB/s", "% copy", "rel err"):
        t.add_column(c)
    for r in rows:
        name = r["backend"] + (" *" if r.get("best_for_shape") else "")
        if "error" in r:
            t.add_row(f"{r['batch']}x{r['context']}", name, "error", r["error"][:40], "", "")
            continue
        pct = "" if r["pct_copy"] is None else f"{r['pct_copy']:.0f}%"
        t.add_row(f"{r['batch']}x{r['context']}", name, f"{r['ms']:.4f}", f"{r['kv_GBps']:.0f}",
                  pct, f"{r['rel_err']:.1e}")
    Console(width=120).print(t)


def _echo_breakdown(row: dict[str, Any]) -> None:
    keys = ("decode", "empty_decode", "merge", "forward", "forward_graph")
    parts = [f"{k} {row[f'{k}_ms'] * 1e3:.1f} us" for k in keys if f"{k}_ms" in row]
    pct = row.get("forward_pct_copy")
    click.echo(f"  breakdown {row['variant']:>10} {row['batch']}x{row['context']} "
               f"splits {row['num_splits']}: " + ", ".join(parts)
               + ("" if pct is None else f" ({pct:.1f}% of copy)"), err=True)


@click.command()
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write figures here.")
@click.option("--quick", is_flag=True, help="Tiny kernel case (CPU: Triton interpreter).")
@click.option("--kv-gib", default=40.0, show_default=True, help="KV budget for concurrency.")
@click.option("--context", default=4096, show_default=True, help="Tokens per request.")
@click.option("--variants", default=None,
              help="Decode kernel variants to time: comma-separated names of "
                   "pagedcore_triton.mla.MLA_KERNEL_CONFIGS, or 'all' [default: the shipped one].")
@click.option("--check", is_flag=True, help="Also run the MLA conformance specs per variant.")
@click.option("--warm", is_flag=True, help="First compile each variant at the bench shapes.")
@click.option("--no-time", is_flag=True, help="Skip the timing (e.g. with --warm/--check).")
@click.option("--breakdown", default=None,
              help="Variants (comma-separated, or 'all') whose decode and merge kernels are "
                   "also timed alone per shape.")
@click.option("--one-target", is_flag=True,
              help="Time each variant at its own split target only (not also at twice it).")
@click.option("--backend", "backends", multiple=True, metavar="NAME",
              help="Time these MLA backends side by side through their builder and impl "
                   "(repeatable, e.g. --backend triton_mla --backend flashinfer_mla) on a "
                   "small set of decode shapes, instead of the Triton variants.")
@click.option("--kv-cache-dtype", type=click.Choice(["auto", "fp8", "fp8_e4m3", "fp8_e5m2"]),
              default="auto", show_default=True,
              help="Latent cache dtype of the Triton variants' timing (fp8: one byte per "
                   "element, dequantized inside the kernel).")
def mla(json_path: str | None, quick: bool, kv_gib: float, context: int, variants: str | None,
        check: bool, warm: bool, no_time: bool, breakdown: str | None, one_target: bool,
        backends: tuple[str, ...], kv_cache_dtype: str) -> None:
    """MLA vs decompressed KV bytes and concurrency; Triton MLA decode bandwidth on a GPU, or
    several MLA backends side by side (--backend)."""
    import importlib.util

    import torch

    from pagedcore.attention.kv_quant import normalize_kv_cache_dtype

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    capacity = capacity_rows(kv_gib, context)
    kernel: dict[str, Any] = {}
    skipped = None
    if backends:
        from pagedcore.bench.mla_backends import resolve_mla_backends

        try:
            classes = resolve_mla_backends(backends, device)
        except ValueError as exc:
            raise click.UsageError(str(exc)) from exc
        if device.type == "cpu" and not quick:
            skipped = "no CUDA device (pass --quick for a tiny CPU run)"
        else:
            torch.manual_seed(0)
            kernel = _backend_part(device, classes, quick=quick)
    elif importlib.util.find_spec("pagedcore_triton") is None:
        skipped = "pagedcore-triton is not installed"
    elif device.type == "cpu" and not quick:
        skipped = "no CUDA device (pass --quick for an interpreted smoke run)"
    else:
        torch.manual_seed(0)
        click.get_current_context().with_resource(progress_bar("bench mla", None))
        try:
            kernel = _kernel_part(device, variants, quick=quick, check=check, warm=warm,
                                  time_it=not no_time, json_path=json_path,
                                  breakdown=breakdown, one_target=one_target,
                                  kv_cache_dtype=normalize_kv_cache_dtype(kv_cache_dtype))
        except ValueError as exc:
            raise click.UsageError(str(exc)) from exc
    if skipped:
        click.echo(f"kernel bench skipped: {skipped}", err=True)
    _print(capacity, kernel.get("kernel", []), kernel.get("copy_bandwidth_GBps"))
    _print_backends(kernel.get("backends", []), kernel.get("copy_bandwidth_GBps"))
    if json_path:
        command = ["pagedcore bench mla"] + (["--quick"] if quick else [])
        command += [f"--kv-gib {kv_gib:g}", f"--context {context}"]
        command += [f"--variants {variants}"] if variants else []
        command += [f for f, on in (("--check", check), ("--warm", warm),
                                    ("--no-time", no_time), ("--one-target", one_target))
                    if on]
        command += [f"--breakdown {breakdown}"] if breakdown else []
        command += [f"--backend {b}" for b in backends]
        command += [f"--kv-cache-dtype {kv_cache_dtype}"] if kv_cache_dtype != "auto" else []
        command += [f"--json {json_path}"]
        info = {
            "command": " ".join(command),
            "git_commit": git_commit(),
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "torch": torch.__version__,
            "kernel_config": {"dtype": "bfloat16" if device.type == "cuda" else "float32",
                              "kv_cache_dtype": normalize_kv_cache_dtype(kv_cache_dtype),
                              "num_heads": 16, "kv_lora_rank": 512, "rope_head_dim": 64,
                              "block_size": BLOCK_SIZE,
                              "bandwidth": "latent cache bytes read / median device time of "
                                           "forward (pagedcore.bench.kernel_primitives."
                                           "time_ms)"},
            "kernel_skipped": skipped,
            "capacity": capacity,
            "kernel": [],
            **kernel,
        }
        with open(json_path, "w") as f:
            json.dump(info, f, indent=2)
        click.echo(f"wrote {json_path}")

"""Fused attention (rotary, QKV) against the modules it replaces, on the GPU.

    python docs/benchmarks/fused_check.py OUT_JSON [--quick]

For the Qwen2-0.5B shape and a 4-layer Llama-3-8B shape (seeded random weights, bf16,
initializer_range 0.1): the model with the fused norms and MLP (what main swaps), the same
plus the fused rotary kernel, plus the one-GEMM QKV; the one-GEMM gate/up alone; the
residual add fused into the norm alone; that with the second residual add inside the down
projection (``down_add``, with the one-GEMM gate/up); everything. Logits of a 64-token
prefill and of a batch of 64 single tokens are compared bit for bit and by relative error
against the first; eager forward time of one decode token (launch-bound) is timed for each.
``--quick``: the 0.5B shape only, the rotary-only, down_add and all-kinds variants.
"""

from __future__ import annotations

import copy
import json
import sys
import time
from typing import Any

import torch

from pagedcore.engine.models.fused_attention import swap_fused_attention
from pagedcore.engine.models.fused_decoder import swap_fused_decoder_layers
from pagedcore.engine.models.fused_ops import FUSED_KINDS, swap_fused_modules
from pagedcore.engine.models.loading import llama3_8b_config, qwen2_0_5b_config, random_model


def timed(model: Any, ids: torch.Tensor, reps: int = 20) -> float:
    with torch.no_grad():
        for _ in range(3):
            model(ids)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            model(ids)
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1e3


def main() -> None:
    out_path = sys.argv[1] if len(sys.argv) > 1 else "fused_check.json"
    quick = "--quick" in sys.argv
    dev = torch.device("cuda")
    report: dict[str, Any] = {"command": " ".join(sys.argv), "shapes": {}}
    shapes = {"qwen2-0.5b": qwen2_0_5b_config(initializer_range=0.1),
              "llama3-8b-4layers": llama3_8b_config(initializer_range=0.1, num_hidden_layers=4)}
    if quick:
        del shapes["llama3-8b-4layers"]
    for name, config in shapes.items():
        raw = random_model(config, dtype=torch.bfloat16, device=dev)
        main_kinds = frozenset({"rms_norm", "silu_mul"})
        base = copy.deepcopy(raw)
        swap_fused_modules(base, kinds=main_kinds)
        variants: dict[str, Any] = {}
        rows: dict[str, Any] = {}
        cases: list[tuple[str, set[str]]] = [
            ("rotary", {"rotary"}), ("rotary+qkv", {"rotary", "qkv"}), ("gate_up", {"gate_up"}),
            ("add_rms_norm", {"add_rms_norm"}),
            ("down_add", {"add_rms_norm", "gate_up", "down_add"}), ("all", set(FUSED_KINDS))]
        if quick:
            cases = [cases[0], cases[-2], cases[-1]]
        for label, extra in cases:
            kinds = main_kinds | extra
            model = copy.deepcopy(raw)
            counts = swap_fused_modules(model, kinds=kinds)
            if "rotary" in kinds:
                counts.update(swap_fused_attention(model, fuse_qkv="qkv" in kinds))
            if "add_rms_norm" in kinds:
                counts["add_rms_norm"] = swap_fused_decoder_layers(
                    model, down_add="down_add" in kinds)
            rows[f"counts/{label}"] = counts
            variants[label] = model
        del raw
        gen = torch.Generator().manual_seed(0)
        prefill = torch.randint(10, 1000, (1, 64), generator=gen).to(dev)
        tokens = torch.randint(10, 1000, (64, 1), generator=gen).to(dev)
        one = prefill[:, :1]
        with torch.no_grad():
            want = {"prefill64": base(prefill).logits, "decode64": base(tokens).logits}
            for label, model in variants.items():
                for case, ids in (("prefill64", prefill), ("decode64", tokens)):
                    got = model(ids).logits
                    w = want[case]
                    rows[f"{label}/{case}"] = {
                        "bit_identical": bool(torch.equal(got, w)),
                        "rel_err": float((got.double() - w.double()).abs().max()
                                         / w.double().abs().max()),
                        "argmax_equal": float((got.argmax(-1) == w.argmax(-1)).float().mean()),
                        "nan": bool(got.isnan().any()),
                    }
        for label, model in {"base": base, **variants}.items():
            rows[f"eager_decode1_ms/{label}"] = timed(model, one, reps=5 if quick else 20)
        report["shapes"][name] = rows
        print(name, json.dumps(rows), flush=True)
        del base, variants
        torch.cuda.empty_cache()
        with open(out_path, "w") as fh:
            json.dump(report, fh, indent=1)


if __name__ == "__main__":
    main()

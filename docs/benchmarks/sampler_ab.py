"""Sampled rows of a decode step on the GPU: the sampler now vs the per-row draw it replaced.

    python docs/benchmarks/sampler_ab.py OUT_JSON [--rows 256] [--vocab 151936]

For `rows` bf16 logit rows over `vocab` tokens (a Qwen2-0.5B batch of 256), temperature 1.0:
the wall time of `Sampler.sample` (host launch + device work + the copy of the tokens) with
every row unseeded (one exponential draw for all of them since branch `step`), with every row
seeded (each from its own generator, as before), and the per-row loop the unseeded rows used
before (`per_row_before`: an exponential draw, a division and an argmax per row). Medians of
20 after 3 warm-ups. Also the greedy rows' time, for scale.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from typing import Any

import torch

from pagedcore.engine.sampling.sampler import Sampler
from pagedcore.engine.sampling.sampling_params import SamplingParams


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn: Any, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    _sync()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        _sync()
        out.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(out)


def per_row_before(logits: torch.Tensor, gen: torch.Generator) -> list[int]:
    """The unseeded rows' draw before: one exponential, division and argmax per row."""
    probs = (logits.float() / 1.0).softmax(dim=-1)
    tokens = logits.argmax(dim=-1)
    for row in range(probs.shape[0]):
        noise = torch.empty_like(probs[row]).exponential_(generator=gen)
        tokens[row] = (probs[row] / noise).argmax()
    return tokens.tolist()


def main() -> None:
    args = sys.argv[1:]
    out = args[0] if args else "sampler_ab.json"
    rows = int(args[args.index("--rows") + 1]) if "--rows" in args else 256
    vocab = int(args[args.index("--vocab") + 1]) if "--vocab" in args else 151936
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # (CPU: a dry run)
    logits = torch.randn(rows, vocab, device=dev, dtype=torch.bfloat16,
                         generator=torch.Generator(device=dev).manual_seed(0)) * 3
    ids = [f"r{i}" for i in range(rows)]
    sampler = Sampler(seed=0)
    cases = {
        "greedy": [SamplingParams(temperature=0.0)] * rows,
        "unseeded": [SamplingParams(temperature=1.0)] * rows,
        "seeded": [SamplingParams(temperature=1.0, seed=i) for i in range(rows)],
    }
    report: dict[str, Any] = {"rows": rows, "vocab": vocab, "device": str(dev),
                              "ms": {}}
    for name, params in cases.items():
        report["ms"][name] = timed(lambda p=params: sampler.sample(logits, p, ids))
        print(f"{name}: {report['ms'][name]:.3f} ms", flush=True)
    gen = torch.Generator(device=dev).manual_seed(0)
    report["ms"]["per_row_before"] = timed(lambda: per_row_before(logits, gen))
    print(f"per_row_before: {report['ms']['per_row_before']:.3f} ms", flush=True)
    # Same distribution: the share of each row's top token over many draws, both ways.
    small = logits[:1].repeat(4096, 1)[:, :64].float()
    new = sampler.sample(small, [SamplingParams(temperature=1.0)] * 4096,
                         [f"d{i}" for i in range(4096)])[0]
    old = per_row_before(small[:512], gen)
    top = int(small[0].argmax())
    p_top = float(small[0].softmax(-1)[top])
    report["top_token_share"] = {"expected": p_top, "now": new.count(top) / 4096,
                                 "before_512": old.count(top) / 512}
    print(report["top_token_share"], flush=True)
    with open(out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()

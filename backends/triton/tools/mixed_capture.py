"""Captured mixed steps on the GPU: the flat plan's correctness and its cost vs the classic one.

Usage: ``python backends/triton/tools/mixed_capture.py STEP OUT_DIR [--small]``, STEP one of

* ``check``: for 16- and 64-token buckets over 64 request slots (Qwen2-0.5B's attention:
  14 query / 2 KV heads of 64, bf16, block 16, max_model_len 33024), the cache write and
  `forward` captured once in a ``torch.cuda.CUDAGraph`` with the flat plan, the buffers then
  rewritten in place with other mixes (a chunk over a 16K prefix, decodes at 1-32K, a fresh
  prefill filling the bucket, a request with query length 0, padding), replayed and compared
  with a float64 formula on the real rows of a NaN-poisoned cache; padding rows untouched;
* ``time``: one layer's `forward` captured 10 times in a graph per plan (``classic`` = the
  s3b1 plan, ``flat``) and bucket (16, 64 tokens), replayed for 1 request (a 5- / 48-token
  suffix) or 4 requests (3 decodes + that suffix) at contexts 1K/4K/16K/32K: us per call.

``--small`` shrinks the shapes (a logic check, also on CPU under ``TRITON_INTERPRET=1``,
where nothing is captured). Each step rewrites OUT_DIR/STEP.json after every record.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

HEADS, KV_HEADS, HEAD_SIZE, BLOCK = 14, 2, 64, 16
SENTINEL = 7.0


class _Out:
    """Collects a step's records and rewrites OUT/STEP.json after each."""

    def __init__(self, out_dir: str, step: str) -> None:
        self.path = Path(out_dir) / f"{step}.json"
        self.t0 = time.time()
        name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        self.info: dict[str, Any] = {"step": step, "device": name, "rows": []}

    def add(self, row: dict[str, Any]) -> None:
        row["t_s"] = round(time.time() - self.t0, 1)
        self.info["rows"].append(row)
        print(json.dumps(row, default=str), flush=True)
        self.path.write_text(json.dumps(self.info, indent=1, default=str))


class _Step:
    """A captured (or, on CPU, eager) mixed step of one bucket over persistent buffers."""

    def __init__(self, *, plan: str, num_reqs: int, tokens: int, max_model_len: int,
                 cache_blocks: int, dtype: torch.dtype, layers: int = 1) -> None:
        from pagedcore_triton import TritonAttentionBackend
        from pagedcore_triton.backend import MIXED_PLAN_ENV

        from pagedcore.attention import CommonAttentionMetadata
        from pagedcore.kv_cache.spec import FullAttentionSpec

        dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.dev, self.num_reqs, self.tokens = dev, num_reqs, tokens
        self.max_blocks = -(-max_model_len // BLOCK)
        i32 = torch.int32
        self.qsl = torch.zeros(num_reqs + 1, dtype=i32, device=dev)
        self.seq_lens = torch.zeros(num_reqs, dtype=i32, device=dev)
        self.table = torch.zeros((num_reqs, self.max_blocks), dtype=i32, device=dev)
        self.slots = torch.full((tokens,), -1, dtype=torch.int64, device=dev)
        self.query = torch.zeros((tokens, HEADS, HEAD_SIZE), dtype=dtype, device=dev)
        self.key = torch.zeros((tokens, KV_HEADS, HEAD_SIZE), dtype=dtype, device=dev)
        self.value = torch.zeros_like(self.key)
        self.output = torch.zeros_like(self.query)
        self.cache = torch.full((2, cache_blocks, BLOCK, KV_HEADS, HEAD_SIZE), float("nan"),
                                dtype=dtype, device=dev)
        common = CommonAttentionMetadata(
            query_start_loc=self.qsl, query_start_loc_cpu=self.qsl.cpu(),
            seq_lens=self.seq_lens, seq_lens_cpu=self.seq_lens.cpu(), num_reqs=num_reqs,
            num_actual_tokens=tokens, max_query_len=tokens, max_seq_len=max_model_len,
            block_table=self.table, slot_mapping=self.slots,
            positions=torch.zeros(tokens, dtype=torch.int64, device=dev),
        )
        spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD_SIZE,
                                 dtype=dtype)
        builder = TritonAttentionBackend.get_builder_cls()(spec, ["l0"], dev)
        saved = os.environ.get(MIXED_PLAN_ENV)
        os.environ[MIXED_PLAN_ENV] = plan
        try:
            self.metadata = builder.build_for_cudagraph_capture(common)
        finally:
            if saved is None:
                del os.environ[MIXED_PLAN_ENV]
            else:
                os.environ[MIXED_PLAN_ENV] = saved
        self.impl = TritonAttentionBackend.get_impl_cls()(
            HEADS, HEAD_SIZE, HEAD_SIZE**-0.5, num_kv_heads=KV_HEADS)
        self.layers = layers
        self.graph: Any = None

    def part(self) -> dict[str, Any]:
        (p,) = self.metadata.parts
        launch = next(iter(self.metadata.launches.values()), None)
        return {"segments": p.num_segments, "flat": p.flat_programs,
                "grid": None if launch is None else launch.grid}

    def _run(self, write: bool) -> None:
        if write:
            self.impl.do_kv_cache_update(self.key, self.value, self.cache, self.slots)
        for _ in range(self.layers):
            self.impl.forward(self.query, self.key, self.value, self.cache, self.metadata,
                              output=self.output)

    def capture(self, *, write: bool) -> None:
        """Warm up (compiles) on a side stream, then capture; eager on CPU."""
        self.write = write
        if self.dev.type != "cuda":
            self._run(write)
            return
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._run(write)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self._run(write)

    def replay(self) -> None:
        if self.graph is None:
            self._run(self.write)
        else:
            self.graph.replay()

    def load(self, q_lens: list[int], seq_lens: list[int], table: torch.Tensor,
             slots: torch.Tensor) -> int:
        """Rewrite the buffers in place; returns the real token count."""
        n, t = len(q_lens), sum(q_lens)
        assert t <= self.tokens and n <= self.num_reqs
        qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
        self.qsl[: n + 1] = qsl.to(self.dev)
        self.qsl[n + 1 :] = t
        self.seq_lens.zero_()
        self.seq_lens[:n] = torch.tensor(seq_lens, dtype=torch.int32, device=self.dev)
        self.table.zero_()
        width = min(table.shape[1], self.max_blocks)
        self.table[:n, :width] = table[:, :width].to(self.dev)
        self.slots.fill_(-1)
        self.slots[:t] = slots.to(self.dev)
        return t


def _mixes(tokens: int, small: bool) -> list[list[tuple[int, int]]]:
    """(context, query) per request, decode-first; contexts up to 32K (small: 380)."""
    k = 1 if small else 1024
    big = 380 if small else 32000
    return [
        [(16 * k, 5)],  # a warm prefix hit: a few new tokens over a long cached prefix
        [(3 * k, 1), (big, 1), (k + 7, 1), (4 * k, tokens - 3)],
        [(0, tokens)],  # a fresh prefill filling the bucket
        [(37 * i % (4 * k) + 1, 1) for i in range(tokens)],  # as many decodes as tokens
        [(k, 1), (2 * k, 0), (300, 3), (k // 2, 2)],  # query length 0 before the last one
        [(big - 1, 1)],  # a lone decode at max_model_len
    ]


def step_check(out: _Out, small: bool) -> None:
    from _reference import make_batch, reference_attention, rel_error

    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    num_reqs, max_len = (24, 400) if small else (64, 33024)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    for tokens in (16,) if small else (16, 64):
        mixes = _mixes(tokens, small)
        need = max(sum(-(-(c + q) // BLOCK) for c, q in m) for m in mixes) + 2
        step = _Step(plan="flat", num_reqs=num_reqs, tokens=tokens, max_model_len=max_len,
                     cache_blocks=need, dtype=dtype)
        step.capture(write=True)
        for i, reqs in enumerate(mixes):
            used = sum(-(-(c + q) // BLOCK) for c, q in reqs)
            batch = make_batch(reqs, num_heads=HEADS, num_kv_heads=KV_HEADS,
                               head_size=HEAD_SIZE, block_size=BLOCK, dtype=dtype,
                               device=str(step.dev), seed=i, extra_blocks=need - 1 - used)
            c = batch.common
            step.cache.copy_(batch.kv_cache)
            t = step.load(batch.q_lens, batch.seq_lens, c.block_table, c.slot_mapping)
            for buf, new in ((step.query, batch.query), (step.key, batch.key),
                             (step.value, batch.value)):
                buf.normal_()
                buf[:t] = new
            step.output.fill_(SENTINEL)
            step.replay()
            if step.dev.type == "cuda":
                torch.cuda.synchronize()
            ref = reference_attention(batch, scale=HEAD_SIZE**-0.5)
            err = rel_error(step.output[:t], ref)
            pad_ok = bool((step.output[t:] == SENTINEL).all())
            out.add({"check": "flat_mixed_replay", "bucket": tokens, "mix": i,
                     "reqs": len(reqs), "max_ctx": max(c for c, _ in reqs), "tokens": t,
                     **step.part(), "rel_err": err, "tol": tol, "padding_untouched": pad_ok,
                     "ok": bool(err < tol) and pad_ok})


def step_time(out: _Out, small: bool) -> None:
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    num_reqs, max_len = (24, 400) if small else (64, 33024)
    contexts = [64, 300] if small else [1024, 4096, 16384, 32768]
    layers, reps = (2, 2) if small else (10, 20)
    cache_blocks = 4 * (-(-max_len // BLOCK)) + 1
    g = torch.Generator().manual_seed(0)
    for tokens in (16,) if small else (16, 64):
        suffix = 5 if tokens == 16 else 48
        steps = {}
        for plan in ("classic", "flat"):
            steps[plan] = s = _Step(plan=plan, num_reqs=num_reqs, tokens=tokens,
                                    max_model_len=max_len, cache_blocks=cache_blocks,
                                    dtype=dtype, layers=layers)
            s.cache.normal_()
            s.query.normal_()
            s.capture(write=False)
        for ctx in contexts:
            for n in (1, 4):
                q_lens = [1] * (n - 1) + [suffix]
                seq_lens = [min(ctx + q, max_len - 1) for q in q_lens]
                per = -(-max_len // BLOCK)
                table = (torch.randperm(cache_blocks - 1, generator=g)[: n * per] + 1).view(
                    n, per).to(torch.int32)
                slots = torch.full((sum(q_lens),), -1, dtype=torch.int64)
                row: dict[str, Any] = {"time": "mixed_layer", "bucket": tokens,
                                       "reqs": n, "ctx": ctx, "new_tokens": sum(q_lens)}
                for plan, s in steps.items():
                    s.load(q_lens, seq_lens, table, slots)
                    s.replay()
                    if s.dev.type == "cuda":
                        torch.cuda.synchronize()
                        t0 = time.perf_counter()
                        for _ in range(reps):
                            s.replay()
                        torch.cuda.synchronize()
                        dt = time.perf_counter() - t0
                    else:
                        dt = 0.0
                    row[f"{plan}_us"] = round(dt / (reps * layers) * 1e6, 2)
                    row[f"{plan}_grid"] = s.part()["grid"]
                if row["flat_us"]:
                    row["speedup"] = round(row["classic_us"] / row["flat_us"], 2)
                out.add(row)


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    if len(args) != 2 or args[0] not in ("check", "time"):
        raise SystemExit("usage: python mixed_capture.py {check,time} OUT_DIR [--small]")
    step, out_dir = args
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    small = "--small" in sys.argv
    {"check": step_check, "time": step_time}[step](_Out(out_dir, step), small)


if __name__ == "__main__":
    main()

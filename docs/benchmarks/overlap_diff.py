"""Why overlap on and off can give different tokens: a per-request diff of the two runs.

    python docs/benchmarks/overlap_diff.py OUT_JSON [--small] [--cases bf16-preempt,...]

Runs the workload of `overlap_check.py` (arrivals over steps, greedy / seeded / top-k
sampling, logprobs, n = 2, shared prefixes) with overlap off and on, for each case of a
matrix (dtype x KV budget: with and without preemption), and traces both runs:

- every step's composition (`schedule()`'s output: each request's id, first token and token
  count), and, per request, its *history*: the compositions of the steps that computed its
  tokens since it was last (re)admitted, with its prefix-cache hit length at admission;
- every sampled row: its logits' bit pattern (a hash), top-2 values and ids.

Then, per request and sampled position, the two runs are compared: are the logits
bit-identical, and was the history the same? If overlap resolved a placeholder to the wrong
token or fed stale input ids, rows with the same history (same batches, same inputs) would
differ; if the difference is the kernels' rounding in differently shaped batches, every row
with the same history is bit-identical and the first differing token of each request comes
after a history difference, at a small top-2 gap. ``--small`` uses a 2-layer model (CPU).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from overlap_check import run, workload

from pagedcore import LLM, SamplingParams
from pagedcore.engine.models.loading import qwen2_0_5b_config

Key = tuple[str, int]  # (request id, index of the sampled token)


class Trace:
    """Records step compositions, per-request histories and sampled rows of one run."""

    def __init__(self, llm: LLM) -> None:
        self.llm = llm
        self.steps: list[tuple[tuple[str, int, int], ...]] = []
        self.history: dict[str, list[Any]] = {}
        self.last_end: dict[str, int] = {}
        self.rows: dict[Key, dict[str, Any]] = {}
        self.resampled = 0  # a (request, position) sampled twice (must stay 0)
        self._ends: dict[str, int] = {}
        self._weights: torch.Tensor | None = None
        #: Parent request id -> its children's ids (one per sample).
        self.parents: dict[str, list[str]] = {}
        self.prompt_len: dict[str, int] = {}
        sched, sampler = llm.scheduler, llm.sampler
        schedule, sample, add = sched.schedule, sampler.sample_device, llm.add_request
        self._restore: Callable[[], None] = lambda: (
            delattr(sched, "schedule"), delattr(sampler, "sample_device"),
            delattr(llm, "add_request"))  # type: ignore

        def traced_add(rid: str, *args: Any, **kw: Any) -> Any:
            out = add(rid, *args, **kw)
            children = llm._parents[rid].children
            self.parents[rid] = [c.request_id for c in children]
            for c in children:
                self.prompt_len[c.request_id] = c.num_prompt_tokens
            return out

        def traced_schedule() -> Any:
            out = schedule()
            items = tuple((it.request.request_id, it.start, it.num_new_tokens)
                          for it in out.scheduled)
            sig = hash(items)
            self.steps.append(items)
            self._ends = {}
            for rid, start, num in items:
                hist = self.history.get(rid)
                if hist is None or start < self.last_end.get(rid, 0) or start == 0:
                    hist = [("admitted", start)]  # start > 0 at admission: a prefix hit
                    self.history[rid] = hist
                hist.append(sig)
                self.last_end[rid] = start + num
                self._ends[rid] = start + num
            return out

        def traced_sample(logits: torch.Tensor, params: Sequence[SamplingParams],
                          ids: Sequence[str], **kw: Any) -> Any:
            self._record(logits, ids)
            return sample(logits, params, ids, **kw)

        llm.add_request = traced_add  # type: ignore[method-assign]
        sched.schedule = traced_schedule  # type: ignore[method-assign]
        sampler.sample_device = traced_sample  # type: ignore[method-assign]

    def _record(self, logits: torch.Tensor, ids: Sequence[str]) -> None:
        bits = logits.contiguous().view(torch.int16 if logits.element_size() == 2
                                        else torch.int32).to(torch.int64)
        if self._weights is None or self._weights.numel() != bits.shape[1]:
            gen = torch.Generator().manual_seed(1)
            self._weights = torch.randint(1, 1 << 20, (bits.shape[1],),
                                          generator=gen).to(bits.device)
        hashes = (bits * self._weights).sum(-1).tolist()
        top = logits.float().topk(2, dim=-1)
        values, tids = top.values.tolist(), top.indices.tolist()
        step = len(self.steps) - 1
        for row, rid in enumerate(ids):
            key = (rid, self._ends[rid])
            if key in self.rows:
                self.resampled += 1
            self.rows[key] = {"step": step, "hash": hashes[row], "top": values[row],
                              "top_ids": tids[row], "history": hash(tuple(self.history[rid])),
                              "hit": self.history[rid][0][1]}

    def remove(self) -> None:
        self._restore()


def compare(off: Trace, on: Trace, done_off: dict[str, Any], done_on: dict[str, Any],
            parents: dict[str, list[str]]) -> dict[str, Any]:
    """Per request: first differing token, bit-identity of rows vs history equality."""
    same_hist = [k for k in off.rows if k in on.rows
                 and off.rows[k]["history"] == on.rows[k]["history"]]
    same_hist_differ = [k for k in same_hist if off.rows[k]["hash"] != on.rows[k]["hash"]]
    same_hist_nohit_differ = [k for k in same_hist_differ if off.rows[k]["hit"] == 0]
    diff_hist = [k for k in off.rows if k in on.rows and k not in set(same_hist)]
    diff_hist_differ = [k for k in diff_hist if off.rows[k]["hash"] != on.rows[k]["hash"]]
    first_step = next((i for i, (a, b) in enumerate(zip(off.steps, on.steps, strict=False))
                       if a != b), None)
    divergent: list[dict[str, Any]] = []
    for parent, children in parents.items():
        a, b = done_off.get(parent), done_on.get(parent)
        if a is None or b is None:
            continue
        for sample, child in enumerate(children):
            ta, tb = a[sample][0], b[sample][0]
            if ta == tb:
                continue
            pos = next((i for i, (x, y) in enumerate(zip(ta, tb, strict=False)) if x != y),
                       min(len(ta), len(tb)))
            # The sampled row of output position `pos`: key (child, prompt + pos).
            key = (child, off.prompt_len[child] + pos)
            entry: dict[str, Any] = {"request": child, "first_diff_output_pos": pos,
                                     "off_token": ta[pos] if pos < len(ta) else None,
                                     "on_token": tb[pos] if pos < len(tb) else None}
            if key in off.rows and key in on.rows:
                ro, rn = off.rows[key], on.rows[key]
                entry.update({
                    "step_off": ro["step"], "step_on": rn["step"],
                    "same_history": ro["history"] == rn["history"],
                    "bit_identical_logits": ro["hash"] == rn["hash"],
                    "top2_gap_off": ro["top"][0] - ro["top"][1],
                    "top2_gap_on": rn["top"][0] - rn["top"][1],
                    "top_ids_off": ro["top_ids"], "top_ids_on": rn["top_ids"],
                    "top1_logit_diff": rn["top"][0] - ro["top"][0],
                    # Was any earlier row of this request already not bit-identical?
                    "earlier_rows_differ": sum(
                        1 for k in off.rows if k[0] == child and k[1] < key[1] and k in on.rows
                        and off.rows[k]["hash"] != on.rows[k]["hash"]),
                })
            divergent.append(entry)
    return {
        "rows_compared": sum(1 for k in off.rows if k in on.rows),
        "rows_same_history": len(same_hist),
        "rows_same_history_not_bit_identical": len(same_hist_differ),
        "rows_same_history_no_prefix_hit_not_bit_identical": len(same_hist_nohit_differ),
        "rows_same_history_not_bit_identical_examples": [list(k) for k in same_hist_differ[:5]],
        "rows_other_history": len(diff_hist),
        "rows_other_history_not_bit_identical": len(diff_hist_differ),
        "steps_off": len(off.steps), "steps_on": len(on.steps),
        "first_step_composition_differs": first_step,
        "resampled_rows": off.resampled + on.resampled,
        "requests_with_other_tokens": len(divergent),
        "divergent": divergent,
    }


def run_case(config: Any, *, dtype: torch.dtype, kv_bytes: int, backend: str,
             device: str | None) -> dict[str, Any]:
    llm = LLM(config, backend=backend, dtype=dtype, device=device, kv_cache_memory_bytes=kv_bytes,
              max_num_seqs=64, max_model_len=2048, async_scheduling=False)
    probe = llm.generate([[11, 12, 13, 14]],
                         SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))
    stops = sorted(set(probe[0].outputs[0].token_ids[5:40]))[:8]
    arrivals = workload(stops)
    parents: dict[str, list[str]] = {}
    traces: dict[bool, Trace] = {}
    dones: dict[bool, Any] = {}
    report: dict[str, Any] = {"stop_tokens": stops}
    for overlap in (False, True):
        llm.set_async_scheduling(overlap)
        llm.kv_cache_manager.reset_prefix_cache()
        before = llm.stats()["preemptions"]
        trace = Trace(llm)
        done, secs = run(llm, arrivals)
        trace.remove()
        parents.update(trace.parents)
        traces[overlap], dones[overlap] = trace, done
        report[f"preemptions_{'on' if overlap else 'off'}"] = llm.stats()["preemptions"] - before
        report[f"seconds_{'on' if overlap else 'off'}"] = secs
    reasons: dict[str, int] = {}
    for samples in dones[False].values():
        for _t, reason, _lp in samples:
            reasons[str(reason)] = reasons.get(str(reason), 0) + 1
    report["finish_reasons"] = reasons
    report["identical_tokens"] = all(
        [s[0] for s in dones[True][r]] == [s[0] for s in dones[False][r]] for r in dones[False])
    report.update(compare(traces[False], traces[True], dones[False], dones[True], parents))
    return report


def main() -> None:
    out_path = sys.argv[1] if len(sys.argv) > 1 else "overlap_diff.json"
    small = "--small" in sys.argv
    cases = "bf16-preempt,bf16-roomy,fp32-preempt"
    if "--cases" in sys.argv:
        cases = sys.argv[sys.argv.index("--cases") + 1]
    cuda = torch.cuda.is_available()
    overrides: dict[str, Any] = {"initializer_range": 0.1}
    if small:
        overrides.update(num_hidden_layers=2, hidden_size=128, intermediate_size=256,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=4096,
                         bos_token_id=1, eos_token_id=2)
    config = qwen2_0_5b_config(**overrides)
    backend = "triton" if cuda else "reference"
    tight = (96 << 20) if not small else (3 << 20)
    report: dict[str, Any] = {"command": " ".join(sys.argv), "small": small,
                              "initializer_range": 0.1, "cases": {}}
    t0 = time.perf_counter()
    for case in cases.split(","):
        dtype_name, budget = case.split("-")
        dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name]
        kv = tight if budget == "preempt" else (4 << 30 if cuda else 64 << 20)
        if dtype == torch.float32 and budget == "preempt":
            kv *= 2  # the same number of blocks
        rep = run_case(config, dtype=dtype, kv_bytes=kv, backend=backend,
                       device=None if cuda else "cpu")
        rep["kv_cache_memory_bytes"] = kv
        report["cases"][case] = rep
        short = {k: v for k, v in rep.items() if k not in ("divergent", "stop_tokens")}
        print(case, json.dumps(short), flush=True)
        for d in rep["divergent"][:6]:
            print("   ", json.dumps(d), flush=True)
        with open(out_path, "w") as fh:
            json.dump(report, fh, indent=1)
        print(f"  [{time.perf_counter() - t0:.1f} s]", flush=True)


if __name__ == "__main__":
    main()

"""Which steps of a shared-prefix decode run replay the cascade graph (H200, session 17).

64 requests over a 4,096-token cached system prompt + 64 own tokens, 49 tokens each, on the
Qwen2-0.5B shape with decode graphs for batch 64: every `ModelRunner.execute` is logged as
(decode graph bucket, cascade prefix lengths, num_reqs, max_query_len, common_prefix_len).
Output: cascade/diag_replays.log.

    python3 docs/benchmarks/h200_s17/cascade_replays_diag.py
"""

import collections
from typing import Any

import torch

from pagedcore import LLM, SamplingParams
from pagedcore.bench.report import engine_bench_model

dev, dtype, config = engine_bench_model(False, "cuda", "qwen2-0.5b", dtype=None)
config.max_position_embeddings = 8192
llm = LLM(config, device=dev, dtype=dtype, max_model_len=4096 + 512, max_num_seqs=64,
          max_num_batched_tokens=2048, cudagraph_capture_sizes=[64])
runner: Any = llm.runner
log = []
execute = runner.execute


def spy(inputs: Any) -> Any:
    c = inputs.common[0]
    log.append((inputs.cudagraph_bucket, tuple(inputs.cascade_prefix_lens), c.num_reqs,
                c.max_query_len, tuple(cc.common_prefix_len for cc in inputs.common)))
    return execute(inputs)


runner.execute = spy
g = torch.Generator().manual_seed(0)
system = torch.randint(10, 1000, (4096,), generator=g).tolist()
llm.generate([[*system, 5]], SamplingParams(max_tokens=1))
prompts = [system + torch.randint(10, 1000, (64,), generator=g).tolist() for _ in range(64)]
log.clear()
llm.generate(prompts, SamplingParams(max_tokens=49, temperature=0.0, ignore_eos=True))
kinds = collections.Counter((b is not None, bool(any(u)), n, q) for b, u, n, q, _ in log)
print(len(log), "steps;", kinds)
for row in log[:12]:
    print(row)
print("replays", runner.cascade_graphs.num_replays)

"""Bucket-aware chunking: shrink a partial prefill chunk so a step lands on a token bucket.

With ``SchedulerConfig.token_buckets`` set (the token buckets of the captured mixed-step CUDA
graphs), a step is replayed from the graph of the smallest bucket that holds it, so 512
prompt tokens + 1 decode = 513 tokens would run (and pay for) a larger bucket.
`align_to_bucket` (called by `Scheduler._align_to_bucket`) shrinks a *partial* prefill chunk
so the step totals exactly the largest bucket at or below what it would total; a prompt's
final chunk is never shrunk, nor any chunk below half its size, nor a chunk whose cut tokens
fall in a block another request of the step already took a prefix hit on (that request reads
those slots in this step: they must be written).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence

from pagedcore.engine.scheduling.scheduler_types import KVManagerLike, ScheduledRequest

__all__ = ["align_to_bucket"]


def align_to_bucket(
    buckets: Sequence[int] | None,
    scheduled: dict[str, ScheduledRequest],
    total: int,
    kv: KVManagerLike,
) -> int:
    """Shrink one partial prefill chunk so the step's `total` tokens land on a token bucket.

    With `buckets` (``config.token_buckets``) set and `total` between two buckets (at most the
    largest: larger steps run eagerly, unpadded), the largest partial chunk (one that does
    not reach its request's last token, so it samples nothing) that can give up
    ``total - bucket`` tokens while keeping at least half its size is cut by that much,
    ``bucket`` being the largest bucket below `total`. A chunk whose cut tokens lie in a
    block shared with another request (`KVManagerLike.shares_blocks_from`: a prefix hit taken
    in this same step on a block this chunk fills) is not a candidate. The KV blocks
    allocated for the cut tokens stay with the request (its next chunk fills them); their
    prefix-cache entries are dropped (through `kv`) until then. `scheduled` is updated in
    place. Returns the tokens removed (0: step unchanged).
    """
    if buckets is None or total > buckets[-1]:
        return 0
    index = bisect_right(buckets, total) - 1
    if index < 0 or buckets[index] == total:
        return 0
    cut = total - buckets[index]
    best: ScheduledRequest | None = None
    for item in scheduled.values():
        n = item.num_new_tokens
        if item.samples or 2 * (n - cut) < n:
            continue
        if best is not None and n <= best.num_new_tokens:
            continue
        if kv.shares_blocks_from(item.request.request_id, item.end - cut):
            continue
        best = item
    if best is None:
        return 0
    request = best.request
    scheduled[request.request_id] = ScheduledRequest(
        request, best.start, best.num_new_tokens - cut, samples=False)
    kv.uncache_unwritten_blocks(request.request_id, best.end - cut)
    return cut

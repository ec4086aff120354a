"""Per step and KV-cache group: the shared prefix of the block tables, and whether to cascade."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from pagedcore.attention.cascade import (
    CASCADE_MIN_REQUESTS,
    cascade_beats_graph,
    cascade_mode,
    cascade_pays,
    common_prefix_len,
)
from pagedcore.engine.scheduling.scheduler_types import DecodeBatch
from pagedcore.kv_cache.spec import FullAttentionSpec, KVCacheGroupSpec

if TYPE_CHECKING:
    from pagedcore.attention.backend import AttentionBackend
    from pagedcore.engine.scheduling.scheduler import ScheduledRequest

__all__ = ["CascadePlanner"]


class CascadePlanner:
    """Computes each step's `common_prefix_len` per group and the cascade request.

    A group may cascade when its backend declares ``supports_cascade`` and its layers are
    plain full attention (not sliding-window or chunked-local, whose leading block-table
    entries may be null blocks, and not MLA). ``PAGEDCORE_CASCADE`` (read once, here) picks
    ``auto`` (`cascade_pays`), ``off`` or ``always``.
    """

    def __init__(
        self, groups: Sequence[KVCacheGroupSpec], backends: Sequence[type[AttentionBackend]]
    ) -> None:
        self.mode = cascade_mode()
        self.block_sizes = [g.spec.block_size for g in groups]
        #: K and V bytes of one layer per token, per group (what a cascade saves per read).
        self.token_bytes = [g.spec.page_size_bytes // g.spec.block_size for g in groups]
        self.eligible = [
            b.supports_cascade and type(g.spec) is FullAttentionSpec
            for g, b in zip(groups, backends, strict=True)
        ]
        self.enabled = self.mode != "off" and any(self.eligible)

    def against_graph(self, use: tuple[int, ...], num_reqs: int) -> tuple[int, ...]:
        """`use` for a step that a CUDA graph would serve were it not cascaded: unchanged in
        ``always`` mode or when some group's saved reads outweigh the eager step
        (`cascade_beats_graph`), else no cascade at all (the step replays its graph)."""
        if self.mode == "always" or any(
            cascade_beats_graph(p, num_reqs, b) for p, b in zip(use, self.token_bytes,
                                                                 strict=True)):
            return use
        return (0,) * len(use)

    def set_mode(self, mode: str) -> None:
        """Switch between ``auto``, ``off`` and ``always`` (benchmarks compare them)."""
        if mode not in ("auto", "off", "always"):
            raise ValueError(f"cascade mode {mode!r} is not one of auto, off, always")
        self.mode = mode
        self.enabled = mode != "off" and any(self.eligible)

    def plan(
        self,
        scheduled: Sequence[ScheduledRequest],
        block_ids: Callable[[str], tuple[list[int], ...]],
    ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """``(shared, use)`` per group: tokens every request holds in the same physical
        blocks (`common_prefix_len`; 0 for groups that may not cascade), and the
        ``common_prefix_len`` to pass to the builder (0 unless cascade pays or is forced)."""
        zeros = (0,) * len(self.block_sizes)
        n = len(scheduled)
        if not self.enabled or n < CASCADE_MIN_REQUESTS:
            return zeros, zeros
        if isinstance(scheduled, DecodeBatch):
            requests = scheduled.requests
            contexts = scheduled.starts
        else:
            requests = [s.request for s in scheduled]
            contexts = [s.start for s in scheduled]
        smallest = min(contexts)
        if self.mode == "auto" and not cascade_pays(smallest, n):
            return zeros, zeros  # even the longest possible prefix would not pay
        # Each group's tables read lazily: requests with no common prefix (the usual batch)
        # stop the scan at the first request that differs.
        shared = tuple(
            common_prefix_len((block_ids(r.request_id)[g] for r in requests), contexts, bsz)
            if ok else 0
            for g, (bsz, ok) in enumerate(zip(self.block_sizes, self.eligible, strict=True))
        )
        if self.mode == "always":
            return shared, shared
        return shared, tuple(p if cascade_pays(p, n) else 0 for p in shared)

"""The scheduler's view of each running request's KV blocks.

`RequestBlocks` allocates through the KV-cache manager, keeps each request's block ids (the
rows of the runner's block tables) and skips the manager when a step cannot change anything
in it: with full attention only, a step that stays inside the request's blocks needs no new
block and nothing leaves a window. For a prefill chunk that holds only when it completes no
block (prompt blocks are registered in the prefix cache at once); for a decode always: the
blocks it completes are registered by its next allocation, or when it finishes or is
preempted (`register_written`). A decode that runs past its blocks reserves a few more
(lookahead slots, never cached) while the cache is not too full.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pagedcore.kv_cache.spec import FullAttentionSpec, KVCacheConfig

if TYPE_CHECKING:
    from pagedcore.engine.scheduling.request import Request
    from pagedcore.engine.scheduling.schedule_undo import ScheduleUndo
    from pagedcore.engine.scheduling.scheduler_types import KVManagerLike

__all__ = ["LOOKAHEAD_BLOCKS", "LOOKAHEAD_MAX_USAGE", "RequestBlocks"]

#: Blocks a decode that runs past its blocks reserves ahead (while the cache is not too full).
LOOKAHEAD_BLOCKS = 4
#: KV usage above which decodes allocate exactly (no lookahead), not to crowd others out.
LOOKAHEAD_MAX_USAGE = 0.75


class RequestBlocks:
    """Block ids per running request (and each request's ``block_capacity``: the tokens its
    blocks hold, meaningful with `fast_path` only), and allocation through the manager.

    Parameters
    ----------
    kv:
        The KV-cache manager.
    kv_cache_config:
        The cache layout (groups and their block sizes).
    lookahead_blocks:
        Blocks a decode running past its blocks reserves ahead while the cache is less than
        `LOOKAHEAD_MAX_USAGE` full (0: allocate exactly).
    """

    def __init__(
        self, kv: KVManagerLike, kv_cache_config: KVCacheConfig, *, lookahead_blocks: int
    ) -> None:
        self.kv = kv
        #: Block ids per request and group, replaced (never mutated) when they change.
        self.ids: dict[str, tuple[list[int], ...]] = {}
        #: Requests whose block ids changed since the last `take_changed()`.
        self.changed: set[Request] = set()
        self.group_block_sizes = [g.spec.block_size for g in kv_cache_config.groups]
        self.block_sizes = sorted(set(self.group_block_sizes))
        self.lookahead_tokens = lookahead_blocks * self.block_sizes[0]
        #: Full attention only: steps inside a request's blocks may skip the manager.
        self.fast_path = all(isinstance(g.spec, FullAttentionSpec)
                             for g in kv_cache_config.groups)

    def in_one_block(self, start: int, end: int) -> bool:
        """Tokens ``[start, end)`` complete no block of any group (no new block to cache)."""
        sizes = self.block_sizes
        if len(sizes) == 1:
            return end // sizes[0] == start // sizes[0]
        return all(end // b == start // b for b in sizes)

    def allocate(
        self,
        request: Request,
        num_new: int,
        *,
        num_cached: int = 0,
        cached_blocks: Any = None,
        undo: ScheduleUndo | None = None,
    ) -> bool:
        """Make room for `num_new` more tokens of `request` (after `num_cached` prefix-hit
        tokens in `cached_blocks`, on admission); False when the cache has no room.

        `undo` (the journal of the `schedule()` in progress) records the allocation.
        """
        rid = request.request_id
        start = request.num_computed_tokens + num_cached
        end = start + num_new
        if (
            self.fast_path
            and cached_blocks is None
            and end <= request.block_capacity
            and (num_new == 1 or self.in_one_block(start, end))
        ):
            return True
        if undo is not None:
            undo.pending = (request, start)
        kv = self.kv
        kw: dict[str, Any] = {} if cached_blocks is None else dict(
            num_new_computed_tokens=num_cached, new_computed_blocks=cached_blocks
        )
        allocated = None
        # A step that reaches the request's last token (a decode, or the prompt's last chunk:
        # decodes follow) reserves blocks ahead, so the next ones skip the manager.
        if (self.fast_path and self.lookahead_tokens and end == request.num_tokens
                and kv.usage < LOOKAHEAD_MAX_USAGE):
            allocated = kv.allocate_slots(
                request, num_new, num_lookahead_tokens=self.lookahead_tokens, **kw
            )
        if allocated is None:
            allocated = kv.allocate_slots(request, num_new, **kw)
        if undo is not None:
            undo.pending = None
            if allocated is not None:
                undo.allocated.setdefault(rid, (request, start))
        if allocated is None:
            return False
        previous = self.ids.get(rid)
        if self.fast_path and previous is not None and cached_blocks is None:
            # Full attention: a request's block list only grows, so append the new blocks
            # instead of rebuilding every list from the manager.
            ids = tuple(
                old + new for old, new in zip(previous, allocated.get_block_ids(), strict=True)
            )
        else:
            ids = kv.get_block_ids(rid)
        self.ids[rid] = ids
        self.changed.add(request)
        # Full attention holds one block per block_size tokens from position 0.
        request.block_capacity = min(
            len(group) * b for group, b in zip(ids, self.group_block_sizes, strict=True)
        )
        return True

    def register_written(self, request: Request) -> None:
        """Register in the prefix cache every full block whose KV is written (the last few a
        decode completed may not be yet)."""
        if self.fast_path and request.request_id in self.ids:
            self.kv.allocate_slots(request, 0)

    def take_changed(self) -> set[Request]:
        """The requests whose block ids changed since the last call (and forget them)."""
        changed, self.changed = self.changed, set()
        return changed

    def free(self, request: Request) -> None:
        """Release the request's blocks and forget them."""
        self.kv.free(request)
        self.ids.pop(request.request_id, None)
        self.changed.discard(request)
        request.block_capacity = 0

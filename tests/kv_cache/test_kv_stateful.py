"""Hypothesis state machines over random interleavings of allocate / append / free / hit / evict.

A simulated model runner writes every computed token (with the request's salt and LoRA) into a
"physical memory" keyed by block id, exactly where the manager's block table says. After every
step: the manager's invariants hold; every live request reads back its own tokens from every
block it still needs (so no referenced block was handed to someone else, and no needed block was
dropped); sliding-window tables stay within the window's bound. On every prefix hit, each hit
block holds the request's own tokens written under the same salt and LoRA (salt isolation).
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    precondition,
    rule,
)
from kv_fakes import (
    FakeRequest,
    chunked_spec,
    config_for,
    first_needed_block,
    full_spec,
    sliding_spec,
)

from pagedcore.kv_cache.manager import KVCacheManager
from pagedcore.kv_cache.spec import AttentionSpec, FullAttentionSpec, SlidingWindowSpec, cdiv

BLOCK = 4
MAX_LEN = 40
PREFIXES = ([], [1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9, 9, 9, 9, 9], [5] * 12)
SETTINGS = settings(
    max_examples=100,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)

Slot = tuple[str | None, str | None, int]  # (salt, lora, token)



class KVMachine(RuleBasedStateMachine):
    """Drives one KVCacheManager; subclasses pick the groups."""

    specs: tuple[AttentionSpec, ...] = (full_spec(BLOCK),)
    num_blocks = 16

    requests = Bundle("requests")

    def __init__(self) -> None:
        super().__init__()
        self.mgr = KVCacheManager(
            config_for(self.specs, self.num_blocks), MAX_LEN, hash_seed=0
        )
        self.memory: dict[int, list[Slot | None]] = {}
        self.live: dict[str, FakeRequest] = {}
        self.counter = 0
        self.max_new = 1

    # -- simulated model runner ----------------------------------------------------------------

    def _write(self, req: FakeRequest, start: int, end: int) -> None:
        tokens = req.all_token_ids
        for group in self.mgr.get_block_ids(req.request_id):
            for pos in range(start, end):
                block_id = group[pos // BLOCK]
                assert block_id != 0, f"position {pos} being computed maps to the null block"
                slots = self.memory.setdefault(block_id, [None] * BLOCK)
                slots[pos % BLOCK] = (req.cache_salt, req.lora_name, tokens[pos])

    def _expect(self, req: FakeRequest, block_id: int, first_pos: int, count: int) -> None:
        tokens = req.all_token_ids
        slots = self.memory.get(block_id, [None] * BLOCK)
        for k in range(count):
            want = (req.cache_salt, req.lora_name, tokens[first_pos + k])
            assert slots[k] == want, (
                f"block {block_id} slot {k} holds {slots[k]}, request {req.request_id} "
                f"expects {want}"
            )

    def _schedule(self, req: FakeRequest, chunk: int, *, new: bool) -> None:
        n_hit = 0
        hit = None
        if new:
            hit, n_hit = self.mgr.get_computed_blocks(req)
            assert n_hit % BLOCK == 0 and n_hit < len(req.all_token_ids)
            for group in hit.blocks:
                for i, block in enumerate(group):
                    if not block.is_null:
                        self._expect(req, block.block_id, i * BLOCK, BLOCK)
        remaining = len(req.all_token_ids) - req.num_computed_tokens - n_hit
        num_new = min(chunk, remaining)
        before = [b.ref_cnt for b in self.mgr.block_pool.blocks]
        tables = self.mgr.get_block_ids(req.request_id)
        out = self.mgr.allocate_slots(
            req, num_new, num_new_computed_tokens=n_hit, new_computed_blocks=hit
        )
        if out is None:
            assert [b.ref_cnt for b in self.mgr.block_pool.blocks] == before, "failed alloc"
            assert self.mgr.get_block_ids(req.request_id) == tables
            return
        self.live[req.request_id] = req
        start = req.num_computed_tokens + n_hit
        self._write(req, start, start + num_new)
        req.num_computed_tokens = start + num_new
        self.max_new = max(self.max_new, num_new)
        if req.num_computed_tokens == len(req.all_token_ids) and len(req.all_token_ids) < MAX_LEN:
            req.output.append(self.counter % 7)  # "sample" the next token

    # -- rules -----------------------------------------------------------------------------------

    @rule(
        target=requests,
        prefix=st.sampled_from(PREFIXES),
        tail=st.lists(st.integers(0, 3), min_size=1, max_size=12),
        salt=st.sampled_from([None, None, "a", "b"]),
        lora=st.sampled_from([None, None, "a"]),
        chunk=st.integers(1, 16),
    )
    def add(
        self, prefix: list[int], tail: list[int], salt: str | None, lora: str | None, chunk: int
    ) -> FakeRequest:
        self.counter += 1
        req = FakeRequest(f"r{self.counter}", prefix + tail, cache_salt=salt, lora_name=lora)
        self._schedule(req, chunk, new=True)
        return req

    @rule(req=requests, chunk=st.integers(1, 16))
    def step(self, req: FakeRequest, chunk: int) -> None:
        new = req.request_id not in self.live
        if len(req.all_token_ids) - req.num_computed_tokens == 0:
            return  # reached max length; waits to be freed
        self._schedule(req, chunk, new=new)

    @rule(req=consumes(requests))
    def finish(self, req: FakeRequest) -> None:
        self.mgr.free(req)
        self.live.pop(req.request_id, None)

    @rule(req=requests)
    def preempt(self, req: FakeRequest) -> None:
        self.mgr.free(req)
        self.live.pop(req.request_id, None)
        req.num_computed_tokens = 0  # recomputed later, generated tokens kept

    @rule()
    def reset_prefix_cache(self) -> None:
        ok = self.mgr.reset_prefix_cache()
        in_use = any(b.ref_cnt > 0 for b in self.mgr.block_pool.blocks)
        assert ok == (not in_use)
        if ok:
            assert not self.mgr.block_pool.cached

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def hit_check_on_live_prompt(self, data: st.DataObject) -> None:
        """A fresh request copying a live one's tokens hits only its own-salt blocks."""
        src = data.draw(st.sampled_from(sorted(self.live)))
        req = self.live[src]
        salt = data.draw(st.sampled_from([req.cache_salt, "other"]))
        probe = FakeRequest("probe", req.all_token_ids, cache_salt=salt, lora_name=req.lora_name)
        hit, n = self.mgr.get_computed_blocks(probe)
        for group in hit.blocks:
            for i, block in enumerate(group):
                if not block.is_null:
                    self._expect(probe, block.block_id, i * BLOCK, BLOCK)
        if salt != req.cache_salt:
            assert n == 0, "a request with an unused salt hit the cache"
        elif self.mgr.enable_caching and all(type(sp) is FullAttentionSpec for sp in self.specs):
            # The live request holds its computed full blocks, so they must be found again.
            want = min(req.num_computed_tokens, len(req.all_token_ids) - 1) // BLOCK * BLOCK
            assert n >= want, f"same-salt probe hit {n} tokens, live request cached {want}"
        self.mgr.free(probe)  # never allocated: must be a no-op

    # -- invariants ------------------------------------------------------------------------------

    @invariant()
    def manager_invariants(self) -> None:
        self.mgr.check_invariants()

    @invariant()
    def live_requests_read_their_own_tokens(self) -> None:
        for req in self.live.values():
            done = req.num_computed_tokens
            for spec, ids in zip(self.specs, self.mgr.get_block_ids(req.request_id), strict=True):
                first = first_needed_block(spec, done)
                for i in range(first, cdiv(done, BLOCK)):
                    assert ids[i] != 0, f"needed block {i} of {req.request_id} was dropped"
                    self._expect(req, ids[i], i * BLOCK, min(BLOCK, done - i * BLOCK))

    @invariant()
    def sliding_window_memory_is_bounded(self) -> None:
        for manager in self.mgr.coordinator.managers:
            spec = manager.spec
            if not isinstance(spec, SlidingWindowSpec):
                continue
            bound = cdiv(spec.sliding_window - 1 + self.max_new, BLOCK) + 1
            for rid, blocks in manager.req_to_blocks.items():
                held = sum(1 for b in blocks if not b.is_null)
                assert held <= bound, f"{rid} holds {held} blocks, window bound is {bound}"

    def teardown(self) -> None:
        for req in list(self.live.values()):
            self.mgr.free(req)
        self.mgr.check_invariants()
        assert all(b.ref_cnt == 0 for b in self.mgr.block_pool.blocks)
        assert self.mgr.num_free_blocks == self.num_blocks - 1


class SlidingMachine(KVMachine):
    specs = (sliding_spec(BLOCK, 6),)


class HybridMachine(KVMachine):
    specs = (full_spec(BLOCK), sliding_spec(BLOCK, 6), chunked_spec(BLOCK, 8))
    num_blocks = 40


class NoCacheMachine(KVMachine):
    def __init__(self) -> None:
        super().__init__()
        self.mgr = KVCacheManager(
            config_for(self.specs, self.num_blocks), MAX_LEN, enable_caching=False
        )


TestFullAttention = KVMachine.TestCase
TestFullAttention.settings = SETTINGS
TestSlidingWindow = SlidingMachine.TestCase
TestSlidingWindow.settings = SETTINGS
TestHybrid = HybridMachine.TestCase
TestHybrid.settings = SETTINGS
TestNoPrefixCache = NoCacheMachine.TestCase
TestNoPrefixCache.settings = settings(SETTINGS, max_examples=30)

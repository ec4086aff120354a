"""The engine's persistent step buffers for one captured bucket, shared by the capture tests."""

from __future__ import annotations

from typing import Any

import torch
from _reference import make_batch, reference_attention, rel_error
from pagedcore_triton import SplitRule, TritonAttentionBackend

from pagedcore.attention import CommonAttentionMetadata
from pagedcore.kv_cache.spec import FullAttentionSpec

#: What a step's output is filled with first: rows still holding it were written by no program.
SENTINEL = 7.0


def replay_layer(impl: Any, buf: Any, batch: Any, metadata: Any, out: torch.Tensor) -> float:
    """One layer of a step over a captured plan: the cache write, then `forward` into `out`
    (filled with `SENTINEL` first); the relative error of the real tokens' rows against the
    reference (padding rows are the caller's to check)."""
    impl.do_kv_cache_update(buf.key, buf.value, batch.kv_cache, buf.slots)
    out.fill_(SENTINEL)
    impl.forward(buf.query, buf.key, buf.value, batch.kv_cache, metadata, output=out)
    ref = reference_attention(batch, scale=0.125, sliding_window=impl.sliding_window)
    return rel_error(out[: batch.common.num_actual_tokens], ref)


def triton_builder(
    *, block_size: int, kv_heads: int, head_size: int, device: str,
    dtype: torch.dtype = torch.float32, split: SplitRule | None = None,
) -> Any:
    """A triton `MetadataBuilder` for two layers, with `split` as its split-KV rule."""
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=kv_heads,
                             head_size=head_size, dtype=dtype)
    builder = TritonAttentionBackend.get_builder_cls()(spec, ["l0", "l1"], torch.device(device))
    if split is not None:
        builder.split_rule = split
    return builder


class CaptureBuffers:
    """Persistent inputs of one bucket: `num_reqs` request slots and `num_tokens` token slots.

    A decode bucket (``num_tokens == num_reqs``) starts as one-token requests of length 1; a
    mixed bucket starts as padding only (query length 0, ``seq_lens`` 0). Every slot maps to
    -1 and every block-table row to the null block until a test rewrites them in place.
    """

    def __init__(
        self, *, num_reqs: int, num_tokens: int, max_blocks: int, max_model_len: int,
        heads: int, kv_heads: int, head_size: int, device: str, block_size: int = 16,
        cache_blocks: int = 0,
    ) -> None:
        dev = torch.device(device)
        self.heads, self.kv_heads, self.head_size, self.device = heads, kv_heads, head_size, device
        self.block_size, self.cache_blocks = block_size, cache_blocks
        self.decode = num_tokens == num_reqs
        self.num_reqs, self.num_tokens, self.max_model_len = num_reqs, num_tokens, max_model_len
        if self.decode:
            self.qsl = torch.arange(num_reqs + 1, dtype=torch.int32, device=dev)
            self.seq_lens = torch.ones(num_reqs, dtype=torch.int32, device=dev)
        else:
            self.qsl = torch.zeros(num_reqs + 1, dtype=torch.int32, device=dev)
            self.seq_lens = torch.zeros(num_reqs, dtype=torch.int32, device=dev)
        self.table = torch.zeros((num_reqs, max_blocks), dtype=torch.int32, device=dev)
        self.slots = torch.full((num_tokens,), -1, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(num_tokens, dtype=torch.int64, device=dev)
        self.query = torch.zeros((num_tokens, heads, head_size), device=dev)
        self.key = torch.zeros((num_tokens, kv_heads, head_size), device=dev)
        self.value = torch.zeros_like(self.key)

    def common(self) -> CommonAttentionMetadata:
        """What the engine hands `build_for_cudagraph_capture` for this bucket."""
        return CommonAttentionMetadata(
            query_start_loc=self.qsl, query_start_loc_cpu=self.qsl.cpu(),
            seq_lens=self.seq_lens, seq_lens_cpu=self.seq_lens.cpu(), num_reqs=self.num_reqs,
            num_actual_tokens=self.num_tokens,
            max_query_len=1 if self.decode else self.num_tokens,
            max_seq_len=self.max_model_len, block_table=self.table, slot_mapping=self.slots,
            positions=self.positions,
        )

    def load_mixed(self, reqs: list[tuple[int, int]], seed: int) -> Any:
        """Rewrite a mixed bucket in place: `reqs` (``(context, query)`` pairs) first, then
        padding requests (query length 0, ``seq_lens`` 0) and padding tokens (slot -1, finite
        junk as after a real step). The cache always has ``cache_blocks`` blocks (given at
        construction), so every mix compiles to the same kernel. Returns `make_batch`'s
        batch."""
        block_size, cache_blocks = self.block_size, self.cache_blocks
        used = sum(-(-(ctx + q) // block_size) for ctx, q in reqs)
        batch = make_batch(reqs, num_heads=self.heads, num_kv_heads=self.kv_heads,
                           head_size=self.head_size, block_size=block_size,
                           dtype=torch.float32, device=self.device, seed=seed,
                           extra_blocks=cache_blocks - 1 - used)
        n, c = len(reqs), batch.common
        t = c.num_actual_tokens
        assert t <= self.num_tokens and n <= self.num_reqs
        width = min(c.block_table.shape[1], self.table.shape[1])  # make_batch adds a column
        self.qsl[: n + 1] = c.query_start_loc
        self.qsl[n + 1 :] = t
        self.seq_lens.zero_()
        self.seq_lens[:n] = c.seq_lens
        self.table.zero_()
        self.table[:n, :width] = c.block_table[:, :width]
        self.slots.fill_(-1)
        self.slots[:t] = c.slot_mapping
        for buf, new in ((self.query, batch.query), (self.key, batch.key),
                         (self.value, batch.value)):
            buf.normal_()
            buf[:t] = new
        return batch

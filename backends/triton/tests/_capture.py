"""The engine's persistent step buffers for one captured bucket, shared by the capture tests."""

from __future__ import annotations

import torch

from pagedcore.attention import CommonAttentionMetadata


class CaptureBuffers:
    """Persistent inputs of one bucket: `num_reqs` request slots and `num_tokens` token slots.

    A decode bucket (``num_tokens == num_reqs``) starts as one-token requests of length 1; a
    mixed bucket starts as padding only (query length 0, ``seq_lens`` 0). Every slot maps to
    -1 and every block-table row to the null block until a test rewrites them in place.
    """

    def __init__(
        self, *, num_reqs: int, num_tokens: int, max_blocks: int, max_model_len: int,
        heads: int, kv_heads: int, head_size: int, device: str,
    ) -> None:
        dev = torch.device(device)
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

"""A torch stand-in for the compiled extension, with the same call signatures.

It checks the invariants the kernels rely on (partition arithmetic, buffer sizes, tile
coverage) and computes the result from the cache through `gather_kv`, so CPU tests exercise
the whole Python side: layout, cache write, builder, pass selection, argument plumbing.
"""

from __future__ import annotations

from typing import Any

import torch
from pagedcore_cuda_paged.layout import gather_kv, write_kv
from pagedcore_cuda_paged.plan import num_partitions
from pagedcore_cuda_paged.torch_ref import attention_reference

from pagedcore.attention.kv_quant import dequantize_fp8, quantize_fp8

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


class FakeOps:
    """Records each call's kind (and decode launch shape) in `calls`."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def cache_write(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                    slot_mapping: torch.Tensor, block_size: int) -> None:
        assert slot_mapping.dtype == torch.int64 and slot_mapping.numel() == key.shape[0]
        self.calls.append(("cache_write",))
        write_kv(key, value, kv_cache, slot_mapping, block_size=block_size)

    def cache_write_fp8(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                        slot_mapping: torch.Tensor, block_size: int, k_scale: torch.Tensor,
                        v_scale: torch.Tensor) -> None:
        assert kv_cache.dtype in _FP8 and k_scale.shape == v_scale.shape == (1,)
        assert block_size % 16 == 0, "an fp8 cache needs block size 16 or 32"
        assert slot_mapping.dtype == torch.int64 and slot_mapping.numel() == key.shape[0]
        self.calls.append(("cache_write_fp8",))
        write_kv(quantize_fp8(key, k_scale, kv_cache.dtype),
                 quantize_fp8(value, v_scale, kv_cache.dtype), kv_cache, slot_mapping,
                 block_size=block_size)

    def decode_fp8(self, out: torch.Tensor, query: torch.Tensor, kv_cache: torch.Tensor,
                   block_table: torch.Tensor, seq_lens: torch.Tensor, qsl: torch.Tensor,
                   decode_reqs: torch.Tensor, block_size: int, num_kv_heads: int,
                   scale: float, soft_cap: float, alibi: torch.Tensor | None, window: int,
                   partition_size: int, max_partitions: int, tmp_out: torch.Tensor,
                   max_logits: torch.Tensor, exp_sums: torch.Tensor, k_scale: torch.Tensor,
                   v_scale: torch.Tensor, kernel: int) -> None:
        assert kv_cache.dtype in _FP8 and block_size % 16 == 0
        self.scales = (k_scale, v_scale)
        self.decode(out, query, kv_cache, block_table, seq_lens, qsl, decode_reqs, block_size,
                    num_kv_heads, scale, soft_cap, alibi, window, partition_size,
                    max_partitions, kernel == 1, tmp_out, max_logits, exp_sums, kernel, 1)
        self.calls[-1] = ("decode_fp8", *self.calls[-1][1:])

    def prefill_fp8(self, out: torch.Tensor, query: torch.Tensor, kv_cache: torch.Tensor,
                    block_table: torch.Tensor, seq_lens: torch.Tensor, qsl: torch.Tensor,
                    tiles: torch.Tensor, block_size: int, num_kv_heads: int, scale: float,
                    soft_cap: float, alibi: torch.Tensor | None, window: int, causal: bool,
                    k_scale: torch.Tensor, v_scale: torch.Tensor) -> None:
        # 64-row tiles; the ones past a request's last row are no-ops (split 128-row tiles).
        assert kv_cache.dtype in _FP8 and block_size % 16 == 0
        assert tiles.dtype == torch.int32 and tiles.dim() == 2 and tiles.shape[1] == 2
        self.scales = (k_scale, v_scale)
        covered: dict[int, list[int]] = {}
        for req, row in tiles.tolist():
            q_len = int(qsl[req + 1]) - int(qsl[req])
            if row < q_len:
                covered.setdefault(req, []).append(row)
        for req, rows in covered.items():
            q_len = int(qsl[req + 1]) - int(qsl[req])
            assert sorted(rows) == list(range(0, q_len, 64)), (req, rows, q_len)
            self._one(out, query, kv_cache, block_table, seq_lens, qsl, req, block_size,
                      num_kv_heads, scale, soft_cap, alibi, window, causal)
        self.calls.append(("prefill_fp8", len(tiles)))

    def _one(self, out: torch.Tensor, query: torch.Tensor, kv_cache: torch.Tensor,
             block_table: torch.Tensor, seq_lens: torch.Tensor, qsl: torch.Tensor, req: int,
             block_size: int, num_kv_heads: int, scale: float, soft_cap: float,
             alibi: torch.Tensor | None, window: int, causal: bool) -> None:
        start, stop = int(qsl[req]), int(qsl[req + 1])
        seq = int(seq_lens[req])
        k, v = gather_kv(kv_cache, block_table[req], seq, block_size=block_size,
                         num_kv_heads=num_kv_heads, head_size=query.shape[2])
        if kv_cache.dtype in _FP8:
            k, v = dequantize_fp8(k, self.scales[0]), dequantize_fp8(v, self.scales[1])
        out[start:stop] = attention_reference(
            query[start:stop], k, v, scale=scale, causal=causal,
            sliding_window=window or None,
            alibi_slopes=None if alibi is None else alibi.tolist(),
            logits_soft_cap=soft_cap or None,
        ).to(out.dtype)

    def decode(self, out: torch.Tensor, query: torch.Tensor, kv_cache: torch.Tensor,
               block_table: torch.Tensor, seq_lens: torch.Tensor, qsl: torch.Tensor,
               decode_reqs: torch.Tensor, block_size: int, num_kv_heads: int, scale: float,
               soft_cap: float, alibi: torch.Tensor | None, window: int, partition_size: int,
               max_partitions: int, grouped: bool, tmp_out: torch.Tensor,
               max_logits: torch.Tensor, exp_sums: torch.Tensor, kernel: int,
               unroll: int) -> None:
        assert decode_reqs.dtype == torch.int32
        assert kernel in (0, 1) and unroll in (1, 2, 3)
        if kernel == 1:  # mma: fp16/bf16, head sizes <= 128, always grouped
            assert query.dtype != torch.float32 and query.shape[2] <= 128
        assert partition_size > 0 and partition_size % block_size == 0
        n, hq, d = decode_reqs.numel(), query.shape[1], query.shape[2]
        for req in decode_reqs.tolist():
            assert int(qsl[req + 1]) - int(qsl[req]) == 1, "decode got a multi-token request"
            parts = num_partitions(int(seq_lens[req]), partition_size=partition_size,
                                   block_size=block_size, sliding_window=window or None)
            assert 1 <= parts <= max_partitions
            if max_partitions == 1:
                assert parts == 1
        if max_partitions > 1:
            rows = n * hq * max_partitions
            assert tmp_out.numel() >= rows * d and max_logits.numel() >= rows
            assert exp_sums.numel() >= rows
        assert kernel == 1 or not grouped or query.shape[1] > num_kv_heads
        self.calls.append(("decode", partition_size, max_partitions, grouped, kernel))
        for req in decode_reqs.tolist():
            self._one(out, query, kv_cache, block_table, seq_lens, qsl, req, block_size,
                      num_kv_heads, scale, soft_cap, alibi, window, True)

    def prefill(self, out: torch.Tensor, query: torch.Tensor, kv_cache: torch.Tensor,
                block_table: torch.Tensor, seq_lens: torch.Tensor, qsl: torch.Tensor,
                tiles: torch.Tensor, block_size: int, num_kv_heads: int, scale: float,
                soft_cap: float, alibi: torch.Tensor | None, window: int,
                causal: bool, variant: int, tile_rows: int) -> None:
        assert tiles.dtype == torch.int32 and tiles.dim() == 2 and tiles.shape[1] == 2
        assert variant in range(20)
        want = {4: 128, 5: 128, 6: 256, 7: 128, 8: 128, 9: 128, 10: 128, 11: 128,
                12: 64, 13: 128, 14: 128, 15: 128, 16: 128,
                17: 128, 18: 128, 19: 128}.get(variant)
        if want is not None:
            assert tile_rows == want
        else:
            assert tile_rows == 64 or (variant in (0, 3) and tile_rows == 128)
        if variant == 0 or variant >= 3:  # mma: fp16/bf16, head sizes <= 128
            assert query.dtype != torch.float32 and query.shape[2] <= 128
        covered: dict[int, list[int]] = {}
        for req, row in tiles.tolist():
            covered.setdefault(req, []).append(row)
        for req, rows in covered.items():
            q_len = int(qsl[req + 1]) - int(qsl[req])
            assert rows == list(range(0, q_len, tile_rows)), (req, rows, q_len)
            self._one(out, query, kv_cache, block_table, seq_lens, qsl, req, block_size,
                      num_kv_heads, scale, soft_cap, alibi, window, causal)
        self.calls.append(("prefill", len(tiles), variant, tile_rows))

"""The flex backend's per-step plan: a packed gather of the visible keys and its block mask.

Design. FlexAttention attends one query tensor to one key tensor. The plan packs the step
the way flex's "document masking" does: every real query token is a row of one ``[1, Hq,
T_pad, D]`` query, and every key position ``0 <= p < seq_len`` of every request is a row of
one ``[1, Hkv, S_pad, D]`` key/value tensor, gathered from the paged cache through the block
table (``slot = block_table[r][p // B] * B + p % B``). ``mask_mod`` then lets a query see a
key iff both belong to the same request, ``pos_k <= pos_q`` (causal, aligned to the end of
the sequence) and ``pos_q - pos_k < W`` (window). Only slots below ``seq_len`` are gathered,
so the NaN-poisoned unused slots of a request's last block never enter; rows that no query
of their request can see (out of the window, or padding rows) are zeroed by the impl, since
eager flex multiplies masked probabilities (0) by V and ``0 * NaN`` is NaN.

Why a gather and not flex over the flat ``[num_blocks * B]`` cache: eager flex (the only
mode fast enough to start on CPU) materializes the whole ``[T, KV_LEN]`` score matrix, so
``KV_LEN`` must be the step's keys, not the whole cache. The gather copies
``sum(seq_lens)`` rows of K and of V per layer (what the reference copies too), never the
whole cache.

A second, "batched" layout has one flex batch row per request: queries ``[B_pad, Hq, Lq,
D]`` and each request's keys ``[B_pad, Hkv, S_pad, D]`` (``S_pad`` from ``max_seq_len``).
All-decode steps always use it (``Lq = 1``: flex's decode kernel runs, and no 128-row query
tile is padded from a handful of decodes); on CPU, where eager flex computes every score,
any step uses whichever layout has fewer scores. Both layouts are the same plan with a
leading batch dimension (1 for packed).

Shapes are padded to buckets so that compiled flex (CUDA) sees few distinct shapes: powers
of two from 128 on CUDA, multiples of 128 on CPU (eager: padding is pure cost there).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs
import torch

from pagedcore.attention.backend import MetadataBuilder

if TYPE_CHECKING:
    from pagedcore.attention.metadata import CommonAttentionMetadata

__all__ = ["FlexMetadata", "FlexMetadataBuilder", "batch_bucket", "bucket_length"]

#: FlexAttention's block-mask tile (rows and columns).
FLEX_BLOCK = 128
#: Request id of padding query rows / padding key rows (never equal, never a real request).
PAD_QUERY_REQ = -1
PAD_KEY_REQ = -2


def bucket_length(n: int, *, device_type: str) -> int:
    """The padded length for `n` rows: next power of two >= 128 on CUDA, else the next
    multiple of 128."""
    n = max(n, 1)
    if device_type == "cuda":
        return max(FLEX_BLOCK, 1 << (n - 1).bit_length())
    return -(-n // FLEX_BLOCK) * FLEX_BLOCK


def batch_bucket(n: int, *, device_type: str) -> int:
    """The padded flex batch of the decode layout: next power of two on CUDA, else `n`."""
    n = max(n, 1)
    return 1 << (n - 1).bit_length() if device_type == "cuda" else n


def _pad_to(values: torch.Tensor, n: int) -> torch.Tensor:
    out = torch.full((n,), -1, dtype=values.dtype)
    out[: values.shape[0]] = values
    return out


@attrs.define(kw_only=True)
class FlexMetadata:
    """Everything `FlexImpl.forward` needs for one step, shared by every layer of a group.

    ``T_pad`` and ``S_pad`` are the bucketed query and packed-key lengths.

    ``F`` is the flex batch: 1 for the packed layout, ``B_pad`` for the decode layout.

    Attributes
    ----------
    q_rows:
        ``[F, T_pad]`` int64: the flattened-batch token row of each query row, ``-1`` for
        padding.
    q_req, q_pos:
        ``[F, T_pad]`` int64: each query row's request (``-1`` for padding) and position.
    kv_req, kv_pos:
        ``[F, S_pad]`` int64: each key row's request (``-2`` for padding) and position.
    kv_slots:
        ``[F, S_pad]`` int64 flat cache slots to gather (0, the null block, for padding rows).
    kv_first_q:
        ``[F, S_pad]`` int64: position of the first query of the key's request (window).
    num_actual_tokens:
        Real query tokens; rows past it are padding.
    causal:
        Decoder self-attention.
    """

    q_rows: torch.Tensor
    q_req: torch.Tensor
    q_pos: torch.Tensor
    kv_req: torch.Tensor
    kv_pos: torch.Tensor
    kv_slots: torch.Tensor
    kv_first_q: torch.Tensor
    num_actual_tokens: int
    causal: bool
    _block_masks: dict[int | None, Any] = attrs.field(factory=dict, repr=False)

    @property
    def flex_batch(self) -> int:
        return int(self.q_req.shape[0])

    @property
    def padded_query_len(self) -> int:
        return int(self.q_req.shape[1])

    @property
    def padded_kv_len(self) -> int:
        return int(self.kv_req.shape[1])

    def kv_live(self, sliding_window: int | None) -> torch.Tensor:
        """``[F, S_pad]`` bool: key rows some query of their request can see."""
        live = self.kv_req >= 0
        if sliding_window is not None:
            live = live & (self.kv_pos > self.kv_first_q - sliding_window)
        return live

    def mask_mod(self, sliding_window: int | None) -> Any:
        """The flex ``mask_mod(b, h, q_idx, kv_idx)`` of this step and window."""
        q_req, q_pos, kv_req, kv_pos = self.q_req, self.q_pos, self.kv_req, self.kv_pos
        causal = self.causal

        def mask(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            keep = q_req[b, q_idx] == kv_req[b, kv_idx]
            rel = q_pos[b, q_idx] - kv_pos[b, kv_idx]
            if causal:
                keep = keep & (rel >= 0)
            if sliding_window is not None:
                keep = keep & (rel < sliding_window)
            return keep

        return mask

    def block_mask(self, sliding_window: int | None) -> Any:
        """The flex ``BlockMask`` for `sliding_window`, made on first use and kept."""
        cached = self._block_masks.get(sliding_window)
        if cached is None:
            from torch.nn.attention.flex_attention import create_block_mask

            device = self.q_req.device
            cached = create_block_mask(
                self.mask_mod(sliding_window),
                self.flex_batch,
                None,
                self.padded_query_len,
                self.padded_kv_len,
                device=device,
                BLOCK_SIZE=FLEX_BLOCK,
                _compile=device.type == "cuda",
            )
            self._block_masks[sliding_window] = cached
        return cached


def _batched_is_cheaper(
    seq_lens: torch.Tensor, query_lens: torch.Tensor, device_type: str
) -> bool:
    """Layout choice. All decodes: batched on every device (flex's decode kernel). Else,
    on CUDA packed (the block mask skips cross-request tiles, and fewer shapes compile);
    on CPU, where eager flex computes every score, whichever has fewer scores."""
    if bool((query_lens == 1).all()):
        return True
    if device_type == "cuda":
        return False
    n = int(seq_lens.shape[0])
    longest = bucket_length(int(seq_lens.max()), device_type="cpu")
    batched = n * int(query_lens.max()) * longest
    packed = bucket_length(int(query_lens.sum()), device_type="cpu") * bucket_length(
        int(seq_lens.sum()), device_type="cpu"
    )
    return batched < packed


class FlexMetadataBuilder(MetadataBuilder[FlexMetadata]):
    """Turns the step's common metadata into `FlexMetadata` (one plan for all layers).

    Batch order does not matter (every request is a segment of the packed rows);
    ``common_prefix_len`` is accepted and ignored (no cascade).
    """

    def build(
        self, common: CommonAttentionMetadata, *, common_prefix_len: int = 0
    ) -> FlexMetadata:
        """Plan one step.

        Raises
        ------
        ValueError
            When the block table has too few columns for the longest sequence.
        """
        block_size = self.kv_cache_spec.block_size
        block_table = common.block_table
        num_reqs = common.num_reqs
        capacity = block_table.shape[1] * block_size
        if num_reqs > 0 and common.max_seq_len > capacity:
            raise ValueError(
                f"block_table has {block_table.shape[1]} columns of {block_size} tokens "
                f"({capacity} tokens) but max_seq_len is {common.max_seq_len}; the engine "
                "must give every request enough block-table columns for its whole sequence"
            )
        device = block_table.device
        seq_lens = common.seq_lens_cpu[:num_reqs].to(torch.int64)
        query_lens = (common.query_start_loc_cpu[1:] - common.query_start_loc_cpu[:-1])[
            :num_reqs
        ].to(torch.int64)
        if num_reqs > 0 and _batched_is_cheaper(seq_lens, query_lens, device.type):
            return self._build_batched(common, seq_lens, query_lens)
        return self._build_packed(common, seq_lens, query_lens)

    def _build_batched(
        self, common: CommonAttentionMetadata, seq_lens: torch.Tensor, query_lens: torch.Tensor
    ) -> FlexMetadata:
        """One flex batch row per request: its query tokens, its keys (the decode layout)."""
        block_size = self.kv_cache_spec.block_size
        block_table = common.block_table
        device = block_table.device
        num_reqs = common.num_reqs
        b_pad = batch_bucket(num_reqs, device_type=device.type)
        max_q = int(query_lens.max())
        # CPU (eager) runs any query length; CUDA pads it to a bucket to bound the compiles.
        t_pad = max_q if max_q == 1 or device.type != "cuda" else bucket_length(
            max_q, device_type=device.type)
        s_pad = bucket_length(int(seq_lens.max()), device_type=device.type)
        lens = torch.zeros(b_pad, dtype=torch.int64)
        lens[:num_reqs] = seq_lens
        qlens = torch.zeros(b_pad, dtype=torch.int64)
        qlens[:num_reqs] = query_lens
        starts = torch.zeros(b_pad, dtype=torch.int64)
        starts[:num_reqs] = common.query_start_loc_cpu[:num_reqs].to(torch.int64)
        reqs = torch.arange(b_pad, dtype=torch.int64)
        i = torch.arange(t_pad, dtype=torch.int64)[None, :]
        has_q = i < qlens[:, None]
        q_rows = torch.where(has_q, starts[:, None] + i, -1)
        q_req = torch.where(has_q, reqs[:, None], PAD_QUERY_REQ)
        first_q = lens - qlens
        q_pos = torch.where(has_q, first_q[:, None] + i, 0)
        pos = torch.arange(s_pad, dtype=torch.int64)[None, :]
        valid = pos < lens[:, None]
        kv_req = torch.where(valid, reqs[:, None], PAD_KEY_REQ)
        kv_pos = pos.expand(b_pad, s_pad)
        kv_first_q = first_q[:, None].expand(b_pad, s_pad)
        valid_d = valid.to(device)
        kv_pos_d = kv_pos.contiguous().to(device)
        cols = (kv_pos_d // block_size).clamp(max=block_table.shape[1] - 1)
        rows = reqs.clamp(max=max(num_reqs - 1, 0)).to(device)[:, None].expand(b_pad, s_pad)
        blocks = block_table[rows, cols].to(torch.int64)
        kv_slots = torch.where(valid_d, blocks * block_size + kv_pos_d % block_size, 0)
        return FlexMetadata(
            q_rows=q_rows.to(device),
            q_req=q_req.to(device),
            q_pos=q_pos.to(device),
            kv_req=kv_req.to(device),
            kv_pos=kv_pos_d,
            kv_slots=kv_slots,
            kv_first_q=kv_first_q.contiguous().to(device),
            num_actual_tokens=common.num_actual_tokens,
            causal=common.causal,
        )

    def _build_packed(
        self, common: CommonAttentionMetadata, seq_lens: torch.Tensor, query_lens: torch.Tensor
    ) -> FlexMetadata:
        """All query tokens in one flex row, all requests' keys in one packed key row."""
        block_size = self.kv_cache_spec.block_size
        block_table = common.block_table
        device = block_table.device
        num_reqs = common.num_reqs
        reqs = torch.arange(num_reqs, dtype=torch.int64)
        first_q = seq_lens - query_lens
        num_tokens = int(query_lens.sum())
        num_keys = int(seq_lens.sum())
        t_pad = bucket_length(max(num_tokens, common.num_actual_tokens), device_type=device.type)
        s_pad = bucket_length(num_keys, device_type=device.type)

        q_req = torch.full((t_pad,), PAD_QUERY_REQ, dtype=torch.int64)
        q_pos = torch.zeros(t_pad, dtype=torch.int64)
        q_req[:num_tokens] = torch.repeat_interleave(reqs, query_lens)
        q_start = torch.cumsum(query_lens, 0) - query_lens
        q_pos[:num_tokens] = (
            torch.arange(num_tokens) - q_start[q_req[:num_tokens]] + first_q[q_req[:num_tokens]]
        )

        kv_req = torch.full((s_pad,), PAD_KEY_REQ, dtype=torch.int64)
        kv_pos = torch.zeros(s_pad, dtype=torch.int64)
        kv_first_q = torch.zeros(s_pad, dtype=torch.int64)
        kv_req[:num_keys] = torch.repeat_interleave(reqs, seq_lens)
        k_start = torch.cumsum(seq_lens, 0) - seq_lens
        kv_pos[:num_keys] = torch.arange(num_keys) - k_start[kv_req[:num_keys]]
        kv_first_q[:num_keys] = first_q[kv_req[:num_keys]]

        kv_req_d = kv_req.to(device)
        kv_pos_d = kv_pos.to(device)
        kv_slots = torch.zeros(s_pad, dtype=torch.int64, device=device)
        rows = kv_req_d[:num_keys]
        blocks = block_table[rows, kv_pos_d[:num_keys] // block_size].to(torch.int64)
        kv_slots[:num_keys] = blocks * block_size + kv_pos_d[:num_keys] % block_size
        q_rows = torch.full((t_pad,), -1, dtype=torch.int64)
        q_rows[:num_tokens] = torch.arange(num_tokens)
        return FlexMetadata(
            q_rows=q_rows[None].to(device),
            q_req=q_req[None].to(device),
            q_pos=q_pos[None].to(device),
            kv_req=kv_req_d[None],
            kv_pos=kv_pos_d[None],
            kv_slots=kv_slots[None],
            kv_first_q=kv_first_q[None].to(device),
            num_actual_tokens=common.num_actual_tokens,
            causal=common.causal,
        )

"""The torch reference for multi-head latent attention (MLA): the oracle every MLA backend is
checked against.

MLA impl contract (every MLA backend follows it; the conformance suite checks it):

* KV-cache shape ``[num_blocks, block_size, L + R]``: one latent "head" per token, no K/V
  doubling. ``L`` is ``kv_lora_rank`` (the normalised compressed latent ``c``), ``R`` is
  ``rope_head_dim`` (the shared, already-roped key part ``k_pe``). Block 0 is the null block.
* ``do_kv_cache_update(key, value, kv_cache, slot_mapping)``: ``key`` is ``[T, 1, L + R]``
  (``c`` concatenated with ``k_pe``); ``value`` is ignored (it may be the same tensor);
  ``slot_mapping`` ``[T]`` int64 with ``-1`` for padding tokens, which are skipped.
* ``forward(query, key, value, kv_cache, metadata, *, output=None)``: ``query`` is
  ``[T, H, L + R]`` (the absorbed ``q_nope @ W_UK`` concatenated with the roped ``q_pe``);
  returns ``[T, H, L]``, the attention output in latent space (before ``W_UV``). Scores are
  ``scale * q·row`` over all ``L + R`` dims of each cached row; values are the first ``L`` dims
  of each row. Causal with the query aligned to the end of its sequence, as for every backend.
* FP8 latent cache (``kv_cache_dtype`` ``"fp8_e4m3"`` / ``"fp8_e5m2"``): the write stores
  ``fp8(saturate(row / k_scale))`` (`pagedcore.attention.kv_quant.quantize_fp8`) and attention
  reads ``fp8 * k_scale``, for the scores and the values alike: one per-layer scale for the
  whole row, since the values are the row's first ``L`` dims (``v_scale`` is not used; the
  engine's calibration sets both from the same rows).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import attrs

from pagedcore.attention.backend import AttentionImpl, MetadataBuilder
from pagedcore.attention.mla import MLAAttentionBackend, check_mla_cache_shape

if TYPE_CHECKING:
    import torch
    from typing_extensions import Unpack

    from pagedcore.attention.backend import AttentionImplOptions
    from pagedcore.attention.metadata import CommonAttentionMetadata

__all__ = [
    "MLAImpl",
    "MLAImplBase",
    "ReferenceMLABackend",
    "ReferenceMLAMetadata",
    "ReferenceMLAMetadataBuilder",
    "check_mla_cache_dtype",
    "check_mla_cache_shape",
    "check_mla_write_args",
    "read_mla_rows",
    "write_mla_cache",
]


M = TypeVar("M")


def check_mla_write_args(
    key: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Raise a clear `ValueError` unless ``key`` ``[T, 1, L + R]``, ``kv_cache``
    ``[N, B, L + R]`` and ``slot_mapping`` ``[T']`` (``T' <= T``) fit together."""
    if key.dim() != 3 or key.shape[1] != 1:
        raise ValueError(f"MLA key must be [T, 1, L + R], got {tuple(key.shape)}")
    if kv_cache.dim() != 3 or kv_cache.shape[-1] != key.shape[-1]:
        raise ValueError(
            f"MLA kv_cache must be [num_blocks, block_size, {key.shape[-1]}], "
            f"got {tuple(kv_cache.shape)}"
        )
    if slot_mapping.dim() != 1:
        raise ValueError(f"slot_mapping must be [T], got {tuple(slot_mapping.shape)}")
    if key.shape[0] < slot_mapping.shape[0]:
        raise ValueError(
            f"key has {key.shape[0]} tokens but slot_mapping has {slot_mapping.shape[0]}"
        )


def write_mla_cache(
    key: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: torch.Tensor | float | None = None,
) -> None:
    """Scatter ``key`` ``[T, 1, L + R]`` into ``kv_cache`` ``[N, B, L + R]`` at ``slot_mapping``.

    Tokens whose slot is ``-1`` (padding) are skipped. There is no host sync (no boolean
    indexing): every token writes to its slot clamped to 0, and a padding token writes back
    the value slot 0 already holds, so slot 0 (in the null block) is left unchanged. Shapes
    are checked with clear errors. An fp8 `kv_cache` needs `k_scale` (a float or a ``[1]``
    float32 tensor): rows are stored as ``quantize_fp8(row, k_scale)``.
    """
    import torch

    check_mla_write_args(key, kv_cache, slot_mapping)
    num_tokens = slot_mapping.shape[0]
    slots = slot_mapping.to(kv_cache.device).long()
    valid = (slots >= 0).unsqueeze(1)
    index = slots.clamp(min=0)
    rows = key[:num_tokens, 0]
    if kv_cache.dtype.itemsize == 1:
        from pagedcore.attention.kv_quant import quantize_fp8

        if k_scale is None:
            raise ValueError("an fp8 MLA cache needs k_scale (the layer's dequantization "
                             "scale); the impl passes it when kv_cache_dtype is fp8")
        # Scatter the fp8 bytes (index ops on float8 tensors are not implemented everywhere).
        rows = quantize_fp8(rows, k_scale, kv_cache.dtype).view(torch.uint8)
        flat = kv_cache.view(torch.uint8).view(-1, kv_cache.shape[-1])
    else:
        rows = rows.to(kv_cache.dtype)
        flat = kv_cache.view(-1, kv_cache.shape[-1])
    flat.index_copy_(0, index, torch.where(valid, rows, flat.index_select(0, index)))


def read_mla_rows(kv_cache: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor,
                  k_scale: torch.Tensor | float | None, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows ``kv_cache[blocks, offsets]`` (``[S, L + R]``) in `dtype`: an fp8 cache
    dequantized as ``float32(fp8) * k_scale`` (what an MLA kernel reads)."""
    import torch

    if kv_cache.dtype.itemsize != 1:
        return kv_cache[blocks, offsets].to(dtype)
    from pagedcore.attention.kv_quant import dequantize_fp8

    if k_scale is None:
        raise ValueError("an fp8 MLA cache needs k_scale to be read")
    raw = kv_cache.view(torch.uint8)[blocks, offsets].view(kv_cache.dtype)
    return dequantize_fp8(raw, k_scale).to(dtype)


def check_mla_cache_dtype(impl: AttentionImpl[Any], kv_cache: torch.Tensor) -> None:
    """Raise a ValueError when the cache's element size disagrees with the impl's
    ``kv_cache_dtype`` (an fp8 cache for an ``"auto"`` impl, or the reverse)."""
    fp8_cache = kv_cache.dtype.itemsize == 1
    if fp8_cache != impl.kv_fp8:
        raise ValueError(
            f"the MLA cache is {kv_cache.dtype} but the layer was built with kv_cache_dtype="
            f"{impl.kv_cache_dtype!r}; allocate the cache with the backend's "
            "get_kv_cache_shape and pagedcore.attention.kv_quant.kv_cache_torch_dtype"
        )


@attrs.frozen(kw_only=True)
class ReferenceMLAMetadata:
    """The reference's plan: the step's common metadata, read on the CPU per request."""

    common: CommonAttentionMetadata
    query_lens: tuple[int, ...]
    seq_lens: tuple[int, ...]


class ReferenceMLAMetadataBuilder(MetadataBuilder[ReferenceMLAMetadata]):
    """Keeps the common metadata and the per-request lengths as Python ints."""

    reorder_batch_threshold: ClassVar[int] = 1

    def build(
        self, common: CommonAttentionMetadata, *, common_prefix_len: int = 0
    ) -> ReferenceMLAMetadata:
        return ReferenceMLAMetadata(
            common=common,
            query_lens=tuple(int(x) for x in common.query_lens_cpu.tolist()),
            seq_lens=tuple(int(x) for x in common.seq_lens_cpu.tolist()),
        )


class MLAImplBase(AttentionImpl[M]):
    """What every MLA impl shares: the ``kv_lora_rank`` argument, one latent KV head, no
    ALiBi / window / soft-cap, and the cache write (see the module docstring for the contract).

    Parameters
    ----------
    num_heads:
        Query heads ``H``.
    head_size:
        ``L + R`` (``kv_lora_rank + rope_head_dim``).
    scale:
        Softmax scale on ``q·row``.
    kv_lora_rank:
        ``L``: the leading dims of each cached row that are also the values. Keyword-only;
        required.
    num_kv_heads:
        Must be 1 (or None).
    **options:
        `AttentionImpl`'s other keyword arguments; only ``kv_cache_dtype`` may be set.
    """

    #: The error for ALiBi, a sliding window or a soft-cap (subclasses name themselves).
    unsupported_features: ClassVar[str] = (
        "MLA backends support neither ALiBi, sliding window nor soft-cap"
    )

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        *,
        kv_lora_rank: int | None = None,
        num_kv_heads: int | None = None,
        **options: Unpack[AttentionImplOptions],
    ) -> None:
        if num_kv_heads not in (None, 1):
            raise ValueError(f"MLA has one latent KV head; got num_kv_heads={num_kv_heads}")
        if kv_lora_rank is None or not 0 < kv_lora_rank < head_size:
            raise ValueError(
                f"MLA needs kv_lora_rank in (0, head_size={head_size}) to know which dims are "
                f"values; got kv_lora_rank={kv_lora_rank}"
            )
        self.kv_lora_rank = kv_lora_rank
        super().__init__(num_heads, head_size, scale, num_kv_heads=1, **options)

    def check_supported(self) -> None:
        if self.alibi_slopes is not None or self.sliding_window is not None or (
            self.logits_soft_cap is not None
        ):
            raise ValueError(self.unsupported_features)

    def do_kv_cache_update(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Write ``key`` ``[T, 1, L + R]`` into ``kv_cache`` ``[N, B, L + R]``; ``value`` is
        ignored; slots of ``-1`` are skipped; an fp8 cache stores ``row / k_scale``."""
        check_mla_cache_dtype(self, kv_cache)
        scale = self.kv_scales_on(kv_cache.device)[0] if self.kv_fp8 else None
        write_mla_cache(key, kv_cache, slot_mapping, k_scale=scale)


class MLAImpl(MLAImplBase[ReferenceMLAMetadata]):
    """Reference MLA over a paged latent cache; parameters as `MLAImplBase`."""

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: ReferenceMLAMetadata,
        *,
        output: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Latent-space attention, one request at a time, softmax in float32 (or float64).

        Parameters
        ----------
        query:
            ``[T, H, L + R]`` in the model dtype.
        key, value:
            Ignored (history and this step are read from the cache).
        kv_cache:
            ``[num_blocks, block_size, L + R]``.
        metadata:
            From `ReferenceMLAMetadataBuilder.build`.
        output:
            Optional ``[T, H, L]`` buffer.

        Returns
        -------
        torch.Tensor
            ``[T, H, L]`` in the query dtype; rows of padding tokens are zero.
        """
        import torch

        common = metadata.common
        num_tokens, num_heads, dim = query.shape
        if dim != kv_cache.shape[-1] or num_heads != self.num_heads:
            raise ValueError(
                f"query {tuple(query.shape)} does not match num_heads={self.num_heads} and the "
                f"cache row size {kv_cache.shape[-1]}"
            )
        check_mla_cache_dtype(self, kv_cache)
        lat = self.kv_lora_rank
        block_size = kv_cache.shape[1]
        acc = torch.promote_types(query.dtype, torch.float32)
        k_scale = self.kv_scales_on(kv_cache.device)[0] if self.kv_fp8 else None
        out = torch.zeros(num_tokens, num_heads, lat, dtype=query.dtype, device=query.device)
        starts = common.query_start_loc_cpu.tolist()
        table = common.block_table
        lens = zip(metadata.query_lens, metadata.seq_lens, strict=True)
        for req, (q_len, seq_len) in enumerate(lens):
            if q_len == 0:
                continue
            start = int(starts[req])
            positions = torch.arange(seq_len, device=kv_cache.device)
            blocks = table[req, positions // block_size].long()
            rows = read_mla_rows(kv_cache, blocks, positions % block_size, k_scale,
                                 acc)  # [S, L + R]
            q = query[start : start + q_len].to(acc)  # [q_len, H, L + R]
            scores = torch.einsum("qhd,sd->hqs", q, rows) * self.scale
            q_pos = torch.arange(seq_len - q_len, seq_len, device=kv_cache.device)
            visible = positions[None, :] <= q_pos[:, None]  # [q_len, S]
            scores = scores.masked_fill(~visible[None], float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            out[start : start + q_len] = torch.einsum(
                "hqs,sl->qhl", probs, rows[:, :lat]
            ).to(query.dtype)
        if output is not None:
            output[:num_tokens].copy_(out)
            return output
        return out


class ReferenceMLABackend(MLAAttentionBackend):
    """Torch reference MLA backend: the oracle for MLA, and the CPU default for MLA models."""

    name: ClassVar[str] = "reference_mla"
    priority: ClassVar[int] = 1000
    supported_dtypes: ClassVar[tuple[str, ...]] = ("float32", "float16", "bfloat16")
    supported_devices: ClassVar[tuple[str, ...]] = ("cpu", "cuda")
    supported_kv_cache_dtypes: ClassVar[tuple[str, ...]] = ("auto", "fp8_e4m3", "fp8_e5m2")

    @classmethod
    def get_builder_cls(cls) -> type[MetadataBuilder[Any]]:
        return ReferenceMLAMetadataBuilder

    @classmethod
    def get_impl_cls(cls) -> type[AttentionImpl[Any]]:
        return MLAImpl

"""Planted broken backends: each is the reference with one classic paged-attention bug.

The conformance suite must reject every one of them (tests/conformance/test_suite.py).
"""

from __future__ import annotations

from typing import Any, ClassVar

import attrs
import torch

from pagedcore.attention.backend import AttentionBackend, AttentionImpl, MetadataBuilder
from pagedcore.attention.kv_quant import FP8_MAX, normalize_kv_cache_dtype
from pagedcore.attention.metadata import CommonAttentionMetadata
from pagedcore.reference import ReferenceBackend
from pagedcore.reference.impl import ReferenceImpl
from pagedcore.reference.metadata import (
    ReferenceMetadata,
    ReferenceMetadataBuilder,
    RequestGroup,
)


def _backend(
    name: str,
    builder: type[MetadataBuilder[Any]] = ReferenceMetadataBuilder,
    impl: type[AttentionImpl[Any]] = ReferenceImpl,
) -> type[AttentionBackend]:
    def get_builder_cls(cls: type[AttentionBackend]) -> type[MetadataBuilder[Any]]:
        return builder

    def get_impl_cls(cls: type[AttentionBackend]) -> type[AttentionImpl[Any]]:
        return impl

    return type(
        name,
        (ReferenceBackend,),
        {
            "name": name,
            "get_builder_cls": classmethod(get_builder_cls),
            "get_impl_cls": classmethod(get_impl_cls),
        },
    )


class _LogicalBlocksBuilder(ReferenceMetadataBuilder):
    """(a) Ignores block_table: reads logical block j from physical block j."""

    def build(
        self, common: CommonAttentionMetadata, *, common_prefix_len: int = 0
    ) -> ReferenceMetadata:
        b, width = common.block_table.shape
        logical = torch.arange(width, dtype=torch.int32, device=common.block_table.device)
        return super().build(attrs.evolve(common, block_table=logical.expand(b, width)))


class _WholeLastBlockBuilder(ReferenceMetadataBuilder):
    """(b) Decodes attend over the whole last block: unused tail slots (NaN) leak in."""

    def _group(
        self,
        common: CommonAttentionMetadata,
        reqs: list[int],
        query_len: int,
        starts: list[int],
        seq_lens: list[int],
    ) -> RequestGroup:
        if query_len == 1:
            bsz = self.block_size
            seq_lens = [-(-s // bsz) * bsz for s in seq_lens]
        return super()._group(common, reqs, query_len, starts, seq_lens)


class _OffByOneWriteImpl(ReferenceImpl):
    """(c) Writes K/V one slot too far (wrapping around, as an unchecked kernel would)."""

    def do_kv_cache_update(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        total = kv_cache.shape[1] * kv_cache.shape[2]
        shifted = torch.where(slot_mapping >= 0, (slot_mapping + 1) % total, slot_mapping)
        super().do_kv_cache_update(key, value, kv_cache, shifted)


class _WritesPaddingImpl(ReferenceImpl):
    """(d) Does not skip -1 slots: padding K/V lands in the cache's last slot."""

    def do_kv_cache_update(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        for half, x in ((kv_cache[0], key), (kv_cache[1], value)):
            half.view(-1, *half.shape[2:])[slot_mapping] = x.to(half.dtype)


class _WrongGQAImpl(ReferenceImpl):
    """(e) Query head h reads KV head h % Hkv instead of h // (Hq // Hkv)."""

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        kv_cache: torch.Tensor, metadata: ReferenceMetadata, *,
        output: torch.Tensor | None = None,
    ) -> torch.Tensor:
        hkv, group = self.num_kv_heads, self.num_queries_per_kv
        perm = torch.tensor([g * hkv + j for j in range(hkv) for g in range(group)])
        perm = perm.to(query.device)
        out = super().forward(query[:, perm].contiguous(), key, value, kv_cache, metadata)
        result = torch.empty_like(out) if output is None else output
        result[:, perm] = out
        return result


class _WindowOffByOneImpl(ReferenceImpl):
    """(f) Sliding window one key too wide."""

    def setup(self) -> None:
        super().setup()
        if self.sliding_window is not None:
            self.sliding_window += 1


class _AlibiSignImpl(ReferenceImpl):
    """(g) ALiBi bias with the wrong sign."""

    def setup(self) -> None:
        super().setup()
        if self._slopes is not None:
            self._slopes = -self._slopes


class _NoSoftCapImpl(ReferenceImpl):
    """(h) Ignores the logits soft-cap."""

    def setup(self) -> None:
        super().setup()
        self.logits_soft_cap = None


class _IgnoresOutputImpl(ReferenceImpl):
    """(i) Returns a fresh tensor and leaves the caller's ``output=`` buffer untouched."""

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        kv_cache: torch.Tensor, metadata: ReferenceMetadata, *,
        output: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return super().forward(query, key, value, kv_cache, metadata)


class _WrongBelow32Impl(ReferenceImpl):
    """(k) Right at head size 32 and above, wrong below (a tile assuming D >= 32): only the
    small sizes of ANY_HEAD_SIZES catch it (the random test models use D = 16)."""

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        kv_cache: torch.Tensor, metadata: ReferenceMetadata, *,
        output: torch.Tensor | None = None,
    ) -> torch.Tensor:
        result = super().forward(query, key, value, kv_cache, metadata, output=output)
        if self.head_size < 32:
            result[..., self.head_size // 2:] = 0
        return result


class _IgnoresScaleImpl(ReferenceImpl):
    """(j) Uses head_size ** -0.5 instead of the scale it was given."""

    def setup(self) -> None:
        super().setup()
        self.scale = self.head_size**-0.5


class _MutatesPlanImpl(ReferenceImpl):
    """(k) Consumes the plan: a second layer reusing the step's metadata sees no requests."""

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        kv_cache: torch.Tensor, metadata: ReferenceMetadata, *,
        output: torch.Tensor | None = None,
    ) -> torch.Tensor:
        out = super().forward(query, key, value, kv_cache, metadata, output=output)
        object.__setattr__(metadata, "groups", metadata.groups[:1])
        return out


class _ReadsWithOtherScalesImpl(ReferenceImpl):
    """Writes the fp8 cache with the layer's scales, reads it with `read_scales()`."""

    def read_scales(self) -> tuple[float, float]:
        raise NotImplementedError

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        kv_cache: torch.Tensor, metadata: ReferenceMetadata, *,
        output: torch.Tensor | None = None,
    ) -> torch.Tensor:
        scales = self.kv_scales_on(kv_cache.device)
        saved = [t.clone() for t in scales]
        for t, read in zip(scales, self.read_scales(), strict=True):
            t.fill_(read)
        try:
            return super().forward(query, key, value, kv_cache, metadata, output=output)
        finally:
            for t, old in zip(scales, saved, strict=True):
                t.copy_(old)


class _IgnoresKVScaleImpl(_ReadsWithOtherScalesImpl):
    """(m) Quantizes the fp8 cache with the layer's scales but reads it without them (a
    kernel that forgot the dequantization multiply)."""

    def read_scales(self) -> tuple[float, float]:
        return 1.0, 1.0


class _DropsSinkImpl(ReferenceImpl):
    """(n) Accepts attention-sink logits and never adds them to the softmax."""

    def sinks_on(self, device: torch.device) -> torch.Tensor | None:
        return None


class _IgnoresOutputIn16BitImpl(_IgnoresOutputImpl):
    """(o) Fills ``output=`` in float32 only: its 16-bit path returns a fresh tensor."""

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        kv_cache: torch.Tensor, metadata: ReferenceMetadata, *,
        output: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if query.dtype == torch.float32:
            return ReferenceImpl.forward(self, query, key, value, kv_cache, metadata,
                                         output=output)
        return super().forward(query, key, value, kv_cache, metadata, output=output)


class _MemoisedPlanBuilder(ReferenceMetadataBuilder):
    """(p) Reuses its previous plan for a step of the same shape (requests, tokens): right
    for a replayed CUDA graph's step, wrong for an eager step whose lengths and block table
    moved on."""

    def build(
        self, common: CommonAttentionMetadata, *, common_prefix_len: int = 0
    ) -> ReferenceMetadata:
        key = (common.num_reqs, common.num_actual_tokens)
        memo: tuple[Any, ReferenceMetadata] | None = getattr(self, "_memo", None)
        if memo is not None and memo[0] == key:
            return memo[1]
        plan = super().build(common, common_prefix_len=common_prefix_len)
        self._memo = (key, plan)
        return plan


class _FrozenScalesImpl(_ReadsWithOtherScalesImpl):
    """(q) Its read path keeps the fp8 scales the impl was built with: `set_kv_scales`
    afterwards (the engine's calibration on the first prefill) reaches the write only."""

    def setup(self) -> None:
        super().setup()
        self._built_with = (float(self.k_scale), float(self.v_scale))

    def read_scales(self) -> tuple[float, float]:
        return self._built_with


class _NoSaturationImpl(ReferenceImpl):
    """(r) Its fp8 cache write does not saturate: a value past the format's largest finite
    one is stored as NaN (a GPU convert without ``satfinite``)."""

    def do_kv_cache_update(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        if kv_cache.dtype.itemsize == 1:
            bound = FP8_MAX[normalize_kv_cache_dtype(self.kv_cache_dtype)]
            k_scale, v_scale = (float(t) for t in self.kv_scales_on(kv_cache.device))
            key = key.masked_fill(key.float().abs() / k_scale > bound, float("nan"))
            value = value.masked_fill(value.float().abs() / v_scale > bound, float("nan"))
        super().do_kv_cache_update(key, value, kv_cache, slot_mapping)


class _EightRowRingBuilder(ReferenceMetadataBuilder):
    """(s) Requests 8 and up read the block table row of request i - 8 (per-request rows kept
    in an 8-entry staging ring)."""

    def build(
        self, common: CommonAttentionMetadata, *, common_prefix_len: int = 0
    ) -> ReferenceMetadata:
        rows = torch.arange(common.num_reqs, device=common.block_table.device) % 8
        table = common.block_table.index_select(0, rows)
        return super().build(attrs.evolve(common, block_table=table),
                             common_prefix_len=common_prefix_len)


class _ClaimsMoreBackend(ReferenceBackend):
    """(l) Declares an extra head size its validate_configuration then rejects."""

    name: ClassVar[str] = "claims_more"
    supported_head_sizes: ClassVar[tuple[int, ...] | None] = (64, 128)

    @classmethod
    def validate_configuration(cls, cfg: Any) -> list[str]:
        reasons = super().validate_configuration(cfg)
        if cfg.head_size == 64:
            reasons.append("head size 64 is not really implemented")
        return reasons


class _SplitEdgeMisreadBuilder(ReferenceMetadataBuilder):
    """Reads the row of position p + 1 for every history position p = 2047 (mod 2048), as a
    split-KV kernel with an off-by-one at the edges of its 2,048-row segments would. Only the
    full suite's 2,100-token contexts reach position 2047."""

    def build(
        self, common: CommonAttentionMetadata, *, common_prefix_len: int = 0
    ) -> ReferenceMetadata:
        plan = super().build(common, common_prefix_len=common_prefix_len)
        return attrs.evolve(plan, groups=tuple(_misread_edges(g) for g in plan.groups))


def _misread_edges(group: RequestGroup) -> RequestGroup:
    """`group` with the slot of history position p + 1 read for p = 2047 (mod 2048)."""
    slots = group.slots.clone()
    for i, seq_len in enumerate(group.seq_lens.tolist()):
        for p in range(2047, seq_len - group.query_len - 1, 2048):
            slots[i, p] = group.slots[i, p + 1]
    return attrs.evolve(group, slots=slots)


IgnoresBlockTable = _backend("ignores_block_table", builder=_LogicalBlocksBuilder)

#: Passes the quick suite, and the `long` batch in 16-bit dtypes; the `needles` batch rejects
#: it (tests/conformance/test_conformance_suite.py).
SplitEdgeMisread = _backend("split_edge_misread", builder=_SplitEdgeMisreadBuilder)

BROKEN: dict[str, type[AttentionBackend]] = {
    "ignores_block_table": IgnoresBlockTable,
    "reads_unused_tail": _backend("reads_unused_tail", builder=_WholeLastBlockBuilder),
    "writes_off_by_one": _backend("writes_off_by_one", impl=_OffByOneWriteImpl),
    "writes_padding_slots": _backend("writes_padding_slots", impl=_WritesPaddingImpl),
    "wrong_gqa_mapping": _backend("wrong_gqa_mapping", impl=_WrongGQAImpl),
    "window_off_by_one": _backend("window_off_by_one", impl=_WindowOffByOneImpl),
    "alibi_sign": _backend("alibi_sign", impl=_AlibiSignImpl),
    "ignores_soft_cap": _backend("ignores_soft_cap", impl=_NoSoftCapImpl),
    "ignores_output_buffer": _backend("ignores_output_buffer", impl=_IgnoresOutputImpl),
    "ignores_scale": _backend("ignores_scale", impl=_IgnoresScaleImpl),
    "wrong_below_head_size_32": _backend("wrong_below_head_size_32", impl=_WrongBelow32Impl),
    "consumes_plan": _backend("consumes_plan", impl=_MutatesPlanImpl),
    "claims_more_than_it_serves": _ClaimsMoreBackend,
    "ignores_kv_scale": _backend("ignores_kv_scale", impl=_IgnoresKVScaleImpl),
    "drops_sink": _backend("drops_sink", impl=_DropsSinkImpl),
    "ignores_output_in_16_bit": _backend("ignores_output_in_16_bit",
                                         impl=_IgnoresOutputIn16BitImpl),
    "memoises_plan": _backend("memoises_plan", builder=_MemoisedPlanBuilder),
    "frozen_kv_scales": _backend("frozen_kv_scales", impl=_FrozenScalesImpl),
    "fp8_write_without_saturation": _backend("fp8_write_without_saturation",
                                             impl=_NoSaturationImpl),
}

#: Caught only by a full-suite batch (the case filter that reaches it).
BROKEN_FULL: dict[str, tuple[type[AttentionBackend], str]] = {
    "eight_row_ring": (_backend("eight_row_ring", builder=_EightRowRingBuilder), "wide/"),
}

"""The backend descriptor's declarations, the selector input, and the metadata helpers."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
import torch

from pagedcore.attention import (
    AttentionBackend,
    AttentionConfig,
    AttentionImpl,
    CommonAttentionMetadata,
    MetadataBuilder,
    MultipleOf,
    decode_first_order,
    split_decodes_and_prefills,
)


class _Builder(MetadataBuilder[CommonAttentionMetadata]):
    def build(
        self, common: CommonAttentionMetadata, *, common_prefix_len: int = 0
    ) -> CommonAttentionMetadata:
        return common


class _Impl(AttentionImpl[CommonAttentionMetadata]):
    def do_kv_cache_update(self, key: Any, value: Any, kv_cache: Any, slot_mapping: Any) -> None:
        return None

    def forward(self, query: Any, key: Any, value: Any, kv_cache: Any, metadata: Any, *,
                output: Any = None) -> Any:
        return query


class _Backend(AttentionBackend):
    name: ClassVar[str] = "fake"
    supported_dtypes: ClassVar[tuple[str, ...]] = ("float16", "bfloat16")
    supported_head_sizes: ClassVar[tuple[int, ...] | None] = (64, 128)
    supported_block_sizes: ClassVar[tuple[int | MultipleOf, ...]] = (16, MultipleOf(64))
    supported_devices: ClassVar[tuple[str, ...]] = ("cuda",)
    supports_sliding_window: ClassVar[bool] = True

    @classmethod
    def get_builder_cls(cls) -> type[MetadataBuilder[Any]]:
        return _Builder

    @classmethod
    def get_impl_cls(cls) -> type[AttentionImpl[Any]]:
        return _Impl

    @classmethod
    def get_kv_cache_shape(cls, num_blocks: int, block_size: int, num_kv_heads: int,
                           head_size: int, cache_dtype: str = "auto") -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_size)


def _cfg(**kw: Any) -> AttentionConfig:
    base: dict[str, Any] = dict(head_size=128, dtype="bfloat16", block_size=16, device="cuda")
    base.update(kw)
    return AttentionConfig(**base)


def test_valid_configuration_has_no_reasons() -> None:
    assert _Backend.validate_configuration(_cfg()) == []
    assert _Backend.validate_configuration(_cfg(block_size=128, sliding_window=4096)) == []


def test_every_reason_is_reported() -> None:
    reasons = _Backend.validate_configuration(
        _cfg(head_size=96, dtype="float32", block_size=32, device="cpu", use_alibi=True,
             logits_soft_cap=30.0, use_mla=True)
    )
    text = "\n".join(reasons)
    for needle in ("head size 96", "float32", "block size 32", "device 'cpu'", "ALiBi",
                   "soft-cap", "MLA"):
        assert needle in text, (needle, reasons)
    assert "64, 128" in text and "multiple of 64" in text


def test_descriptor_is_never_instantiated() -> None:
    with pytest.raises(TypeError, match="static descriptor"):
        _Backend()


def test_incomplete_backend_is_abstract() -> None:
    import inspect

    class Missing(AttentionBackend):
        name = "missing"

    assert inspect.isabstract(Missing)


def test_attention_config_rejects_bad_values_with_the_field_name() -> None:
    with pytest.raises(ValueError, match="head_size"):
        _cfg(head_size=0)
    with pytest.raises(ValueError, match="block_size"):
        _cfg(block_size=-16)
    with pytest.raises(ValueError, match="dtype"):
        _cfg(dtype="int8")
    with pytest.raises(ValueError, match="sliding_window"):
        _cfg(sliding_window=0)


def test_attention_config_from_torch_objects() -> None:
    cfg = AttentionConfig.create(
        head_size=64, dtype=torch.float16, block_size=16, device=torch.device("cpu")
    )
    assert (cfg.dtype, cfg.device) == ("float16", "cpu")


def test_impl_checks_gqa_ratio_and_alibi_length() -> None:
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        _Impl(num_heads=6, head_size=64, scale=0.125, num_kv_heads=4)
    with pytest.raises(ValueError, match="one per query head"):
        _Impl(num_heads=4, head_size=64, scale=0.125, num_kv_heads=2, alibi_slopes=[1.0])
    impl = _Impl(num_heads=8, head_size=64, scale=0.125, num_kv_heads=2)
    assert impl.num_queries_per_kv == 4


def _common(query_lens: list[int], seq_lens: list[int]) -> CommonAttentionMetadata:
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    t = int(qsl[-1])
    return CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=sl, seq_lens_cpu=sl,
        num_reqs=len(query_lens), num_actual_tokens=t, max_query_len=max(query_lens),
        max_seq_len=max(seq_lens), block_table=torch.zeros(len(query_lens), 4, dtype=torch.int32),
        slot_mapping=torch.full((t,), -1, dtype=torch.int64),
        positions=torch.zeros(t, dtype=torch.int64),
    )


def test_split_decodes_and_prefills() -> None:
    common = _common([1, 1, 5, 3], [10, 20, 5, 30])
    assert split_decodes_and_prefills(common) == (2, 2, 2, 8)
    with pytest.raises(ValueError, match="decode-first"):
        split_decodes_and_prefills(common, decode_threshold=3)
    assert common.context_lens_cpu.tolist() == [9, 19, 0, 27]


def test_split_rejects_unordered_batches_and_reorder_fixes_them() -> None:
    lens = [4, 1, 2, 1]
    with pytest.raises(ValueError, match="decode-first"):
        split_decodes_and_prefills(_common(lens, [8, 8, 8, 8]))
    order = decode_first_order(lens)
    assert order == [1, 3, 0, 2]
    reordered = [lens[i] for i in order]
    assert split_decodes_and_prefills(_common(reordered, [8, 8, 8, 8])) == (2, 2, 2, 6)
    assert decode_first_order(lens, decode_threshold=2) == [1, 2, 3, 0]


# --- AttentionImpl constructor hooks: common checks, then check_supported, then setup ---


class _Recording(_Impl):
    """Records what each hook saw; refuses sliding windows."""

    def check_supported(self) -> None:
        seen = ("check_supported", self.num_kv_heads, self.sliding_window)
        self.calls: list[tuple[str, Any, Any]] = [seen]
        if self.sliding_window is not None:
            raise ValueError("no sliding window here; pick another backend")

    def setup(self) -> None:
        self.calls.append(("setup", self.num_queries_per_kv, self.alibi_slopes))


class _Extended(_Recording):
    """A subclass of an impl extends the hooks through super()."""

    def setup(self) -> None:
        super().setup()
        self.calls.append(("extended", None, None))


def test_hooks_run_in_order_with_every_argument_stored() -> None:
    impl = _Recording(8, 64, 0.125, num_kv_heads=2, alibi_slopes=[0.5] * 8)
    assert impl.calls == [("check_supported", 2, None), ("setup", 4, [0.5] * 8)]
    assert (impl.num_heads, impl.head_size, impl.scale) == (8, 64, 0.125)
    assert _Extended(4, 64, 1.0).calls[-2:] == [("setup", 1, None), ("extended", None, None)]


def test_check_supported_error_propagates_and_setup_is_skipped() -> None:
    seen: list[str] = []

    class _Tracked(_Recording):
        def setup(self) -> None:
            seen.append("setup")

    with pytest.raises(ValueError, match="no sliding window here"):
        _Tracked(8, 64, 0.1, sliding_window=16)
    assert seen == []


def test_default_hooks_refuse_nothing_and_add_nothing() -> None:
    impl = _Impl(4, 64, 0.1, sliding_window=8, logits_soft_cap=30.0, kv_cache_dtype="fp8_e4m3",
                  alibi_slopes=[1.0, 0.5, 0.25, 0.125])
    assert (impl.sliding_window, impl.logits_soft_cap, impl.kv_cache_dtype) == (
        8, 30.0, "fp8_e4m3"
    )
    assert set(vars(impl)) == {
        "num_heads", "head_size", "scale", "num_kv_heads", "num_queries_per_kv",
        "alibi_slopes", "sliding_window", "logits_soft_cap", "kv_cache_dtype",
        "sinks", "k_scale", "v_scale",
        # the (empty) per-device caches behind alibi_slopes_on, sinks_on, kv_scales_on
        "_alibi_on_device", "_sinks_on_device", "_scales_on_device",
    }
    assert impl._alibi_on_device == {}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_kv_heads": 3}, r"num_heads \(8\) must be a positive multiple of num_kv_heads \(3\)"),
        ({"alibi_slopes": [1.0]}, "alibi_slopes has 1 entries"),
        ({"sliding_window": 0}, "sliding_window must be positive or None, got 0"),
        ({"logits_soft_cap": -2.0}, "logits_soft_cap must be positive or None, got -2.0"),
    ],
)
def test_common_checks_run_before_the_hooks(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _Recording(8, 64, 0.1, **kwargs)


def test_fp8_and_sink_declarations_reach_the_selector() -> None:
    """``has_sink`` and an fp8 ``kv_cache_dtype`` are validated against the declarations
    (``supports_sink``, ``supported_kv_cache_dtypes``), with reasons naming them."""
    cfg = AttentionConfig(head_size=64, dtype="bfloat16", block_size=16, kv_cache_dtype="fp8",
                          has_sink=True, device="cuda")
    assert cfg.kv_cache_dtype == "fp8_e4m3"

    class _Plain(_Backend):
        supported_devices = ("cuda",)

    class _Fp8Sinks(_Plain):
        supported_kv_cache_dtypes = ("auto", "fp8_e4m3")
        supports_sink = True

    reasons = _Plain.validate_configuration(cfg)
    assert "attention sinks not supported" in reasons
    assert any("kv_cache_dtype fp8_e4m3 not supported" in r for r in reasons)
    assert _Fp8Sinks.validate_configuration(cfg) == []
    with pytest.raises(ValueError, match="has_sink must be True or False"):
        AttentionConfig(head_size=64, dtype="bfloat16", block_size=16, has_sink="yes")

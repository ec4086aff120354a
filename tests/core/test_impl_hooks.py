"""The impls use `AttentionImpl`'s constructor hooks (`check_supported`, `setup`).

Every impl without extra arguments inherits the base constructor (no ``__init__`` of its own)
and still refuses what it cannot serve with the same message as before the hooks existed.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pagedcore.attention.backend import AttentionImpl
from pagedcore.reference.mla import MLAImplBase

#: (module, class) of every impl that takes only `AttentionImpl`'s arguments.
PLAIN_IMPLS = [
    ("pagedcore.reference.impl", "ReferenceImpl"),
    ("pagedcore_triton.impl", "TritonAttentionImpl"),
    ("pagedcore_cuda_paged.impl", "CudaPagedImpl"),
    ("pagedcore_flash_attn.impl", "FlashAttnImpl"),
    ("pagedcore_toy_sdpa.impl", "ToySdpaImpl"),
]


def _impl(module: str, name: str) -> type[AttentionImpl[Any]]:
    cls: type[AttentionImpl[Any]] = getattr(pytest.importorskip(module), name)
    return cls


@pytest.mark.parametrize(("module", "name"), PLAIN_IMPLS)
def test_plain_impls_inherit_the_constructor(module: str, name: str) -> None:
    cls = _impl(module, name)
    assert "__init__" not in vars(cls), f"{name} re-declares __init__; override the hooks"
    assert cls.__init__ is AttentionImpl.__init__
    assert "check_supported" in vars(cls)
    impl = cls(8, 128, 0.09, num_kv_heads=2)
    assert (impl.num_heads, impl.num_kv_heads, impl.num_queries_per_kv) == (8, 2, 4)
    assert impl.scale == pytest.approx(0.09)


#: (module, class, constructor kwargs, error type, message) -- the messages from before the hooks.
REFUSALS = [
    ("pagedcore.reference.impl", "ReferenceImpl", {"kv_cache_dtype": "int8"}, ValueError,
     r"kv_cache_dtype 'int8' is not one of"),
    ("pagedcore_triton.impl", "TritonAttentionImpl", {"head_size": 72}, ValueError,
     "the triton backend does not serve head size 72"),
    ("pagedcore_triton.impl", "TritonAttentionImpl", {"sinks": [0.0] * 3}, ValueError,
     r"sinks has 3 entries, expected one per query head \(8\)"),
    ("pagedcore_cuda_paged.impl", "CudaPagedImpl", {"head_size": 72}, ValueError,
     "cuda_paged has kernels for head sizes .*, not 72; choose another backend"),
    ("pagedcore_flash_attn.impl", "FlashAttnImpl", {"head_size": 260}, ValueError,
     "head size 260 is not supported by the flash_attn backend"),
    ("pagedcore_flash_attn.impl", "FlashAttnImpl", {"kv_cache_dtype": "fp8_e4m3"}, ValueError,
     "kv_cache_dtype 'fp8_e4m3' is not supported by the flash_attn backend"),
    ("pagedcore_toy_sdpa.impl", "ToySdpaImpl", {"logits_soft_cap": 30.0}, NotImplementedError,
     r"toy_sdpa implements plain full attention only; got \['logits_soft_cap'\]"),
    ("pagedcore_toy_sdpa.impl", "ToySdpaImpl", {"kv_cache_dtype": "fp8_e4m3"},
     NotImplementedError, "toy_sdpa implements plain full attention only; got fp8_e4m3"),
]


@pytest.mark.parametrize(("module", "name", "kwargs", "error", "message"), REFUSALS)
def test_impls_refuse_what_they_cannot_serve(
    module: str, name: str, kwargs: dict[str, Any], error: type[Exception], message: str
) -> None:
    cls = _impl(module, name)
    head_size = kwargs.pop("head_size", 128)
    with pytest.raises(error, match=message):
        cls(8, head_size, 0.1, **kwargs)


def test_alibi_slopes_are_made_once_per_device() -> None:
    ref = _impl("pagedcore.reference.impl", "ReferenceImpl")(2, 64, 0.1, alibi_slopes=[0.5, 0.25])
    cpu = torch.device("cpu")
    slopes = ref.alibi_slopes_on(cpu)
    assert slopes is not None and slopes.dtype == torch.float32
    assert slopes.tolist() == [0.5, 0.25]
    assert ref.alibi_slopes_on(cpu) is slopes  # cached, not rebuilt per step
    plain = _impl("pagedcore.reference.impl", "ReferenceImpl")(2, 64, 0.1)
    assert plain.alibi_slopes_on(cpu) is None


def test_setup_state_is_built() -> None:
    fa = _impl("pagedcore_flash_attn.impl", "FlashAttnImpl")(4, 128, 0.1, sliding_window=4096)
    assert fa.window_size == (4095, 0)  # type: ignore[attr-defined]


MLA_IMPLS = [
    ("pagedcore.reference.mla", "MLAImpl", "MLA backends support neither ALiBi"),
    ("pagedcore_triton.mla", "TritonMLAImpl", "triton_mla supports neither ALiBi"),
]


@pytest.mark.parametrize(("module", "name", "refusal"), MLA_IMPLS)
def test_mla_impls_keep_kv_lora_rank_and_refuse_features(
    module: str, name: str, refusal: str
) -> None:
    cls: Any = _impl(module, name)
    assert "__init__" not in vars(cls) and issubclass(cls, MLAImplBase)
    impl = cls(16, 576, 0.05, kv_lora_rank=512)
    assert (impl.kv_lora_rank, impl.num_kv_heads, impl.num_queries_per_kv) == (512, 1, 16)
    with pytest.raises(ValueError, match="one latent KV head; got num_kv_heads=2"):
        cls(16, 576, 0.05, kv_lora_rank=512, num_kv_heads=2)
    with pytest.raises(ValueError, match=r"kv_lora_rank in \(0, head_size=576\)"):
        cls(16, 576, 0.05, kv_lora_rank=576)
    with pytest.raises(ValueError, match=r"kv_lora_rank in \(0, head_size=576\)"):
        cls(16, 576, 0.05)
    assert cls(16, 576, 0.05, kv_lora_rank=512, kv_cache_dtype="auto").kv_cache_dtype == "auto"
    for feature in ({"sliding_window": 8}, {"logits_soft_cap": 30.0},
                    {"alibi_slopes": [0.5] * 16}):
        with pytest.raises(ValueError, match=f"^{refusal}, sliding window nor soft-cap$"):
            cls(16, 576, 0.05, kv_lora_rank=512, **feature)

"""Capabilities and selection: the backend is skipped with the right reason.

The installed flash-attn version and the GPU are simulated by replacing
`capabilities.installed_version` and `capabilities.device_capability`.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator

import pytest
import torch
from pagedcore_flash_attn import FlashAttnBackend, capabilities

import pagedcore
from pagedcore.attention.backend import AttentionConfig
from pagedcore.plugins.registry import BackendRegistry, isolated_registry
from pagedcore.plugins.selector import BackendSelectionError, clear_selection_cache

Simulate = Callable[[str | None, tuple[int, int] | None], None]


@pytest.fixture
def simulate(monkeypatch: pytest.MonkeyPatch) -> Iterator[Simulate]:
    def apply(version: str | None, capability: tuple[int, int] | None) -> None:
        monkeypatch.setattr(capabilities, "installed_version", lambda: version)
        monkeypatch.setattr(capabilities, "device_capability", lambda: capability)
        # the selector refuses device="cuda" when torch sees no CUDA device
        monkeypatch.setattr(torch.cuda, "is_available", lambda: capability is not None)
        clear_selection_cache()

    yield apply
    clear_selection_cache()


def cfg(**kw: object) -> AttentionConfig:
    base: dict[str, object] = dict(head_size=128, dtype="bfloat16", block_size=256, device="cuda")
    base.update(kw)
    return AttentionConfig(**base)  # type: ignore[arg-type]


def test_missing_flash_attn_is_named(simulate: Simulate) -> None:
    simulate(None, (9, 0))
    why = FlashAttnBackend.is_available()
    assert why is not None and why.startswith("flash-attn is not installed")
    assert "pip install 'flash-attn>=2.6.2' --no-build-isolation" in why
    reasons = FlashAttnBackend.validate_configuration(cfg())
    assert reasons == [f"not available: {why}"]


@pytest.mark.parametrize("version", ["2.5.6", "2.5.9", "2.6.0", "2.6.1"])
def test_old_versions_are_too_old(simulate: Simulate, version: str) -> None:
    simulate(version, (8, 0))
    why = FlashAttnBackend.is_available()
    assert why is not None
    assert f"flash-attn {version} is too old" in why and ">= 2.6.2" in why


@pytest.mark.parametrize("version", ["2.6.2", "2.6.3", "2.7.4.post1", "2.8.3", "2.9.0"])
def test_supported_versions_on_ampere_and_hopper(simulate: Simulate, version: str) -> None:
    for capability in ((8, 0), (8, 6), (8, 9), (9, 0)):
        simulate(version, capability)
        assert FlashAttnBackend.is_available() is None, (version, capability)
        assert FlashAttnBackend.validate_configuration(cfg()) == []


def test_flash_attn_3_package_is_refused(simulate: Simulate) -> None:
    simulate("3.0.0b1", (9, 0))
    why = FlashAttnBackend.is_available()
    assert why is not None and "not a FlashAttention-2 release" in why


@pytest.mark.parametrize(
    ("version", "capability", "expected"),
    [
        ("2.8.3", None, "needs an NVIDIA CUDA device and none is visible"),
        ("2.8.3", (7, 5), "needs compute capability >= 8.0 (Ampere or newer); this device has 7.5"),
        ("2.7.2", (10, 0), "runs only on compute capability 8.x and 9.0"),
        ("2.6.3", (12, 0), "upgrade to flash-attn >= 2.7.3"),
    ],
)
def test_device_problems(
    simulate: Simulate, version: str, capability: tuple[int, int] | None, expected: str
) -> None:
    simulate(version, capability)
    why = FlashAttnBackend.is_available()
    assert why is not None and expected in why


def test_blackwell_from_2_7_3(simulate: Simulate) -> None:
    simulate("2.7.3", (10, 0))
    assert FlashAttnBackend.is_available() is None


def test_block_size_head_size_dtype_reasons(simulate: Simulate) -> None:
    simulate("2.8.3", (9, 0))
    assert FlashAttnBackend.validate_configuration(cfg(block_size=16)) == [
        "block size 16 not supported (supports multiple of 256)"
    ]
    assert FlashAttnBackend.validate_configuration(cfg(block_size=512)) == []
    assert FlashAttnBackend.validate_configuration(cfg(head_size=80)) == []
    head = FlashAttnBackend.validate_configuration(cfg(head_size=100))
    assert len(head) == 1 and head[0].startswith("head size 100 not supported")
    assert FlashAttnBackend.validate_configuration(cfg(head_size=264)) != []
    assert FlashAttnBackend.validate_configuration(cfg(dtype="float32")) == [
        "dtype float32 not supported (supports float16, bfloat16)"
    ]
    fp8 = FlashAttnBackend.validate_configuration(cfg(kv_cache_dtype="fp8_e4m3"))
    assert len(fp8) == 1 and fp8[0].startswith("kv_cache_dtype fp8_e4m3 not supported")
    assert FlashAttnBackend.validate_configuration(cfg(use_mla=True)) == ["MLA not supported"]
    features = cfg(sliding_window=4096, use_alibi=True, logits_soft_cap=30.0)
    assert FlashAttnBackend.validate_configuration(features) == []
    assert FlashAttnBackend.validate_configuration(cfg(device="cpu")) != []


def test_kv_cache_shape_and_bad_block_size() -> None:
    assert FlashAttnBackend.get_kv_cache_shape(10, 256, 8, 128) == (2, 10, 256, 8, 128)
    with pytest.raises(ValueError, match="not a multiple of 256"):
        FlashAttnBackend.get_kv_cache_shape(10, 16, 8, 128)


@pytest.mark.parametrize(
    ("text", "release"),
    [("2.7.4.post1", (2, 7, 4)), ("v2.6.3", (2, 6, 3)), ("2.8.0rc1", (2, 8, 0))],
)
def test_parse_release(text: str, release: tuple[int, ...]) -> None:
    assert capabilities.parse_release(text) == release


def test_unreadable_version(simulate: Simulate) -> None:
    simulate("main", (9, 0))
    why = FlashAttnBackend.is_available()
    assert why is not None and "cannot read the installed flash-attn version" in why


def _registry_with_flash_attn() -> BackendRegistry:
    from pagedcore_flash_attn import plugin

    from pagedcore.reference import plugin as reference_plugin

    registry = BackendRegistry()
    registry.register_plugin(reference_plugin, name="reference")
    registry.register_plugin(plugin, name="flash_attn")
    return registry


def test_selector_prefers_flash_attn_when_it_fits(simulate: Simulate) -> None:
    simulate("2.8.3", (9, 0))
    with isolated_registry(_registry_with_flash_attn()):
        chosen = pagedcore.select_backend(
            head_size=128, dtype="bfloat16", block_size=256, device="cuda"
        )
        assert chosen is FlashAttnBackend
        report = pagedcore.explain_selection(
            head_size=128, dtype="bfloat16", block_size=16, device="cuda"
        )
        row = next(r for r in report.rows if r.name == "flash_attn")
        assert row.reasons == ("block size 16 not supported (supports multiple of 256)",)
        assert report.chosen != "flash_attn"


def test_forced_selection_names_missing_flash_attn(simulate: Simulate) -> None:
    simulate(None, None)
    with isolated_registry(_registry_with_flash_attn()):
        with pytest.raises(BackendSelectionError, match="flash-attn is not installed"):
            pagedcore.select_backend(
                head_size=128,
                dtype="bfloat16",
                block_size=256,
                device="cuda",
                backend="flash_attn",
            )


def test_import_is_cheap() -> None:
    code = (
        "import sys, pagedcore_flash_attn.plugin as p\n"
        "from pagedcore_flash_attn import FlashAttnBackend\n"
        "heavy = [m for m in sys.modules if m.split('.')[0] in ('flash_attn', 'torch', 'triton')]\n"
        "print(','.join(heavy))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "", f"importing the plugin loaded {result.stdout.strip()}"

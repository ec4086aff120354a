"""`import pagedcore` (and the registry itself) stays cheap: no kernels, no transformers."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

IMPORTS = ["import pagedcore", "import pagedcore.plugins.registry, pagedcore.plugins.selector"]


def _modules_after(code: str) -> list[str]:
    probe = f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True,
                         text=True, timeout=120)
    return list(json.loads(out.stdout.strip().splitlines()[-1]))


@pytest.mark.parametrize("code", IMPORTS)
def test_import_pulls_no_kernels_models_or_backend_packages(code: str) -> None:
    loaded = _modules_after(code)
    heavy = [m for m in loaded if m.split(".")[0] in ("triton", "transformers", "flash_attn")
             or m.startswith("pagedcore_")]
    assert heavy == [], f"{code!r} imported {heavy}"


@pytest.mark.parametrize("code", IMPORTS)
def test_import_does_not_even_pull_torch_or_rich(code: str) -> None:
    loaded = {m.split(".")[0] for m in _modules_after(code)}
    assert not loaded & {"torch", "rich"}, (
        f"{code!r} imported {sorted(loaded & {'torch', 'rich'})}; import them lazily "
        "(inside the function that needs them) so `import pagedcore` stays cheap"
    )


PLUGIN_API = (
    "AttentionBackend", "AttentionConfig", "AttentionImpl", "AttentionImplOptions",
    "MetadataBuilder", "CommonAttentionMetadata", "CudaGraphSupport", "MultipleOf",
    "MLAAttentionBackend", "KV_CACHE_DTYPES", "AttentionSpec", "FullAttentionSpec",
    "SlidingWindowSpec", "MLAAttentionSpec", "split_decodes_and_prefills", "hookimpl",
    "ENTRY_POINT_GROUP", "PluginError", "UnknownBackendError", "BackendLoadError",
    "BackendValidationError", "DuplicateBackendError", "BackendSelectionError",
    "PluginLoadWarning",
)


def test_plugin_authors_api_is_importable_from_pagedcore_and_stays_cheap() -> None:
    code = f"import pagedcore\nfor n in {PLUGIN_API!r}: getattr(pagedcore, n)"
    loaded = {m.split(".")[0] for m in _modules_after(code)}
    assert not loaded & {"torch", "rich", "transformers", "triton"}, sorted(loaded)
    import pagedcore

    assert set(PLUGIN_API) <= set(pagedcore.__all__)
    assert issubclass(pagedcore.UnknownBackendError, pagedcore.PluginError)
    assert issubclass(pagedcore.PluginLoadWarning, UserWarning)

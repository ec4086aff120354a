"""`pagedcore bench mla`: the capacity figures and the CLI on CPU."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from click.testing import CliRunner

from pagedcore.bench.mla import MODELS, capacity_rows, mla


def test_bytes_per_token_and_concurrency() -> None:
    lite = MODELS[0]
    # 27 layers x (512 + 64) bf16 values vs 27 x 16 heads x (192 K + 128 V) bf16 values.
    assert lite.mla_bytes_per_token() == 27 * 576 * 2 == 31104
    assert lite.decompressed_bytes_per_token() == 27 * 16 * 320 * 2 == 276480
    row = capacity_rows(40.0, 4096)[0]
    assert row["mla_max_requests"] == (40 << 30) // (4096 * 31104) == 337
    assert row["decompressed_max_requests"] == (40 << 30) // (4096 * 276480) == 37


def test_cli_writes_json_without_gpu(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        return  # the GPU run is the bench itself, not a unit test
    out = tmp_path / "mla.json"
    result = CliRunner().invoke(mla, ["--json", str(out), "--context", "1024"])
    assert result.exit_code == 0, result.output
    info = json.loads(out.read_text())
    assert info["kernel"] == [] and info["kernel_skipped"]
    assert info["capacity"][1]["model"] == "DeepSeek-V3"
    assert info["command"].startswith("pagedcore bench mla")

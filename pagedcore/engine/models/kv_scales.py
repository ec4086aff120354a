"""FP8 KV-cache scales shipped in a checkpoint: ``model.layers.N.self_attn.k_scale`` /
``v_scale`` (one float per attention layer, as fp8-quantized checkpoints store them)."""

from __future__ import annotations

import math
import re
from pathlib import Path

__all__ = ["SCALE_KEY", "is_kv_scale_key", "read_kv_scales"]

#: ``...layers.N.<attention module>.k_scale`` (or ``v_scale``).
SCALE_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|attn)\.(?:attn\.)?([kv])_scale$")


def is_kv_scale_key(name: str) -> bool:
    """A checkpoint tensor name that is a K or V cache scale."""
    return SCALE_KEY.search(name) is not None


def read_kv_scales(root: Path, num_layers: int) -> dict[int, tuple[float, float]] | None:
    """Per layer ``(k_scale, v_scale)`` from the ``*.safetensors`` files under `root`, or None
    when the checkpoint has no scales.

    Raises
    ------
    ValueError
        Scales for some layers only (names the layers without), a layer with a K scale and no
        V scale (or the reverse), or a scale that is NaN, inf, zero or negative (names the
        layer and the value).
    """
    from safetensors import safe_open

    found: dict[int, dict[str, float]] = {}
    for path in sorted(root.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                match = SCALE_KEY.search(name)
                if match is None:
                    continue
                layer, which = int(match.group(1)), match.group(2)
                value = float(f.get_tensor(name).float().reshape(-1)[0])
                found.setdefault(layer, {})[which] = value
    if not found:
        return None
    missing = [i for i in range(num_layers) if i not in found]
    if missing:
        raise ValueError(
            f"{root}: the checkpoint has fp8 KV-cache scales for layers "
            f"{sorted(found)} but not for layers {missing}; every attention layer needs "
            "k_scale and v_scale (or none, to calibrate on the first prefill)"
        )
    scales: dict[int, tuple[float, float]] = {}
    for layer in sorted(found):
        pair = found[layer]
        for which in ("k", "v"):
            if which not in pair:
                raise ValueError(f"{root}: layer {layer} has no {which}_scale (only "
                                 f"{', '.join(f'{w}_scale' for w in pair)})")
            value = pair[which]
            if not math.isfinite(value) or value <= 0:
                raise ValueError(
                    f"{root}: layer {layer} {which}_scale is {value!r}; an fp8 KV-cache scale "
                    "must be a positive finite number"
                )
        scales[layer] = (pair["k"], pair["v"])
    return scales

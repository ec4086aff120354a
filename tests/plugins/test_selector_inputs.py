"""Issue #27: `select_backend` / `AttentionConfig` reject bad values naming the field."""

from __future__ import annotations

import math
import re

import pytest

import pagedcore
from pagedcore.attention import AttentionConfig

BASE = {"head_size": 64, "dtype": "float32", "block_size": 16, "device": "cpu"}


@pytest.mark.parametrize(("field", "value", "message"), [
    ("head_size", math.nan, "head_size must be a positive integer, got float nan"),
    ("head_size", 64.5, "head_size must be a positive integer, got float 64.5"),
    ("head_size", 64.0, "did you mean 64?"),
    ("head_size", True, "head_size must be a positive integer, got bool True"),
    ("head_size", "64", "head_size must be a positive integer, got str '64'"),
    ("block_size", 16.5, "block_size must be a positive integer"),
    ("block_size", False, "block_size must be a positive integer, got bool"),
    ("sliding_window", math.nan, "sliding_window must be a positive integer or None"),
    ("sliding_window", 4.5, "sliding_window must be a positive integer or None, got float"),
    ("sliding_window", True, "sliding_window must be a positive integer or None, got bool"),
    ("logits_soft_cap", math.nan, "logits_soft_cap must be a positive finite number"),
    ("logits_soft_cap", math.inf, "logits_soft_cap must be a positive finite number"),
    ("logits_soft_cap", True, "logits_soft_cap must be a positive finite number or None, got "
                              "bool"),
    ("logits_soft_cap", "30", "got str '30'"),
    ("use_mla", "no", "use_mla must be True or False, got str 'no'"),
    ("use_alibi", 1, "use_alibi must be True or False, got int 1"),
])
def test_bad_selector_input_names_the_field(field: str, value: object, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        pagedcore.select_backend(**{**BASE, field: value})
    with pytest.raises(ValueError) as info:
        AttentionConfig(**{**BASE, field: value})
    assert message in str(info.value)


def test_good_values_still_work_and_are_normalised() -> None:
    import numpy as np

    cfg = AttentionConfig(**{**BASE, "head_size": np.int64(64), "logits_soft_cap": 30,
                             "sliding_window": 8})
    assert type(cfg.head_size) is int and cfg.logits_soft_cap == 30.0
    assert pagedcore.select_backend(**BASE).name in pagedcore.get_registry().backends

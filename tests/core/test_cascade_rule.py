"""Cascade attention's bookkeeping: the shared prefix, the pays rule, the LSE merge."""

from __future__ import annotations

import pytest
import torch

from pagedcore.attention.cascade import (
    CASCADE_ENV,
    CASCADE_MIN_SAVED_TOKENS,
    cascade_mode,
    cascade_pays,
    check_common_prefix_len,
    common_prefix_len,
    merge_attention_states,
)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``[T, H, D]`` queries over ``[N, H, D]`` keys: (normalized output, natural-log LSE)."""
    s = torch.einsum("thd,nhd->thn", q, k)
    return torch.einsum("thn,nhd->thd", s.softmax(-1), v), torch.logsumexp(s, -1)


def test_merge_of_two_halves_equals_attention_over_all_keys() -> None:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(s, generator=g, dtype=torch.float64) for s in
               ((5, 3, 8), (40, 3, 8), (40, 3, 8)))
    k[7] *= 6.0  # one dominant key: the weights must come from the LSEs, not be halves
    full, _ = _attend(q, k, v)
    out_a, lse_a = _attend(q, k[:13], v[:13])
    out_b, lse_b = _attend(q, k[13:], v[13:])
    merged = merge_attention_states(out_a, lse_a, out_b, lse_b)
    assert torch.allclose(merged, full, rtol=1e-12, atol=1e-12)
    # The merge is symmetric, and a naive average is not the answer.
    assert torch.allclose(merge_attention_states(out_b, lse_b, out_a, lse_a), full)
    assert not torch.allclose((out_a + out_b) / 2, full, atol=1e-3)


def test_merge_with_an_empty_part_ignores_its_nan() -> None:
    out = torch.randn(2, 3, 4)
    lse = torch.randn(2, 3)
    empty = torch.full_like(out, float("nan"))
    none = torch.full_like(lse, float("-inf"))
    assert torch.equal(merge_attention_states(out, lse, empty, none), out)
    both = merge_attention_states(empty, none, empty, none)
    assert torch.equal(both, torch.zeros_like(out))


def test_common_prefix_len_counts_full_shared_blocks_only() -> None:
    tables = [[5, 9, 3, 7], [5, 9, 3, 8], [5, 9, 4, 1]]
    assert common_prefix_len(tables, [60, 60, 60], 16) == 32
    # Capped by the smallest context (a query may not sit inside the prefix): 40 -> 2 blocks.
    assert common_prefix_len([[5, 9, 3], [5, 9, 3]], [40, 64], 16) == 32
    assert common_prefix_len([[5, 9, 3], [5, 9, 3]], [15, 64], 16) == 0
    # One request alone: nothing to share. No common first block: 0.
    assert common_prefix_len([[5, 9, 3]], [48], 16) == 0
    assert common_prefix_len([[5, 9], [6, 9]], [32, 32], 16) == 0
    # A request with fewer blocks than the others bounds the prefix.
    assert common_prefix_len([[5, 9, 3], [5]], [48, 16], 16) == 16


def test_cascade_pays_is_shared_length_times_requests() -> None:
    assert not cascade_pays(4096, 1)
    assert not cascade_pays(0, 64)
    assert cascade_pays(4096, 64)
    assert cascade_pays(CASCADE_MIN_SAVED_TOKENS, 2)
    assert not cascade_pays(CASCADE_MIN_SAVED_TOKENS - 16, 2)
    assert not cascade_pays(128, 64)  # 128 * 63 < 16K: the extra launches cost more


def test_check_common_prefix_len_names_the_problem() -> None:
    check_common_prefix_len(32, block_size=16, context_lens=[40, 33])
    with pytest.raises(ValueError, match="multiple of the block size 16"):
        check_common_prefix_len(20, block_size=16, context_lens=[40])
    with pytest.raises(ValueError, match="smallest context length 33"):
        check_common_prefix_len(48, block_size=16, context_lens=[64, 33])


def test_cascade_mode_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(CASCADE_ENV, raising=False)
    assert cascade_mode() == "auto"
    monkeypatch.setenv(CASCADE_ENV, "Off")
    assert cascade_mode() == "off"
    monkeypatch.setenv(CASCADE_ENV, "sometimes")
    with pytest.raises(ValueError, match="auto, off, always"):
        cascade_mode()

"""The length-balanced decode plan (``kernels/balanced.py``) against a float64 formula.

Eager steps and one captured plan replayed over in-place rewrites, on NaN-poisoned, randomly
permuted caches: skewed lengths (one long request among short ones), all short, all equal,
padding requests (``seq_lens`` 1 or 0), GQA groups of 1/4/8, ALiBi, sliding windows and
soft-caps, block sizes 16 and 32. The split-request table the kernel writes is checked
against the host's `balanced_segments`, so a layout that silently stopped splitting fails.
"""

from __future__ import annotations

import random
from typing import Any

import attrs
import pytest
import torch
from _capture import CaptureBuffers, triton_builder
from _reference import make_batch, reference_attention, rel_error
from pagedcore_triton import SplitRule, TritonAttentionBackend
from pagedcore_triton.backend import DECODE_PLAN_ENV
from pagedcore_triton.plan import (
    BALANCED_ORDER_ENV,
    BALANCED_ORDERS,
    balanced_grid_size,
    balanced_segments,
    tile_config,
)
from test_kernels import TOL, _run

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TILE_N = tile_config(1, 1, 64, interpreting=DEVICE == "cpu").tile_n
#: 2 KV heads: a budget of 8 programs per head, segments of at least one tile.
RULE = SplitRule(balanced=True, target_programs=16, min_tokens_per_segment=16)
LONG = 20 * TILE_N + 3  # 21 tiles


def _expected(lens: list[int], num_reqs: int, window: int | None = None) -> list[int]:
    budget = balanced_grid_size(RULE, num_reqs=num_reqs, num_kv_heads=2) - num_reqs
    return balanced_segments(lens, budget=budget, tile_n=TILE_N,
                             min_tiles=max(1, RULE.min_tokens_per_segment // TILE_N),
                             window=window)


def _check_info(metadata: Any, lens: list[int], window: int | None = None) -> None:
    """The kernel's split-request table lists exactly the requests the host layout splits."""
    (launch,) = metadata.launches.values()
    assert launch.info is not None, "the step did not run on the balanced grid"
    segs = _expected(lens, len(lens), window)
    split = [(r, s) for r, s in enumerate(segs) if s > 1]
    info = launch.info.cpu().tolist()
    assert info[0] == len(split), (info[0], segs)
    firsts = [sum(segs[:r]) for r, _ in split]
    got = [tuple(info[1 + 3 * i : 4 + 3 * i]) for i in range(len(split))]
    assert got == [(r, f, s) for (r, s), f in zip(split, firsts, strict=True)], (got, segs)


def test_layout_fits_the_grid() -> None:
    """``sum s_r <= P`` for any lengths; a long request gets many segments, short ones one."""
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 40)
        lens = [rng.choice([0, 1, rng.randint(1, 300), rng.randint(1, 40000)]) for _ in range(n)]
        budget = rng.randint(1, 64)
        segs = balanced_segments(lens, budget=budget, tile_n=64, min_tiles=rng.randint(1, 5))
        assert sum(segs) <= n + budget, (lens, budget, segs)
        assert min(segs) >= 1
    segs = balanced_segments([32768] + [300] * 20, budget=64, tile_n=64, min_tiles=4)
    assert segs[0] >= 48 and set(segs[1:]) == {1}
    assert balanced_segments([4096] * 64, budget=64, tile_n=64, min_tiles=4) == [1] * 64


def test_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Off by default; the rule's field or the environment turns it on for decode launches."""
    monkeypatch.delenv(DECODE_PLAN_ENV, raising=False)
    reqs = [(LONG - 1, 1), (4, 1), (8, 1)]
    rule = SplitRule(target_programs=16, min_tokens_per_segment=16)  # the uniform plan: S = 2
    _, metadata = _run(reqs, split=rule)
    assert metadata.parts[0].balanced_programs is None
    assert metadata.parts[0].num_segments == 2
    monkeypatch.setenv(DECODE_PLAN_ENV, "balanced")
    _, metadata = _run(reqs, split=rule)
    assert metadata.parts[0].balanced_programs == 3 + 16 // 2
    monkeypatch.setenv(DECODE_PLAN_ENV, "uniform")
    _, metadata = _run(reqs, split=RULE)
    assert metadata.parts[0].balanced_programs is None
    monkeypatch.setenv(DECODE_PLAN_ENV, "balanced:16")  # the conformance run's setting
    _, metadata = _run(reqs, split=attrs.evolve(rule, min_tokens_per_segment=256))
    assert metadata.parts[0].min_segment_tokens == 16
    for bad in ("fast", "balanced:0", "balanced:x"):
        monkeypatch.setenv(DECODE_PLAN_ENV, bad)
        with pytest.raises(ValueError, match="'balanced', 'balanced:N'"):
            _run([(5, 1)], split=RULE)


def test_eager_keeps_the_uniform_launch_when_it_is_as_good(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Equal lengths (the uniform plan already splits them evenly) and short contexts
    (nothing to split) keep the uniform launch; one long request among short ones doesn't."""
    monkeypatch.delenv(DECODE_PLAN_ENV, raising=False)
    for reqs, balanced in (
        ([(4 * TILE_N - 1, 1)] * 3, False),
        ([(i, 1) for i in (0, 1, 5, 12)], False),
        ([(LONG - 1, 1), (4, 1), (8, 1)], True),
    ):
        err, metadata = _run(reqs, split=RULE)
        assert err < TOL[torch.float32], err
        assert (metadata.parts[0].balanced_programs is not None) == balanced, reqs


STEPS = {
    "skewed": [(LONG - 1, 1)] + [(3 * i + 2, 1) for i in range(6)],
    "skewed_last": [(17, 1), (40, 1), (LONG + 30, 1)],
    "skewed_padding": [(0, 1), (LONG - 1, 1), (0, 1), (3 * TILE_N, 1), (0, 1)],
}


@pytest.mark.parametrize("name", list(STEPS))
def test_eager_steps(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(DECODE_PLAN_ENV, raising=False)
    reqs = STEPS[name]
    err, metadata = _run(reqs, split=RULE)
    assert err < TOL[torch.float32], err
    _check_info(metadata, [c + q for c, q in reqs])


@pytest.mark.parametrize("order", list(BALANCED_ORDERS))
def test_program_orders(order: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every program order (``PAGEDCORE_TRITON_BALANCED_ORDER``) computes the same step."""
    monkeypatch.delenv(DECODE_PLAN_ENV, raising=False)
    monkeypatch.setenv(BALANCED_ORDER_ENV, order)
    for reqs in (STEPS["skewed_last"], [(LONG - 1, 1), (70, 1), (2 * TILE_N, 1), (0, 1)]):
        err, metadata = _run(reqs, split=RULE, seed=len(reqs))
        assert err < TOL[torch.float32], (order, reqs, err)
        _check_info(metadata, [c + q for c, q in reqs])
        (launch,) = metadata.launches.values()
        assert (launch.constexprs["HEADS_FIRST"], launch.constexprs["ROUND_ROBIN"]) == (
            BALANCED_ORDERS[order])
    monkeypatch.setenv(BALANCED_ORDER_ENV, "zigzag")
    with pytest.raises(ValueError, match="rr_heads"):
        _run(STEPS["skewed"], split=RULE)


def test_more_segments_than_one_merge_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    """21 segments of one tile: the merge combines two chunks of segments (16 + 5)."""
    monkeypatch.delenv(DECODE_PLAN_ENV, raising=False)
    rule = SplitRule(balanced=True, target_programs=64, min_tokens_per_segment=1)
    err, metadata = _run([(LONG - 1, 1), (3, 1)], split=rule, seed=0)
    assert err < TOL[torch.float32], err
    (launch,) = metadata.launches.values()
    assert launch.info is not None
    assert launch.info[:4].tolist() == [1, 0, 0, -(-LONG // TILE_N)]


@pytest.mark.parametrize(
    ("heads", "block_size", "dtype", "features"),
    [
        ((8, 8), 16, torch.float32, {}),  # GQA 1
        ((8, 2), 32, torch.bfloat16, {}),  # GQA 4
        ((16, 2), 16, torch.float16, {"alibi_slopes": [0.5 ** (i + 1) for i in range(16)]}),
        ((8, 2), 16, torch.float32, {"sliding_window": 3 * TILE_N + 5}),
        ((8, 2), 32, torch.float32, {"logits_soft_cap": 2.0, "sliding_window": 50}),
    ],
)
def test_eager_shapes_and_features(
    heads: tuple[int, int], block_size: int, dtype: torch.dtype, features: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(DECODE_PLAN_ENV, raising=False)
    reqs = [(3, 1), (LONG - 1, 1), (0, 1), (70, 1)]
    rule = SplitRule(balanced=True, target_programs=8 * heads[1], min_tokens_per_segment=16)
    err, metadata = _run(reqs, heads=heads, block_size=block_size, dtype=dtype, split=rule,
                         **features)
    assert err < TOL[dtype], err
    (launch,) = metadata.launches.values()
    assert launch.info is not None and int(launch.info[0]) >= 1  # the long request split


def _load(buf: CaptureBuffers, reqs: list[tuple[int, int]], pad_len: int, seed: int) -> Any:
    """Rewrite a decode bucket in place: `reqs`, then padding requests of length `pad_len`
    (1 as the engine pads, or 0) on the null block with slot -1."""
    batch = make_batch(reqs, num_heads=buf.heads, num_kv_heads=buf.kv_heads,
                       head_size=buf.head_size, block_size=buf.block_size,
                       dtype=torch.float32, device=DEVICE, seed=seed,
                       extra_blocks=buf.cache_blocks - 1 - sum(-(-(c + q) // buf.block_size)
                                                              for c, q in reqs))
    n, c = len(reqs), batch.common
    width = min(c.block_table.shape[1], buf.table.shape[1])
    buf.seq_lens.fill_(pad_len)
    buf.seq_lens[:n] = c.seq_lens
    buf.table.zero_()
    buf.table[:n, :width] = c.block_table[:, :width]
    buf.slots.fill_(-1)
    buf.slots[:n] = c.slot_mapping
    for dst, src in ((buf.query, batch.query), (buf.key, batch.key), (buf.value, batch.value)):
        dst.normal_()
        dst[:n] = src
    return batch


def test_captured_plan_survives_rewrites(monkeypatch: pytest.MonkeyPatch) -> None:
    """One plan from the bucket's shapes; steps with other lengths, padding of length 1 and
    0, a long request first, last or absent; two layers (one with a window) sharing it."""
    monkeypatch.delenv(DECODE_PLAN_ENV, raising=False)
    num_reqs, max_len = 8, LONG + 40
    buf = CaptureBuffers(num_reqs=num_reqs, num_tokens=num_reqs,
                         max_blocks=-(-max_len // 16) + 1, max_model_len=max_len, heads=8,
                         kv_heads=2, head_size=64, device=DEVICE, block_size=16,
                         cache_blocks=200)
    builder = triton_builder(block_size=16, kv_heads=2, head_size=64, device=DEVICE, split=RULE)
    metadata = builder.build_for_cudagraph_capture(buf.common())
    (part,) = metadata.parts
    assert part.balanced_programs == num_reqs + 8 and part.num_segments == 1
    impl_cls = TritonAttentionBackend.get_impl_cls()
    impls = [impl_cls(8, 64, 0.125, num_kv_heads=2),
             impl_cls(8, 64, 0.125, num_kv_heads=2, sliding_window=2 * TILE_N + 7)]
    steps = [
        ([(LONG - 1, 1), (4, 1), (30, 1)], 1),
        ([(9, 1), (2, 1), (17, 1), (0, 1), (LONG + 38, 1)], 0),
        ([(33, 1)] * 8, 1),
        ([(6, 1)], 0),
    ]
    out = torch.empty_like(buf.query)
    for seed, (reqs, pad_len) in enumerate(steps):
        batch = _load(buf, reqs, pad_len, seed)
        for impl in impls:
            impl.do_kv_cache_update(buf.key, buf.value, batch.kv_cache, buf.slots)
            out.fill_(float("nan"))
            impl.forward(buf.query, buf.key, buf.value, batch.kv_cache, metadata, output=out)
            ref = reference_attention(batch, scale=0.125, sliding_window=impl.sliding_window)
            err = rel_error(out[: len(reqs)], ref)
            assert err < 1e-4, (reqs, impl.sliding_window, err)
            if pad_len == 0:  # (length 1 reads the null block, which holds no data)
                assert bool((out[len(reqs):] == 0).all()), "a padding row was not zeroed"
            lens = [c + q for c, q in reqs] + [pad_len] * (num_reqs - len(reqs))
            key = next(k for k in metadata.launches if k[1][3][1] == (impl.sliding_window
                                                                       is not None))
            launch = metadata.launches[key]
            segs = _expected(lens, num_reqs, impl.sliding_window)
            assert launch.info is not None
            assert int(launch.info[0]) == sum(s > 1 for s in segs), (lens, segs)


def test_forward_reads_no_device_values(monkeypatch: pytest.MonkeyPatch) -> None:
    """A captured balanced step launches the decode and the merge, reading nothing back."""
    import pagedcore_triton.ops_balanced as ops

    monkeypatch.delenv(DECODE_PLAN_ENV, raising=False)
    launched: list[str] = []

    class _Kernel:
        def __init__(self, name: str) -> None:
            self.name = name

        def __getitem__(self, grid: Any) -> Any:
            return lambda *args, **kwargs: launched.append(self.name)

    buf = CaptureBuffers(num_reqs=4, num_tokens=4, max_blocks=8, max_model_len=128, heads=8,
                         kv_heads=2, head_size=64, device=DEVICE)
    metadata = triton_builder(block_size=16, kv_heads=2, head_size=64, device=DEVICE,
                              split=RULE).build_for_cudagraph_capture(buf.common())
    impl = TritonAttentionBackend.get_impl_cls()(8, 64, 0.125, num_kv_heads=2)
    cache = torch.zeros((2, 8, 16, 2, 64), device=DEVICE)
    monkeypatch.setattr(ops, "balanced_decode_kernel", _Kernel("decode"))
    monkeypatch.setattr(ops, "balanced_merge_kernel", _Kernel("merge"))

    def _no_read(*_: Any, **__: Any) -> Any:
        raise AssertionError("forward read a device value on the host")

    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu",
                 "numpy"):
        monkeypatch.setattr(torch.Tensor, name, _no_read)
    for _ in range(2):
        impl.forward(buf.query, buf.key, buf.value, cache, metadata, output=buf.query)
    assert launched == ["decode", "merge"] * 2

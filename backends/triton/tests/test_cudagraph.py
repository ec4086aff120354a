"""The CUDA-graph plan: built once for a uniform decode batch, valid after in-place rewrites.

On CPU (Triton's interpreter) this checks the plan's logic: one metadata object from
`build_for_cudagraph_capture`, the step's buffers then rewritten with other sequence lengths,
block tables and padding requests, and `forward` still matching the float64 formula on
NaN-poisoned caches. The capture itself runs in the GPU job (``gpu_jobs/triton.sh``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _capture import CaptureBuffers
from _reference import make_batch, reference_attention, rel_error
from pagedcore_triton import SplitRule, TritonAttentionBackend

from pagedcore.attention import CommonAttentionMetadata, CudaGraphSupport
from pagedcore.kv_cache.spec import FullAttentionSpec

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HEADS, KV_HEADS, HEAD_SIZE, BLOCK = 8, 2, 64, 16
NUM_REQS, MAX_MODEL_LEN, MAX_BLOCKS = 4, 200, 16


class _Buffers(CaptureBuffers):
    """The engine's persistent step buffers for `NUM_REQS` single-token decodes."""

    def __init__(self) -> None:
        super().__init__(num_reqs=NUM_REQS, num_tokens=NUM_REQS, max_blocks=MAX_BLOCKS,
                         max_model_len=MAX_MODEL_LEN, heads=HEADS, kv_heads=KV_HEADS,
                         head_size=HEAD_SIZE, device=DEVICE)

    def load(self, reqs: list[tuple[int, int]], seed: int) -> Any:
        """Rewrite the buffers in place with a new batch; the rest are padding requests."""
        batch = make_batch(reqs, num_heads=HEADS, num_kv_heads=KV_HEADS, head_size=HEAD_SIZE,
                           block_size=BLOCK, dtype=torch.float32, device=DEVICE, seed=seed)
        n = len(reqs)
        c = batch.common
        width = min(c.block_table.shape[1], MAX_BLOCKS)
        self.seq_lens.fill_(1)
        self.table.zero_()
        self.slots.fill_(-1)
        self.seq_lens[:n] = c.seq_lens
        self.table[:n, :width] = c.block_table[:, :width]
        self.slots[:n] = c.slot_mapping
        self.query.normal_()
        self.query[:n] = batch.query
        self.key.normal_()
        self.key[:n] = batch.key
        self.value.normal_()
        self.value[:n] = batch.value
        return batch


def _builder(split: SplitRule) -> Any:
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD_SIZE,
                             dtype=torch.float32)
    builder = TritonAttentionBackend.get_builder_cls()(spec, ["l0", "l1"], torch.device(DEVICE))
    builder.split_rule = split
    return builder


def test_declares_uniform_decode_graphs() -> None:
    # ALWAYS: mixed token buckets too (tests/engine/test_mixed_graphs.py, test_mixed_capture.py).
    assert TritonAttentionBackend.cudagraph_support == CudaGraphSupport.ALWAYS


@pytest.mark.parametrize("min_tokens", [16, 4096])  # split into 8 segments / one pass
def test_capture_plan_survives_in_place_rewrites(min_tokens: int) -> None:
    buf = _Buffers()
    metadata = _builder(SplitRule(min_tokens_per_segment=min_tokens)).build_for_cudagraph_capture(
        buf.common()
    )
    (part,) = metadata.parts
    # Segments come from max_seq_len (200), not from the buffers' current lengths (all 1).
    assert part.num_segments == (8 if min_tokens == 16 else 1)
    impls = [
        TritonAttentionBackend.get_impl_cls()(HEADS, HEAD_SIZE, 0.125, num_kv_heads=KV_HEADS),
        TritonAttentionBackend.get_impl_cls()(
            HEADS, HEAD_SIZE, 0.125, num_kv_heads=KV_HEADS, sliding_window=30
        ),
    ]
    out = torch.empty_like(buf.query)
    steps = [
        [(199, 1), (40, 1), (0, 1)],  # one padding request; short ones leave segments empty
        [(5, 1), (150, 1), (63, 1), (16, 1)],
        [(31, 1)],
    ]
    keys = set()
    for seed, reqs in enumerate(steps):
        batch = buf.load(reqs, seed)
        keys |= {(batch.kv_cache.shape, impl.sliding_window) for impl in impls}
        for impl in impls:  # two layers sharing the plan (and its prepared launches)
            impl.do_kv_cache_update(buf.key, buf.value, batch.kv_cache, buf.slots)
            out.fill_(float("nan"))
            impl.forward(buf.query, buf.key, buf.value, batch.kv_cache, metadata, output=out)
            ref = reference_attention(batch, scale=0.125, sliding_window=impl.sliding_window)
            err = rel_error(out[: len(reqs)], ref)
            assert err < 1e-4, (reqs, impl.sliding_window, err)
    # Prepared once per layer shape (cache shape, features), then reused.
    assert len(metadata.launches) == len(keys)


def test_forward_reads_no_device_values(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under capture a host read of a device tensor would sync (and break the graph)."""
    import pagedcore_triton.ops as ops

    launched: list[str] = []

    class _Kernel:
        def __init__(self, name: str) -> None:
            self.name = name

        def __getitem__(self, grid: Any) -> Any:
            return lambda *args, **kwargs: launched.append(self.name)

    buf = _Buffers()
    metadata = _builder(SplitRule(min_tokens_per_segment=16)).build_for_cudagraph_capture(
        buf.common()
    )
    impl = TritonAttentionBackend.get_impl_cls()(HEADS, HEAD_SIZE, 0.125, num_kv_heads=KV_HEADS)
    cache = torch.zeros((2, 8, BLOCK, KV_HEADS, HEAD_SIZE), device=DEVICE)
    monkeypatch.setattr(ops, "paged_attention_kernel", _Kernel("attention"))
    monkeypatch.setattr(ops, "merge_segments_kernel", _Kernel("merge"))

    def _no_read(*_: Any, **__: Any) -> Any:
        raise AssertionError("forward read a device value on the host")

    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu",
                 "numpy"):
        monkeypatch.setattr(torch.Tensor, name, _no_read)
    for _ in range(2):
        impl.forward(buf.query, buf.key, buf.value, cache, metadata, output=buf.query)
    assert launched == ["attention", "merge"] * 2


def test_capture_plan_rejects_prefill_batches() -> None:
    buf = _Buffers()
    common = buf.common()
    bad = CommonAttentionMetadata(**{**{a: getattr(common, a) for a in (
        "query_start_loc", "query_start_loc_cpu", "seq_lens", "seq_lens_cpu", "num_reqs",
        "num_actual_tokens", "max_seq_len", "block_table", "slot_mapping", "positions")},
        "max_query_len": 3})
    with pytest.raises(ValueError, match="single-token decode"):
        _builder(SplitRule()).build_for_cudagraph_capture(bad)

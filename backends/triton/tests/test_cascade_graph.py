"""The CUDA-graph cascade plan's inputs, run eagerly (graphs need a GPU): a decode bucket
padded past the batch, the prefix length a device scalar below the capacity the launch is
sized for, static suffix buffers filled by device ops. Its output must equal the eager
cascade's and the plain plan's on the real rows (NaN in every cache slot no request owns,
NaN queries in the padded rows)."""

from __future__ import annotations

from typing import Any

import attrs
import pytest
import torch
from test_cascade_kernels import BS, DEVICE, HEAD, HEADS, KV_HEADS, _run, _step

from pagedcore.attention import CommonAttentionMetadata


def _pad(step: dict[str, Any], bucket: int) -> dict[str, Any]:
    """The step as a decode bucket of `bucket` requests: padding requests as the contract
    has them (``seq_lens`` 1, the null block) and one NaN query row each."""
    c: CommonAttentionMetadata = step["common"]
    n, extra = c.num_reqs, bucket - c.num_reqs
    table = torch.cat([c.block_table.cpu(),
                       torch.zeros((extra, c.block_table.shape[1]), dtype=torch.int32)])
    lens = torch.cat([c.seq_lens_cpu, torch.ones(extra, dtype=torch.int32)])
    qsl = torch.arange(bucket + 1, dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=qsl.to(DEVICE), query_start_loc_cpu=qsl, seq_lens=lens.to(DEVICE),
        seq_lens_cpu=lens, num_reqs=bucket, num_actual_tokens=bucket, max_query_len=1,
        max_seq_len=int(table.shape[1]) * BS, block_table=table.to(DEVICE),
        slot_mapping=torch.zeros(bucket, dtype=torch.int64, device=DEVICE),
        positions=torch.cat([c.positions.cpu(), torch.zeros(extra, dtype=torch.int64)])
        .to(DEVICE),
    )
    query = torch.cat([step["query"], torch.full((extra, HEADS, HEAD), float("nan"),
                                                 device=DEVICE)])
    assert query.shape[0] == bucket and n <= bucket
    return {"common": common, "cache": step["cache"], "query": query}


def _builder_impl() -> tuple[Any, Any]:
    """The triton builder and impl of the tests' float32 layer shape."""
    from pagedcore_triton import TritonAttentionBackend

    from pagedcore.kv_cache.spec import FullAttentionSpec

    spec = FullAttentionSpec(block_size=BS, num_kv_heads=KV_HEADS, head_size=HEAD,
                             dtype="float32")
    builder = TritonAttentionBackend.get_builder_cls()(spec, ["l0"], torch.device(DEVICE))
    impl = TritonAttentionBackend.get_impl_cls()(
        HEADS, HEAD, HEAD ** -0.5, num_kv_heads=KV_HEADS, alibi_slopes=None,
        sliding_window=None, logits_soft_cap=None, kv_cache_dtype="auto")
    return builder, impl


def _graph_forward(padded: dict[str, Any], prefix: int, capacity: int) -> torch.Tensor:
    builder, impl = _builder_impl()
    c = padded["common"]
    # Static buffers poisoned: whatever the plan reads must have been filled.
    lens = torch.full((c.num_reqs,), -(2**30), dtype=torch.int32, device=DEVICE)
    table = torch.full_like(c.block_table, 10**6)
    pdev = torch.tensor([prefix], dtype=torch.int32, device=DEVICE)
    meta = builder.build_cascade_for_cudagraph_capture(
        c, pdev, capacity, suffix_seq_lens=lens, suffix_table=table)
    assert meta.cascade is not None and meta.cascade.prefix_len == capacity
    q = padded["query"]
    out: torch.Tensor = impl.forward(q, q, q, padded["cache"], meta)
    return out


@pytest.mark.parametrize(
    ("owns", "prefix_blocks", "capacity_blocks", "bucket"),
    [
        ([5, 40, 17], 3, 5, 4),   # bucket past the batch, prefix below the capacity
        ([0, 9, 31], 2, 2, 3),    # a request whose context ends with the prefix
        ([7, 3], 4, 6, 8),        # prefix ends inside a tile, half-empty bucket
    ],
)
def test_graph_cascade_matches_eager_and_plain(
    owns: list[int], prefix_blocks: int, capacity_blocks: int, bucket: int
) -> None:
    prefix = prefix_blocks * BS
    step = _step(prefix, owns=owns, queries=[1] * len(owns))
    plain, (eager, _) = _run(step, prefix)
    n = len(owns)
    graph = _graph_forward(_pad(step, bucket), prefix, capacity_blocks * BS)[:n]
    assert not torch.isnan(graph).any()
    scale = float(plain.abs().max())
    assert float((graph - eager).abs().max()) / scale < 1e-5
    assert float((graph - plain).abs().max()) / scale < 1e-5


def test_graph_cascade_one_request_and_no_prefix() -> None:
    """One request alone in a bucket of 2, and the same plan with the device prefix set to
    0 (the prefix launch then contributes nothing): both equal the plain plan."""
    prefix = 2 * BS
    step = _step(prefix, owns=[11], queries=[1])
    padded = _pad(step, 2)
    plain = _plain(step)
    for p in (prefix, 0):
        graph = _graph_forward(padded, p, 3 * BS)[:1]
        assert not torch.isnan(graph).any()
        assert float((graph - plain).abs().max() / plain.abs().max()) < 1e-5, p


def _plain(step: dict[str, Any]) -> torch.Tensor:
    builder, impl = _builder_impl()
    q = step["query"]
    out: torch.Tensor = impl.forward(q, q, q, step["cache"], builder.build(step["common"]))
    return out


def test_graph_cascade_refill_and_bad_capacity() -> None:
    """`fill_graph_cascade` rewrites the buffers in place for a new prefix length; a
    capacity off the block grid or past the table is refused."""
    from pagedcore_triton.cascade import fill_graph_cascade

    step = _pad(_step(2 * BS, owns=[5, 20], queries=[1, 1]), 3)
    c = step["common"]
    lens = torch.empty(3, dtype=torch.int32, device=DEVICE)
    table = torch.empty_like(c.block_table)
    for p in (0, BS, 2 * BS):
        fill_graph_cascade(c, torch.tensor([p], dtype=torch.int32, device=DEVICE), BS,
                           lens, table)
        assert lens.tolist() == [max(s - p, 0) for s in c.seq_lens_cpu.tolist()]
        k = p // BS
        assert torch.equal(table[:, : table.shape[1] - k], c.block_table[:, k:])
    with pytest.raises(ValueError, match="multiple of the block size"):
        _graph_forward(step, BS, BS + 1)
    with pytest.raises(ValueError, match="within the block table"):
        _graph_forward(step, BS, 100 * BS)
    assert attrs.has(type(c))


def test_graph_cascade_plan_owns_its_buffers_and_prepare_replay_refills_them() -> None:
    """The engine's use: the plan built once on the persistent buffers (its suffix buffers
    allocated by the builder, capacity the table's width), then a later step written into
    those buffers in place, its prefix length into the device scalar, and
    `prepare_replay`: the output equals the plain plan of the later step."""
    first = _pad(_step(2 * BS, owns=[5, 40, 17], queries=[1, 1, 1]), 4)
    later_step = _step(3 * BS, owns=[9, 20, 3], queries=[1, 1, 1])
    later = _pad(later_step, 4)
    c, c2 = first["common"], later["common"]
    assert c.block_table.shape == c2.block_table.shape
    builder, impl = _builder_impl()
    pdev = torch.tensor([2 * BS], dtype=torch.int32, device=DEVICE)
    meta = builder.build_cascade_for_cudagraph_capture(c, pdev, c.block_table.shape[1] * BS)
    plan = meta.cascade
    assert plan is not None and plan.prefix_len_dev is pdev
    before = plan.suffix_seq_lens.clone()
    for name in ("seq_lens", "block_table", "query_start_loc"):
        getattr(c, name).copy_(getattr(c2, name))
    pdev.fill_(3 * BS)
    builder.prepare_replay(meta, c)
    assert not torch.equal(plan.suffix_seq_lens, before)
    q = later["query"]
    out = impl.forward(q, q, q, later["cache"], meta)[:3]
    plain = _plain(later_step)
    assert not torch.isnan(out).any()
    assert float((out - plain).abs().max() / plain.abs().max()) < 1e-5


def test_kernels_bench_times_the_graph_plans() -> None:
    """`pagedcore bench kernels --case cascade` also runs the plans the decode graphs
    capture (triton declares ``supports_cascade_cudagraph``): equal to SDPA there too."""
    from pagedcore_triton import TritonAttentionBackend

    from pagedcore.bench import kernels_cascade

    (row,) = kernels_cascade.bench_cascade(3, 32, 5, [TritonAttentionBackend],
                                           torch.device(DEVICE))
    assert row["impl"] == "triton" and row["graph_cascade_ms"] > 0 and row["graph_plain_ms"] > 0
    tol = 1e-4 if DEVICE == "cpu" else 2e-2  # (the bench runs bf16 on a GPU)
    assert row["rel_err_graph_cascade_vs_sdpa"] < tol, row
    assert row["rel_err_vs_sdpa"] < tol and not row["nan"], row

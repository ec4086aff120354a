"""The Triton MLA decode with its merge fused into the split programs (``fused_fanin``).

On CPU (interpreter) the programs run one after another, so each group's last program is its
highest split; on a GPU the order is arbitrary, so the CUDA tests repeat the launch many times
(a race or a counter left non-zero shows as a wrong result) and replay a captured CUDA graph.
"""

from __future__ import annotations

from typing import Any

import attrs
import pytest
import torch

pytest.importorskip("triton")
mla = pytest.importorskip("pagedcore_triton.mla")

from pagedcore.conformance.mla import MLABatchSpec, build_mla_case, run_mla_case  # noqa: E402
from pagedcore.reference.mla import MLAImpl  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
FUSED = [name for name, c in mla.MLA_KERNEL_CONFIGS.items() if c.fused_fanin is not None]


def _many_splits(fanin: int, max_splits: int = 64) -> Any:
    """A fused config that splits even short contexts (16-position tiles and segments: 530
    positions give 34 non-empty segments of 64)."""
    return mla.MLAKernelConfig(
        name=f"u{fanin}x{max_splits}", block_n=16, fused_fanin=fanin,
        split=mla.MLASplitRule(target_programs=10**6, min_tokens_per_split=4,
                               max_splits=max_splits),
    )


def _setup(spec: MLABatchSpec, dtype: torch.dtype, seed: int) -> tuple[Any, ...]:
    """The conformance case with the step's rows written (NaN in every other free slot),
    the Triton plan and the case's query."""
    case = build_mla_case(spec, dtype=dtype, device=DEVICE, seed=seed)
    meta = mla.TritonMLAMetadataBuilder(None, [], torch.device(DEVICE)).build(case.common)
    dim = spec.kv_lora_rank + spec.rope_head_dim
    writer = MLAImpl(spec.num_heads, dim, 0.2, kv_lora_rank=spec.kv_lora_rank)
    writer.do_kv_cache_update(case.key, case.key, case.kv_cache, case.common.slot_mapping)
    return case, meta, case.query[: case.common.num_actual_tokens], case.kv_cache


def _reference(spec: MLABatchSpec, common: Any, query: torch.Tensor,
               cache: torch.Tensor) -> torch.Tensor:
    from pagedcore.reference.mla import ReferenceMLABackend

    ref_meta = ReferenceMLABackend.get_builder_cls()(None, [], torch.device(DEVICE)).build(
        common)
    dim = spec.kv_lora_rank + spec.rope_head_dim
    impl = MLAImpl(spec.num_heads, dim, 0.2, kv_lora_rank=spec.kv_lora_rank)
    return impl.forward(query.float(), query, query, cache.float(), ref_meta).float()


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want).norm() / want.norm())


# The interpreter computes exp2(-inf - -inf) on the branch that tl.where then drops:
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("fanin", [2, 64])
def test_fused_merge_tree_many_splits(fanin: int) -> None:
    """64 splits per token merged by a tree of fan-in 2 (6 levels) or 64 (1 level), with a
    decode and a short prefill whose later splits are empty; a second call gives the same
    result (to rounding) and the counters are left at zero."""
    spec = MLABatchSpec(name="fused", query_lens=(1, 2), seq_lens=(530, 40),
                        block_size=16, num_heads=3, kv_lora_rank=32, rope_head_dim=16)
    case, meta, query, cache = _setup(spec, torch.float32, seed=7)
    impl = mla.TritonMLAImpl(3, 48, 0.2, kv_lora_rank=32)
    impl.kernel_config = _many_splits(fanin)
    launch = impl.plan_launch(query, meta)
    assert launch.splits == 64 and launch.counters is not None
    want = _reference(spec, case.common, query, cache)
    out = torch.full((3, 3, 32), float("nan"), device=DEVICE)
    got = impl.forward(query, query, query, cache, meta, output=out)
    assert _rel(got, want) < 1e-5
    again = impl.forward(query, query, query, cache, meta)
    # Not bit-identical on a GPU: which split of a group arrives last (and so which partial
    # comes from registers and which from memory) changes the FMA rounding.
    assert _rel(again, want) < 1e-5
    torch.testing.assert_close(again, got, rtol=1e-5, atol=1e-6)
    assert impl._fused_counters is not None and int(impl._fused_counters.abs().sum()) == 0


def test_fused_launch_has_no_merge() -> None:
    """A fused split launch carries the counters, and the separate merge refuses it."""
    spec = MLABatchSpec(name="parts", query_lens=(1, 1), seq_lens=(700, 90), block_size=16,
                        num_heads=3, kv_lora_rank=48, rope_head_dim=16)
    _, meta, query, _ = _setup(spec, torch.float32, seed=6)
    impl = mla.TritonMLAImpl(3, 64, 0.2, kv_lora_rank=48)
    impl.kernel_config = mla.MLA_KERNEL_CONFIGS[FUSED[0]]
    launch = impl.plan_launch(query, meta)
    assert launch.splits == 4 and launch.part_acc is not None
    assert tuple(launch.part_acc.shape) == (2, 1, 8, 16, 64)
    with pytest.raises(ValueError, match="merges inside the decode kernel"):
        impl.launch_merge(launch, query.new_empty(2, 3, 48))
    with pytest.raises(ValueError, match="fused_fanin must be None or a power of two"):
        mla.MLAKernelConfig(name="x", fused_fanin=3)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_fused_variants_on_conformance_split_spec() -> None:
    """Every fused variant of the table on the split conformance-style batch."""
    spec = MLABatchSpec(name="split", query_lens=(1, 1, 3), seq_lens=(530, 200, 260),
                        block_size=16, num_heads=5, kv_lora_rank=32, rope_head_dim=16)
    case = build_mla_case(spec, dtype=torch.float32, device=DEVICE, seed=2)
    for name in FUSED:
        old = mla.TritonMLAImpl.kernel_config
        mla.TritonMLAImpl.kernel_config = attrs.evolve(
            mla.MLA_KERNEL_CONFIGS[name], split=mla.MLASplitRule(min_tokens_per_split=32))
        try:
            result = run_mla_case(mla.TritonMLABackend, case, device=DEVICE)
        finally:
            mla.TritonMLAImpl.kernel_config = old
        assert result.passed, (name, result.detail)


def _bench_shape(batch: int, context: int) -> tuple[Any, ...]:
    """A DeepSeek-V2-Lite decode step in bf16 (NaN-poisoned unused slots), as the bench's."""
    from pagedcore.bench import mla_kernel as mk

    cache, query, common = mk._decode_batch(batch, context, torch.device("cuda"),
                                            torch.bfloat16)
    meta, ref_meta = mk._plans(common, torch.device("cuda"), torch.bfloat16)
    return cache, query, meta, ref_meta


def _bench_reference(query: torch.Tensor, cache: torch.Tensor, ref_meta: Any) -> torch.Tensor:
    ref = MLAImpl(16, 576, (128 + 64) ** -0.5, kv_lora_rank=512)
    return ref.forward(query.float(), query, query, cache.float(), ref_meta).float()


@CUDA
@pytest.mark.parametrize(
    ("name", "shape"),
    [(n, s) for n in FUSED for s in ((4, 32768), (16, 16384), (128, 2048))],
    ids=lambda x: x if isinstance(x, str) else f"{x[0]}x{x[1]}",
)
def test_fused_repeated_and_graph_replay(name: str, shape: tuple[int, int]) -> None:
    """20 back-to-back launches (PDL) each match the reference; a captured CUDA graph replayed
    twice matches it, and again after new queries are copied into its input."""
    cache, query, meta, ref_meta = _bench_shape(*shape)
    want = _bench_reference(query, cache, ref_meta)
    impl = mla.TritonMLAImpl(16, 576, (128 + 64) ** -0.5, kv_lora_rank=512)
    impl.kernel_config = mla.MLA_KERNEL_CONFIGS[name]
    outs = [impl.forward(query, query, query, cache, meta) for _ in range(20)]
    for i, got in enumerate(outs):
        assert _rel(got, want) < 1e-2, (i, _rel(got, want))
    torch.cuda.synchronize()
    assert int(impl._fused_counters.abs().sum()) == 0
    static_q = query.clone()
    out = torch.full_like(outs[0], float("nan"))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        impl.forward(static_q, static_q, static_q, cache, meta, output=out)  # warm
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        impl.forward(static_q, static_q, static_q, cache, meta, output=out)
    for _ in range(2):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert _rel(out, want) < 1e-2
    static_q.copy_(torch.randn_like(query))
    want2 = _bench_reference(static_q, cache, ref_meta)
    graph.replay()
    torch.cuda.synchronize()
    assert _rel(out, want2) < 1e-2
    assert int(impl._fused_counters.abs().sum()) == 0


@CUDA
@pytest.mark.parametrize("name", FUSED)
def test_fused_full_conformance(name: str) -> None:
    """The MLA conformance specs in fp16, bf16 and fp32, with the offsets past 2^31."""
    from pagedcore.conformance.mla import run_mla_suite

    old = mla.TritonMLAImpl.kernel_config
    mla.TritonMLAImpl.kernel_config = mla.MLA_KERNEL_CONFIGS[name]
    try:
        results = run_mla_suite(mla.TritonMLABackend, device=torch.device("cuda"), quick=False)
    finally:
        mla.TritonMLAImpl.kernel_config = old
    failed = [f"{r.spec}/{r.dtype}: {r.detail}" for r in results if not r.passed]
    assert results and not failed, failed

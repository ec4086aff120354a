"""The backend's Python side on CPU: registration, availability, and whole steps run through
`FakeOps` (torch stand-ins with the extension's signatures) against the reference."""

from __future__ import annotations

import importlib.metadata

import pytest
import torch
from check_gpu import run_case, run_graph_case
from fake_ops import FakeOps
from pagedcore_cuda_paged import CudaPagedBackend
from pagedcore_cuda_paged._ext import load_ops, unavailable_reason
from pagedcore_cuda_paged.plan import DecodeKernel, DecodePass

from pagedcore.attention.backend import AttentionConfig, CudaGraphSupport

HAS_CUDA = torch.cuda.is_available()


def test_entry_point_registers_backend() -> None:
    eps = importlib.metadata.entry_points(group="pagedcore.backends")
    ep = next(e for e in eps if e.name == "cuda_paged")
    module = ep.load()
    assert module.pagedcore_register_backends() == [CudaPagedBackend]


@pytest.mark.skipif(HAS_CUDA, reason="checks the message given on machines without CUDA")
def test_unavailable_reason_without_cuda() -> None:
    why = unavailable_reason()
    assert why is not None
    if torch.version.cuda is None:
        assert "torch has no CUDA" in why
    else:
        assert "no CUDA device" in why
    assert CudaPagedBackend.is_available() == why
    cfg = AttentionConfig(head_size=128, dtype="bfloat16", block_size=16, device="cuda")
    assert any(why in r for r in CudaPagedBackend.validate_configuration(cfg))
    with pytest.raises(RuntimeError, match="cuda_paged cannot run here"):
        load_ops.__wrapped__()


def test_declarations_reject_what_has_no_kernel() -> None:
    bad = AttentionConfig(head_size=72, dtype="float16", block_size=64, device="cuda",
                          kv_cache_dtype="fp8_e4m3")
    reasons = " | ".join(CudaPagedBackend.validate_configuration(bad))
    assert "head size 72" in reasons and "block size 64" in reasons
    odd = AttentionConfig(head_size=128, dtype="float16", block_size=16, device="cuda",
                          kv_cache_dtype="auto")
    assert not any("kv_cache_dtype" in r for r in CudaPagedBackend.validate_configuration(odd))
    with pytest.raises(ValueError, match="head sizes"):
        CudaPagedBackend.get_impl_cls()(8, 72, 1.0)


@pytest.mark.parametrize("force", [None, DecodePass.ONE_PASS, DecodePass.PARTITIONED])
@pytest.mark.parametrize(
    "dtype,head,block,group,window,alibi,cap",
    [
        (torch.float32, 64, 16, 4, None, False, None),
        (torch.float32, 80, 8, 7, 37, True, 5.0),
        (torch.bfloat16, 128, 32, 1, None, True, None),
    ],
)
def test_mixed_step_through_fake_ops(
    fake_ops: FakeOps, force: DecodePass | None, dtype: torch.dtype, head: int, block: int,
    group: int, window: int | None, alibi: bool, cap: float | None,
) -> None:
    err = run_case(dtype, head, block, 2, group, window=window, alibi=alibi, cap=cap,
                   force=force, seed=3, device="cpu")
    assert err <= (1e-3 if dtype == torch.float32 else 2e-2)
    kinds = [c[0] for c in fake_ops.calls]
    assert kinds.count("decode") == 1 and kinds.count("prefill") == 1
    decode = next(c for c in fake_ops.calls if c[0] == "decode")
    if force is DecodePass.ONE_PASS:
        assert decode[2] == 1
    elif window is None:
        # Few thread blocks (5 decodes x Hq) and a 300-token decode: auto partitions too.
        assert decode[2] > 1


def test_fake_ops_catch_a_wrong_block_table(fake_ops: FakeOps,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    # The harness must be able to fail: reading history through a shifted table is caught.
    import pagedcore_cuda_paged.metadata as md

    real_build = md.CudaPagedMetadataBuilder.build

    def shifted(self: md.CudaPagedMetadataBuilder, common: object, **kw: object) -> object:
        meta = real_build(self, common, **kw)  # type: ignore[arg-type]
        table = meta.block_table.roll(1, dims=1)
        import attrs

        return attrs.evolve(meta, block_table=table)

    monkeypatch.setattr(md.CudaPagedMetadataBuilder, "build", shifted)
    err = run_case(torch.float32, 64, 16, 2, 4, window=None, alibi=False, cap=None,
                   force=None, seed=3, device="cpu")
    assert not err <= 1e-3  # large error or NaN


@pytest.mark.parametrize("dtype,head,block,window,kernel", [
    (torch.bfloat16, 128, 16, None, DecodeKernel.MMA),
    (torch.float32, 64, 8, 100, DecodeKernel.CLASSIC),
])
def test_capture_plan_holds_for_rewritten_lengths(
    fake_ops: FakeOps, dtype: torch.dtype, head: int, block: int, window: int | None,
    kernel: DecodeKernel,
) -> None:
    # Planned once at "capture" with short lengths, replayed after in-place rewrites up to
    # max_seq_len: FakeOps asserts every request's partitions fit the planned launch.
    err = run_graph_case(dtype, head, block, window=window, kernel=kernel, device="cpu")
    assert err <= (1e-3 if dtype == torch.float32 else 2e-2)
    decodes = [c for c in fake_ops.calls if c[0] == "decode"]
    assert len(decodes) == 2 and len(set(decodes)) == 1  # one launch shape throughout
    assert CudaPagedBackend.cudagraph_support >= CudaGraphSupport.UNIFORM_SINGLE_TOKEN_DECODE


def test_capture_plan_rejects_prefills() -> None:
    from pagedcore.attention.metadata import CommonAttentionMetadata
    from pagedcore.kv_cache.spec import FullAttentionSpec

    qsl = torch.tensor([0, 1, 3], dtype=torch.int32)
    seq = torch.tensor([5, 9], dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=seq, seq_lens_cpu=seq,
        num_reqs=2, num_actual_tokens=3, max_query_len=2, max_seq_len=9,
        block_table=torch.zeros(2, 1, dtype=torch.int32),
        slot_mapping=torch.full((3,), -1, dtype=torch.int64),
        positions=torch.zeros(3, dtype=torch.int64))
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16)
    builder = CudaPagedBackend.get_builder_cls()(spec, ["l"], torch.device("cpu"))
    with pytest.raises(ValueError, match="single-token decode"):
        builder.build_for_cudagraph_capture(common)

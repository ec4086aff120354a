"""The Triton MLA decode's run-time chunk hand-out (`MLAKernelConfig.steal_tiles`): the plan,
the kernel against the reference (interpreter on CPU, compiled on CUDA), the counter's reset."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
mla = pytest.importorskip("pagedcore_triton.mla")

from pagedcore.conformance.mla import MLABatchSpec, build_mla_case, run_mla_case  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
STEAL = "n32s5c4pm64R256k64mw1dhrw2v128-steal1r1"


def test_plan_steal_fills_the_target_and_leaves_chunks() -> None:
    """4 x 32768 on 264 programs: 66 static segments of 15 tiles (34 chunks left per token),
    or of 14 with one tile held back (100 chunks); a shape that divides evenly hands out
    nothing unless a tile is held back; short contexts keep >= 128 positions per segment."""
    from pagedcore_triton.mla_config import plan_steal

    plain = mla.MLA_KERNEL_CONFIGS["n32s5c4pm64R256k64mw1dhrw2v128-steal1r0"]
    held = mla.MLA_KERNEL_CONFIGS[STEAL]
    pairs2 = mla.MLA_KERNEL_CONFIGS["n32s5c4pm64R256k64mw1dhrw2v128-steal2r0"]
    assert plan_steal(plain, pairs=4, max_seq_len=32768) == (66, 480, 31680, 34)
    assert plan_steal(held, pairs=4, max_seq_len=32768) == (66, 448, 29568, 100)
    assert plan_steal(pairs2, pairs=4, max_seq_len=32768) == (66, 480, 31680, 17)
    assert plan_steal(plain, pairs=64, max_seq_len=4096) == (4, 1024, 4096, 0)
    assert plan_steal(held, pairs=64, max_seq_len=4096) == (4, 992, 3968, 4)
    assert plan_steal(plain, pairs=3, max_seq_len=700) == (5, 128, 640, 2)
    with pytest.raises(ValueError, match="does not hand out chunks"):
        plan_steal(mla.DEFAULT_MLA_KERNEL, pairs=4, max_seq_len=32768)
    with pytest.raises(ValueError, match="steal_tiles must be None or >= 1"):
        mla.MLAKernelConfig(name="x", steal_tiles=0)
    with pytest.raises(ValueError, match="steal_tiles must be None or >= 1"):
        mla.MLAKernelConfig(name="x", steal_tiles=1, fused_fanin=4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_handed_out_chunks_match_reference(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Static segments plus chunks handed out at run time (a token shorter than the static
    part: its chunks are empty) match the reference with NaN in every unused slot; the counter
    is back to 0 after each launch and a second launch gives the same output (a cache without
    NaN here: the case's own cache holds the step's new rows only after the engine writes
    them)."""
    import attrs

    rule = mla.MLASplitRule(target_programs=12, min_tokens_per_split=16, max_splits=64)
    cfg = attrs.evolve(mla.MLA_KERNEL_CONFIGS[STEAL], block_n=16, split=rule)
    spec = MLABatchSpec(name="steal", query_lens=(1, 1, 2), seq_lens=(260, 40, 130),
                        block_size=16, num_heads=4, kv_lora_rank=64, rope_head_dim=16)
    case = build_mla_case(spec, dtype=dtype, device=DEVICE, seed=11)
    monkeypatch.setattr(mla.TritonMLAImpl, "kernel_config", cfg)
    result = run_mla_case(mla.TritonMLABackend, case, device=DEVICE)
    assert result.passed, result.detail

    impl = mla.TritonMLAImpl(4, 80, 0.2, kv_lora_rank=64)
    meta = mla.TritonMLAMetadataBuilder(None, [], torch.device(DEVICE)).build(case.common)
    launch = impl.plan_launch(case.query, meta)
    # 4 tokens x 1 head block on 12 programs: 3 segments of 4 tiles, then 5 chunks of 16.
    assert (launch.splits, launch.split_len, launch.steal_base, launch.steal_chunks) == (
        3, 64, 192, 5)
    assert launch.part_acc is not None and launch.part_acc.shape[2] == launch.slots == 8
    assert launch.steal_counter is not None
    query = torch.randn(case.query.shape, dtype=dtype, device=DEVICE)
    cache = torch.randn(case.kv_cache.shape, dtype=dtype, device=DEVICE)
    first = impl.forward(query, query, query, cache, meta)
    assert int(launch.steal_counter.item()) == 0
    second = impl.forward(query, query, query, cache, meta)
    assert int(launch.steal_counter.item()) == 0
    assert torch.isfinite(first).all()
    torch.testing.assert_close(second, first, rtol=2e-3, atol=2e-3)

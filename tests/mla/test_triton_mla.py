"""The Triton MLA backend against the reference MLA (interpreter on CPU, native on a GPU)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
mla = pytest.importorskip("pagedcore_triton.mla")
MLAKernelConfig = mla.MLAKernelConfig
MLASplitRule = mla.MLASplitRule

from pagedcore.attention import AttentionConfig  # noqa: E402
from pagedcore.conformance.mla import (  # noqa: E402
    MLA_SPECS,
    MLABatchSpec,
    build_mla_case,
    run_mla_case,
)
from pagedcore.reference.mla import MLAImpl  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("spec", MLA_SPECS, ids=lambda s: s.name)
def test_triton_mla_matches_reference(spec: MLABatchSpec) -> None:
    case = build_mla_case(spec, dtype=torch.float32, device=DEVICE, seed=1)
    result = run_mla_case(mla.TritonMLABackend, case, device=DEVICE)
    assert result.passed, result.detail


def test_split_kv_path_is_taken_and_correct() -> None:
    """Long contexts with few tokens split the context; the merged result still matches."""
    rule = mla.DEFAULT_MLA_KERNEL.split
    assert mla.choose_mla_splits(rule, num_tokens=2, head_blocks=1, max_seq_len=300) == 2
    assert mla.choose_mla_splits(rule, num_tokens=2, head_blocks=1, max_seq_len=100) == 1
    assert mla.choose_mla_splits(rule, num_tokens=1000, head_blocks=1, max_seq_len=9999) == 1
    spec = MLABatchSpec(name="split", query_lens=(1, 1, 3), seq_lens=(530, 200, 260),
                        block_size=16, num_heads=5, kv_lora_rank=32, rope_head_dim=16)
    case = build_mla_case(spec, dtype=torch.float32, device=DEVICE, seed=2)
    result = run_mla_case(mla.TritonMLABackend, case, device=DEVICE)
    assert result.passed, result.detail


#: More splits than the merge reads per chunk (16), several of them empty for short tokens.
MANY_SPLITS = MLAKernelConfig(
    name="many_splits", block_n=16,
    split=MLASplitRule(target_programs=10**6, min_tokens_per_split=16, max_splits=64),
)


@pytest.mark.parametrize(
    "config", [*mla.MLA_KERNEL_CONFIGS.values(), MANY_SPLITS], ids=lambda c: c.name
)
def test_every_kernel_variant_matches_reference(
    config: MLAKernelConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each variant the bench times (tile, stages, split rule) is exact on a batch that splits
    and mixes a long decode with a short prefill (NaN in every unused slot)."""
    monkeypatch.setattr(mla.TritonMLAImpl, "kernel_config", config)
    if config is MANY_SPLITS:  # the merge's whole-row programs (else 128-column slices)
        monkeypatch.setattr(mla.TritonMLAImpl, "merge_whole_row_pairs", 1)
    spec = MLABatchSpec(name="variant", query_lens=(1, 3), seq_lens=(1100, 40), block_size=16,
                        num_heads=4, kv_lora_rank=160, rope_head_dim=16, num_pad_tokens=2)
    case = build_mla_case(spec, dtype=torch.float32, device=DEVICE, seed=4)
    splits = mla.choose_mla_splits(config.split, num_tokens=4, head_blocks=1,
                                   max_seq_len=1100)
    assert splits > 1
    if config is MANY_SPLITS:
        assert splits == 64
    result = run_mla_case(mla.TritonMLABackend, case, device=DEVICE)
    assert result.passed, result.detail


def _nan_cache(num_blocks: int, block_size: int, dim: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.full((num_blocks, block_size, dim), float("nan"), dtype=dtype, device=DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("impl_name", ["triton", "reference"])
def test_cache_write_skips_padding_without_host_sync(impl_name: str, dtype: torch.dtype) -> None:
    """Rows land in their slots (odd row size 40), padding (-1) writes nothing, every other
    slot keeps its NaN; on a GPU the write must not synchronise with the host."""
    gen = torch.Generator().manual_seed(5)
    num_blocks, block_size, dim = 6, 4, 40
    key = torch.randn(7, 1, dim, generator=gen).to(DEVICE, dtype)
    slots = torch.tensor([9, -1, 4, 23, -1, 13], dtype=torch.int64, device=DEVICE)
    impl_cls = mla.TritonMLAImpl if impl_name == "triton" else MLAImpl
    impl = impl_cls(4, dim, 0.1, kv_lora_rank=32)
    cache = _nan_cache(num_blocks, block_size, dim, dtype)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    try:
        impl.do_kv_cache_update(key, key, cache, slots)  # key has one extra token: unused
    finally:
        if DEVICE == "cuda":
            torch.cuda.set_sync_debug_mode("default")
    flat = cache.view(-1, dim).cpu()
    written = {9: 0, 4: 2, 23: 3, 13: 5}
    for slot in range(num_blocks * block_size):
        if slot in written:
            assert torch.equal(flat[slot], key[written[slot], 0].cpu()), slot
        else:
            assert flat[slot].isnan().all(), f"slot {slot} was written"


def test_cache_write_rejects_bad_shapes() -> None:
    impl = mla.TritonMLAImpl(4, 40, 0.1, kv_lora_rank=32)
    cache = _nan_cache(2, 4, 40, torch.float32)
    with pytest.raises(ValueError, match="slot_mapping has 3"):
        impl.do_kv_cache_update(torch.zeros(2, 1, 40, device=DEVICE),
                                cache, cache, torch.zeros(3, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError, match=r"MLA key must be \[T, 1, L \+ R\]"):
        impl.do_kv_cache_update(torch.zeros(2, 2, 40, device=DEVICE),
                                cache, cache, torch.zeros(2, dtype=torch.int64, device=DEVICE))


def test_bfloat16_close_to_reference() -> None:
    spec = MLABatchSpec(name="bf16", query_lens=(1, 4), seq_lens=(40, 20), num_heads=16)
    case = build_mla_case(spec, dtype=torch.bfloat16, device=DEVICE, seed=3)
    result = run_mla_case(mla.TritonMLABackend, case, device=DEVICE)
    assert result.passed, result.detail


def test_declarations() -> None:
    cfg = AttentionConfig(head_size=576, dtype="bfloat16", block_size=16, use_mla=True,
                          device=DEVICE)
    assert mla.TritonMLABackend.validate_configuration(cfg) == []
    plain = AttentionConfig(head_size=128, dtype="bfloat16", block_size=16, device=DEVICE)
    assert "serves only MLA layers" in mla.TritonMLABackend.validate_configuration(plain)
    assert mla.TritonMLABackend.get_kv_cache_shape(7, 16, 1, 576) == (7, 16, 576)


def test_builder_plans_per_token_visible_lengths() -> None:
    """Each token of a mixed batch sees its context plus the step's tokens up to itself."""
    spec = MLABatchSpec(name="plan", query_lens=(1, 3, 2), seq_lens=(9, 5, 20))
    case = build_mla_case(spec, dtype=torch.float32)
    builder = mla.TritonMLAMetadataBuilder(None, [], torch.device("cpu"))  # type: ignore[arg-type]
    meta = builder.build(case.common)
    assert meta.token_req.tolist() == [0, 1, 1, 1, 2, 2]
    assert meta.token_kv_len.tolist() == [9, 3, 4, 5, 19, 20]
    assert meta.num_actual_tokens == 6 and meta.max_seq_len == 20


def test_kernel_config_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="merge_chunk must be a power of two"):
        MLAKernelConfig(name="x", merge_chunk=12)
    with pytest.raises(ValueError, match="block_n must be a power of two"):
        MLAKernelConfig(name="x", block_n=48)
    with pytest.raises(ValueError, match="lat_split must be 1, 2 or 4"):
        MLAKernelConfig(name="x", lat_split=3)
    with pytest.raises(ValueError, match="merge_cols must be a power of two >= 16"):
        MLAKernelConfig(name="x", merge_cols=48)
    with pytest.raises(ValueError, match="merge_warps must be a power of two"):
        MLAKernelConfig(name="x", merge_warps=3)
    with pytest.raises(ValueError, match="merge_values must be a power of two >= 2"):
        MLAKernelConfig(name="x", merge_values=96)


def test_merge_layout_per_shape() -> None:
    """The default merges whole rows on 2 warps from 256 (token, head) pairs on (16-bit
    partials: each warp owns 256 columns; 16 x 16384: all 16 splits in one round trip, 128
    values per thread), one-warp 64-column slices below (4 x 32768: all 64 splits at once);
    the ninth run's default read 8 splits per round trip on whole rows and took 32-column
    slices; the one before (fp32 partials) 4-warp whole rows, and `n32s5c4pm64R256` 4-warp
    128-column slices below 256 pairs."""
    from pagedcore_triton.mla_config import merge_layout

    def layout(name: str, tokens: int, splits: int) -> tuple[int, int, int]:
        cfg = mla.MLA_KERNEL_CONFIGS[name] if name else mla.DEFAULT_MLA_KERNEL
        return merge_layout(cfg, num_tokens=tokens, num_heads=16, lat_pad=512, splits=splits)

    assert layout("", 16, 16) == (512, 16, 2)
    assert layout("", 64, 4) == (512, 4, 2)
    assert layout("", 4, 64) == (64, 64, 1)
    assert layout("", 1, 3) == (64, 4, 1)
    assert layout("n32s5c4pm64R256k32mw1dhrw2", 16, 16) == (512, 8, 2)  # ninth run's
    assert layout("n32s5c4pm64R256k32mw1dhrw2", 4, 64) == (32, 64, 1)
    assert layout("n32s5c4pm64R256k32mw1", 16, 16) == (512, 16, 4)  # eighth run's
    assert layout("n32s5c4pm64R256k32mw1", 4, 64) == (32, 64, 1)
    assert layout("n32s5c4pm64", 16, 16) == (128, 16, 4)
    assert layout("n32s5c4pm64R256", 4, 64) == (128, 64, 4)
    assert layout("n32s5c4pm64R256", 16, 16) == (512, 16, 4)
    # Whole rows of a wide latent: the chunk shrinks to keep 128 values per thread.
    assert merge_layout(mla.DEFAULT_MLA_KERNEL, num_tokens=64, num_heads=16, lat_pad=1024,
                        splits=64) == (1024, 8, 2)


def test_launch_parts_equal_forward() -> None:
    """plan_launch + launch_decode + launch_merge (what the bench's breakdown times one by
    one) give forward's result on a split batch; the merge of an unsplit plan is refused."""
    spec = MLABatchSpec(name="parts", query_lens=(1, 1), seq_lens=(700, 90), block_size=16,
                        num_heads=3, kv_lora_rank=48, rope_head_dim=16)
    case = build_mla_case(spec, dtype=torch.float32, device=DEVICE, seed=6)
    impl = mla.TritonMLAImpl(3, 64, 0.2, kv_lora_rank=48)
    builder = mla.TritonMLAMetadataBuilder(None, [], torch.device(DEVICE))
    meta = builder.build(case.common)
    query = torch.randn(2, 3, 64, device=DEVICE)
    cache = torch.randn(case.kv_cache.shape, device=DEVICE)
    want = impl.forward(query, query, query, cache, meta)
    launch = impl.plan_launch(query, meta)
    assert launch.splits == 4 and launch.split_len == 192 and launch.part_acc is not None
    assert tuple(launch.part_acc.shape) == (2, 3, 4, 64)
    out = torch.full_like(want, float("nan"))
    impl.launch_decode(launch, query, cache, meta, out)
    impl.launch_merge(launch, out)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    short = mla.TritonMLAMetadataBuilder(None, [], torch.device(DEVICE)).build(
        build_mla_case(MLABatchSpec(name="short", query_lens=(1,), seq_lens=(20,)),
                       dtype=torch.float32, device=DEVICE).common)
    with pytest.raises(ValueError, match="needs a split launch"):
        impl.launch_merge(impl.plan_launch(query[:1], short), out)


def test_short_split_warps_rule() -> None:
    """2 warps only for a split launch whose segments are short; else the config's warps."""
    cfg = mla.MLA_KERNEL_CONFIGS["n32s5c4pm64w2s"]
    assert cfg.launch_warps(64, 512) == 2  # 4 x 32768
    assert cfg.launch_warps(16, 1024) == 4  # 16 x 16384
    assert cfg.launch_warps(1, 256) == 4  # unsplit short contexts
    assert mla.DEFAULT_MLA_KERNEL.launch_warps(64, 512) == mla.DEFAULT_MLA_KERNEL.num_warps


@pytest.mark.parametrize("whole_rows", [False, True], ids=["column_merge", "row_merge_w2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_partials_split_matches_reference(
    dtype: torch.dtype, whole_rows: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """16-bit partials (``...h``): with 16-bit queries the split partials are stored in the
    query's dtype; many splits per sequence (some empty for the short request) still match
    the reference with NaN in every unused slot, and stay close to the fp32-partial result.
    Both merge layouts: column slices, and whole-row programs on 2 warps (``...hrw2``)."""
    import attrs

    many = MLASplitRule(target_programs=10**6, min_tokens_per_split=16, max_splits=64)
    half = attrs.evolve(mla.MLA_KERNEL_CONFIGS["n32s5c4pm64R256k32mw1h"], block_n=16,
                        split=many)
    if whole_rows:
        half = attrs.evolve(half, merge_row_pairs=1, merge_row_warps=2)
        assert mla.merge_layout(half, num_tokens=4, num_heads=4, lat_pad=64,
                                splits=16)[::2] == (64, 2)
    spec = MLABatchSpec(name="half", query_lens=(1, 1, 2), seq_lens=(260, 40, 130),
                        block_size=16, num_heads=4, kv_lora_rank=64, rope_head_dim=16)
    case = build_mla_case(spec, dtype=dtype, device=DEVICE, seed=7)
    monkeypatch.setattr(mla.TritonMLAImpl, "kernel_config", half)
    result = run_mla_case(mla.TritonMLABackend, case, device=DEVICE)
    assert result.passed, result.detail
    impl = mla.TritonMLAImpl(4, 80, 0.2, kv_lora_rank=64)
    meta = mla.TritonMLAMetadataBuilder(None, [], torch.device(DEVICE)).build(case.common)
    query = torch.randn(4, 4, 80, device=DEVICE).to(dtype)
    cache = torch.randn(case.kv_cache.shape, device=DEVICE).to(dtype)
    launch = impl.plan_launch(query, meta)
    assert launch.splits == 16 and launch.part_acc is not None
    assert launch.part_acc.dtype == dtype and launch.part_ml is not None
    assert launch.part_ml.dtype == torch.float32
    got = impl.forward(query, query, query, cache, meta).float()
    impl.kernel_config = attrs.evolve(half, half_partials=False)
    full_acc = impl.plan_launch(query, meta).part_acc
    assert full_acc is not None and full_acc.dtype == torch.float32
    full = impl.forward(query, query, query, cache, meta).float()
    rel = float((got - full).norm() / full.norm())
    assert 0 < rel < 1e-2, rel


def test_half_partials_and_probe_misuse_are_refused() -> None:
    with pytest.raises(ValueError, match="half_partials needs the merge kernel"):
        MLAKernelConfig(name="x", half_partials=True, fused_fanin=4)
    if DEVICE != "cpu":
        return
    impl = mla.TritonMLAImpl(3, 64, 0.2, kv_lora_rank=48)
    case = build_mla_case(MLABatchSpec(name="p", query_lens=(1,), seq_lens=(20,)),
                          dtype=torch.float32)
    meta = mla.TritonMLAMetadataBuilder(None, [], torch.device("cpu")).build(case.common)
    query = torch.randn(1, 3, 64)
    launch = impl.plan_launch(query, meta)
    with pytest.raises(ValueError, match="probe must be an int64 CUDA tensor"):
        impl.launch_decode(launch, query, torch.zeros(case.kv_cache.shape), meta,
                           torch.empty(1, 3, 48), probe=torch.zeros(8, dtype=torch.int64))


def test_narrow_heads_plan_per_bench_shape() -> None:
    """``...g8``: a launch that would split serves 8 heads per program instead, with half
    the splits (4 x 32768: 32, not 64) or none at all (128 x 2048); unsplit launches keep
    16 heads per program."""
    cfg = mla.MLA_KERNEL_CONFIGS["n32s5c4pm64R256k32mw1g8"]
    impl = mla.TritonMLAImpl(16, 576, 0.1, kv_lora_rank=512)
    impl.kernel_config = cfg
    plans = {}
    for tokens, context in ((4, 32768), (64, 4096), (256, 1024), (16, 16384), (128, 2048)):
        meta = mla.TritonMLAMetadata(
            token_req=torch.arange(tokens, dtype=torch.int32),
            token_kv_len=torch.full((tokens,), context, dtype=torch.int32),
            block_table=torch.zeros(tokens, 1, dtype=torch.int32), num_actual_tokens=tokens,
            max_seq_len=context)
        launch = impl.plan_launch(torch.empty(tokens, 16, 576, dtype=torch.bfloat16), meta)
        plans[tokens] = (launch.heads_per_program, launch.head_blocks, launch.splits,
                         launch.part_acc is None)
    assert plans == {4: (8, 2, 32, False), 64: (8, 2, 2, False), 256: (16, 1, 1, True),
                     16: (8, 2, 8, False), 128: (8, 2, 1, True)}


@pytest.mark.parametrize("half", [False, True], ids=["fp32", "bf16_half_partials"])
def test_narrow_heads_matches_reference(half: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """8 heads per program over 12 heads (the second head block half empty), several
    splits per sequence, NaN in every unused slot; bf16 with 16-bit partials."""
    import attrs

    many = MLASplitRule(target_programs=10**6, min_tokens_per_split=32, max_splits=64)
    cfg = attrs.evolve(mla.MLA_KERNEL_CONFIGS["n32s5c4pm64R256k32mw1g8"], block_n=16,
                       split=many, half_partials=half)
    monkeypatch.setattr(mla.TritonMLAImpl, "kernel_config", cfg)
    spec = MLABatchSpec(name="narrow", query_lens=(1, 2), seq_lens=(200, 70), block_size=16,
                        num_heads=12, kv_lora_rank=32, rope_head_dim=16, num_pad_tokens=1)
    dtype = torch.bfloat16 if cfg.half_partials else torch.float32
    case = build_mla_case(spec, dtype=dtype, device=DEVICE, seed=8)
    meta = mla.TritonMLAMetadataBuilder(None, [], torch.device(DEVICE)).build(case.common)
    launch = mla.TritonMLAImpl(12, 48, 0.2, kv_lora_rank=32).plan_launch(case.query, meta)
    assert (launch.heads_per_program, launch.head_blocks, launch.splits) == (8, 2, 4)
    result = run_mla_case(mla.TritonMLABackend, case, device=DEVICE)
    assert result.passed, result.detail


@pytest.mark.parametrize("name", [mla.DEFAULT_MLA_KERNEL.name])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_growing_scores_move_the_maximum(
    name: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Scores that grow by far more than 2^8 along the positions (late keys aligned with the
    query): every tile that must move the running maximum does; several splits, a short
    prefill, NaN in every unused slot."""
    import attrs

    many = MLASplitRule(target_programs=10**6, min_tokens_per_split=96, max_splits=64)
    cfg = attrs.evolve(mla.MLA_KERNEL_CONFIGS[name], block_n=16, split=many)
    monkeypatch.setattr(mla.TritonMLAImpl, "kernel_config", cfg)
    spec = MLABatchSpec(name="grow", query_lens=(1, 3), seq_lens=(300, 45), block_size=16,
                        num_heads=4, kv_lora_rank=32, rope_head_dim=16)
    case = build_mla_case(spec, dtype=dtype, device=DEVICE, seed=9)
    # Key rows that point more and more along the queries: log2-scores grow by ~240 within
    # each of the 2 splits, so a kernel that stopped moving the maximum would overflow.
    table = case.common.block_table.long()
    q_dir = case.query[0].float().mean(0)
    q_dir = q_dir / q_dir.norm()
    cache = case.kv_cache.float()
    for pos in range(300):
        slot = cache[table[0, pos // 16], pos % 16]
        if not slot.isnan().any():
            slot += (pos / 0.5) * q_dir
    case = attrs.evolve(case, kv_cache=cache.to(dtype))
    result = run_mla_case(mla.TritonMLABackend, case, device=DEVICE)
    assert result.passed, result.detail


def test_default_whole_row_merge_reads_16_splits_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The default's whole-row merge of a 512-wide latent on 2 warps takes all 16 splits in
    one round trip (128 partial values per thread; the ninth run's default took 8) and
    matches the reference with 16-bit partials and NaN in every unused slot."""
    import attrs

    many = MLASplitRule(target_programs=10**6, min_tokens_per_split=16, max_splits=16)
    cfg = attrs.evolve(mla.DEFAULT_MLA_KERNEL, block_n=16, split=many, merge_row_pairs=1)
    assert mla.merge_layout(cfg, num_tokens=2, num_heads=2, lat_pad=512, splits=16) == (
        512, 16, 2)
    ninth = attrs.evolve(cfg, merge_values=64)
    assert mla.merge_layout(ninth, num_tokens=2, num_heads=2, lat_pad=512, splits=16)[1] == 8
    spec = MLABatchSpec(name="rows16", query_lens=(1, 1), seq_lens=(300, 70), block_size=16,
                        num_heads=2, kv_lora_rank=512, rope_head_dim=64)
    case = build_mla_case(spec, dtype=torch.bfloat16, device=DEVICE, seed=12)
    monkeypatch.setattr(mla.TritonMLAImpl, "kernel_config", cfg)
    impl = mla.TritonMLAImpl(2, 576, 0.1, kv_lora_rank=512)
    meta = mla.TritonMLAMetadataBuilder(None, [], torch.device(DEVICE)).build(case.common)
    launch = impl.plan_launch(case.query, meta)
    assert launch.splits == 16 and launch.part_acc is not None
    assert launch.part_acc.dtype == torch.bfloat16
    result = run_mla_case(mla.TritonMLABackend, case, device=DEVICE)
    assert result.passed, result.detail

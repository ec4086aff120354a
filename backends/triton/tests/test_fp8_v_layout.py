"""The fp8 cache's V layout (`pagedcore_triton.kv_layout`): the cache write puts V transposed
within each block, and the attention kernel reads it back on every tile path (masked tiles
that load whole blocks and zero what lies outside, unmasked interior tiles, split-KV) against
a float32 reference over the dequantized cache, with every unused slot NaN; the token-major
layout (``PAGEDCORE_TRITON_FP8_V_LAYOUT=token``) still round-trips.

Triton's interpreter converts fp8 NaN bytes to finite numbers (e4m3 ``0x7F`` reads 480), so
on the CPU the poisoned slots prove only that the kernel's result does not depend on them;
that a masked tile zeroes them is proven where the tests run on a GPU (these tests, and the
conformance suite's fp8 cases)."""

from __future__ import annotations

import pytest
import torch
from pagedcore_triton.kv_layout import FP8_V_LAYOUT_ENV, v_transposed, value_view
from pagedcore_triton.ops import prepare_launch, run_launch, write_kv_cache
from pagedcore_triton.plan import LaunchPart, TileConfig

from pagedcore.attention.kv_quant import quantize_fp8

HQ, HKV, D, BS = 4, 2, 16, 16
NAN_BYTE = 0x7F  # NaN in e4m3fn and e5m2


def _poisoned(num_blocks: int, dtype: torch.dtype) -> torch.Tensor:
    cache = torch.empty((2, num_blocks, BS, HKV, D), dtype=dtype)
    cache.view(torch.uint8).fill_(NAN_BYTE)
    return cache


@pytest.mark.parametrize("layout", ["transposed", "token"])
def test_cache_write_places_v_by_layout(layout: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FP8_V_LAYOUT_ENV, layout)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gen = torch.Generator().manual_seed(0)
    cache = _poisoned(4, torch.float8_e4m3fn).to(dev)
    key, value = (torch.randn((3, HKV, D), generator=gen).to(dev) for _ in range(2))
    scales = torch.tensor([0.01], device=dev), torch.tensor([0.02], device=dev)
    slots = torch.tensor([2 * BS + 5, BS + 15, 7], device=dev)  # blocks 2, 1, 0
    write_kv_cache(key, value, cache, slots, kv_scales=scales)
    kq = quantize_fp8(key, scales[0], cache.dtype).view(torch.uint8)
    vq = quantize_fp8(value, scales[1], cache.dtype).view(torch.uint8)
    raw = cache.view(torch.uint8)
    blocks, offsets = slots // BS, slots % BS
    assert torch.equal(raw[0, blocks, offsets], kq)  # K stays token-major
    v_raw = raw[1].view(4, HKV, D, BS) if layout == "transposed" else raw[1]
    assert v_transposed(True) == (layout == "transposed")
    for i, (b, s) in enumerate(zip(blocks.tolist(), offsets.tolist(), strict=True)):
        got = v_raw[b, :, :, s] if layout == "transposed" else v_raw[b, s]
        assert torch.equal(got, vq[i]), (layout, i)
        assert torch.equal(value_view(cache)[b, s].view(torch.uint8), vq[i])
    # Nothing else was written: 3 tokens x 2 halves x HKV x D bytes differ from the poison.
    assert int((raw != NAN_BYTE).sum()) == 2 * 3 * HKV * D


def _case(dtype: torch.dtype, lens: list[int], seed: int) -> dict[str, torch.Tensor]:
    """An fp8 cache (random block order, every unused slot NaN) filled through `value_view`,
    float32 queries (one decode token per request) and the float32 reference."""
    gen = torch.Generator().manual_seed(seed)
    per = max(-(-n // BS) for n in lens)
    nb = len(lens) * per + 1
    table = (torch.randperm(nb - 1, generator=gen) + 1).view(len(lens), per).to(torch.int32)
    cache = _poisoned(nb, dtype)
    scales = torch.tensor([0.02]), torch.tensor([0.03])
    fmax = float(torch.finfo(dtype).max)
    q = torch.randn((len(lens), HQ, D), generator=gen)
    refs = []
    for r, n in enumerate(lens):
        k, v = ((torch.randn((n, HKV, D), generator=gen) * 3 / s).clamp(-fmax, fmax).to(dtype)
                for s in scales)
        pos = torch.arange(n)
        blocks, slots = table[r, pos // BS].long(), pos % BS
        cache[0, blocks, slots] = k
        value_view(cache)[blocks, slots] = v
        kd = (k.float() * scales[0]).repeat_interleave(HQ // HKV, 1)
        vd = (v.float() * scales[1]).repeat_interleave(HQ // HKV, 1)
        s = torch.einsum("hd,nhd->hn", q[r], kd) * D**-0.5
        refs.append(torch.einsum("hn,nhd->hd", s.softmax(-1), vd))
    return {"cache": cache, "table": table, "q": q, "ref": torch.stack(refs),
            "seq": torch.tensor(lens, dtype=torch.int32),
            "qsl": torch.arange(len(lens) + 1, dtype=torch.int32),
            "scales": scales}  # type: ignore[dict-item]


@pytest.mark.parametrize(
    ("layout", "dtype", "skip_interior_masks", "segments"),
    [("transposed", torch.float8_e4m3fn, True, 1), ("transposed", torch.float8_e5m2, False, 2),
     ("transposed", torch.float8_e4m3fn, True, 2), ("token", torch.float8_e4m3fn, True, 1)],
)
def test_decode_reads_each_layout(layout: str, dtype: torch.dtype, skip_interior_masks: bool,
                                  segments: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FP8_V_LAYOUT_ENV, layout)
    # 37: a tail tile 5 tokens into a block; 70: several full (unmasked) tiles, then a tail.
    c = _case(dtype, [37, 16, 70, 1], seed=segments)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    c = {k: v.to(dev) if isinstance(v, torch.Tensor) else tuple(x.to(dev) for x in v)
         for k, v in c.items()}
    n = c["q"].shape[0]
    part = LaunchPart(req_begin=0, req_end=n, token_begin=0, token_end=n, max_query_len=1,
                      num_segments=segments)
    tiles = TileConfig(block_m=16, block_q=4, tile_n=32, num_warps=4, num_stages=1,
                       skip_interior_masks=skip_interior_masks)
    launch = prepare_launch(
        part, query_shape=(n, HQ, D), dtype=torch.float32, kv_cache_shape=tuple(c["cache"].shape),
        query_start_loc=c["qsl"], seq_lens=c["seq"], block_table=c["table"], causal=True,
        use_alibi=False, sliding_window=None, logits_soft_cap=None, tiles=tiles, kv_fp8=True,
    )
    assert launch.constexprs["V_TRANS"] == (layout == "transposed")
    assert launch.constexprs["SKIP_INTERIOR_MASKS"] == skip_interior_masks
    out = torch.full_like(c["q"], float("nan"))
    run_launch(launch, c["q"], c["cache"], out, scale=D**-0.5, alibi_slopes=None,
               sliding_window=None, logits_soft_cap=None,
               kv_scales=c["scales"])  # type: ignore[arg-type]
    assert not out.isnan().any()
    err = float((out - c["ref"]).norm() / c["ref"].norm())
    assert err < 1e-5, err


def test_layout_setting_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FP8_V_LAYOUT_ENV, "column")
    with pytest.raises(ValueError, match="expected one of transposed, token"):
        v_transposed(True)
    assert v_transposed(False) is False  # 16-bit caches never read the setting


def test_fp8_decode_tiles_follow_the_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    """Over the transposed layout fp8 decodes skip the interior masks (a masked tile there
    zeroes its tail after the load); token-major keeps the single masked loop it was tuned
    with; bf16 decodes never read the setting."""
    from pagedcore_triton.plan import tile_config

    def fp8(itemsize: int = 1) -> bool:
        cfg = tile_config(1, 4, 128, interpreting=False, itemsize=2, kv_itemsize=itemsize)
        return cfg.skip_interior_masks

    monkeypatch.setenv(FP8_V_LAYOUT_ENV, "transposed")
    assert fp8() and not fp8(itemsize=2)
    monkeypatch.setenv(FP8_V_LAYOUT_ENV, "token")
    assert not fp8() and not fp8(itemsize=2)

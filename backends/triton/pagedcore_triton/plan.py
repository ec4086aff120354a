"""Launch planning: which requests go to which launch, tile shapes, and the split-KV rule.

Pure Python (no triton import): the metadata builder calls it once per step.
"""

from __future__ import annotations

import os
from typing import Any

import attrs

__all__ = [
    "BALANCED_GAIN",
    "BALANCED_ORDERS",
    "BALANCED_ORDER_ENV",
    "DECODE_PLAN_ENV",
    "DECODE_TILES",
    "DECODE_TILES_ENV",
    "DEFAULT_BALANCED_ORDER",
    "PREFILL_TILES_ENV",
    "SMALL_HEAD_DECODE_TILES",
    "TILE_FLAGS",
    "LaunchPart",
    "SplitRule",
    "TileConfig",
    "balanced_grid_size",
    "balanced_pays",
    "balanced_segments",
    "choose_num_segments",
    "context_segments",
    "context_split",
    "decode_plan",
    "fit_segments",
    "flat_grid_size",
    "kv_convert",
    "parse_decode_tiles",
    "parse_tiles",
    "pow2_splits",
    "tile_config",
]

#: Overrides the prefill tile shape (tuning): ``"BLOCK_M,TILE_N,WARPS,STAGES[,FLAG...]"``.
PREFILL_TILES_ENV = "PAGEDCORE_TRITON_PREFILL_TILES"

#: ``balanced`` plans decode launches on the length-balanced grid (``kernels/balanced.py``),
#: ``balanced:N`` too with at least ``N`` tokens per segment (tests), ``uniform`` on the
#: uniform split-KV plan; unset follows ``SplitRule.balanced`` (see `decode_plan`).
DECODE_PLAN_ENV = "PAGEDCORE_TRITON_DECODE_PLAN"
#: Overrides the decode tile shape (tuning): ``"TILE_N,WARPS,STAGES[,FLAG...]"``, flags
#: ``cvtN`` (`TileConfig.kv_convert`), ``s`` (unmasked interior tiles), ``i32`` (int32 K/V
#: offsets), ``rN`` (at most N registers per thread); see `parse_decode_tiles`.
DECODE_TILES_ENV = "PAGEDCORE_TRITON_DECODE_TILES"

#: An eager decode step runs on the balanced grid only when that cuts its longest program
#: (in K/V tiles) by more than this factor against the uniform plan (`balanced_pays`).
BALANCED_GAIN = 1.25

#: The order of the balanced decode's programs (tuning): ``req`` (request-major, programs
#: fastest), ``heads`` (request-major, KV heads fastest), ``rr`` (round-robin over the
#: requests' segments) or ``rr_heads``. See ``kernels/balanced.py``.
BALANCED_ORDER_ENV = "PAGEDCORE_TRITON_BALANCED_ORDER"
BALANCED_ORDERS = {"req": (False, False), "heads": (True, False), "rr": (False, True),
                   "rr_heads": (True, True)}
#: The order used when ``PAGEDCORE_TRITON_BALANCED_ORDER`` is unset.
DEFAULT_BALANCED_ORDER = "heads"

#: The flags `parse_tiles` accepts after the four numbers, and what each one selects.
TILE_FLAGS = {
    "fwd": "natural q-block order instead of longest-first",
    "m1": "masked edge tiles not software-pipelined (num_stages=1 on those loops)",
    "i32": "int32 K/V offsets when the cache has fewer than 2**31 elements",
}


#: The decode tile shape (head sizes <= 128) by the KV cache's element size (1: fp8, 2:
#: bf16/fp16), the fastest of the variants swept on the H200 at 64x4096 / 8x32768 / 256x1024
#: (``tools/fp8_decode_sweep.py``, ``docs/benchmarks/fp8_h200.json``). bf16: 64-token tiles,
#: 4 warps, 3 stages, int32 K/V offsets (1-2 % faster than int64 at every shape). fp8:
#: 128-token tiles (the bytes of a 64-token bf16 tile), 5 stages (Triton double-buffers the
#: K/V tiles only from 5 on: the block-table load takes a stage), float16 operands (``KV_CVT``
#: 1: the hardware cast; the cast to bf16 goes through float32) and int32 offsets:
#: 1.24x-1.44x the bf16 decode, against 0.88x-1.09x for the previous 128-token, 3-stage
#: bf16-operand tile.
DECODE_TILES: dict[int, dict[str, Any]] = {
    2: {"tile_n": 64, "num_warps": 4, "num_stages": 3, "int32_offsets": True},
    1: {"tile_n": 128, "num_warps": 4, "num_stages": 5, "kv_convert": 1, "int32_offsets": True},
}
#: The decode tile shape for head sizes <= 64 (Qwen2-0.5B: 14 query / 2 KV heads of 64), by
#: the cache's element size, the fastest of ``gpu/qwen_decode_sweep.py`` on an H100 at
#: 256x560 / 256x1024 / 64x4096 (``docs/benchmarks/h100_s27/``). A 64-wide head halves each
#: tile's work: bf16 runs on 2 warps (0.93x the 4-warp time at 256x560 and 256x1024 on the
#: eager plan, 0.98-0.99x on the balanced plan decode graphs capture, 1.01x at 64x4096); fp8
#: on 64-token tiles of 3 stages (0.88x / 0.98x / 0.99x the 128-token, 5-stage tile).
SMALL_HEAD_DECODE_TILES: dict[int, dict[str, Any]] = {
    2: {"tile_n": 64, "num_warps": 2, "num_stages": 3, "int32_offsets": True},
    1: {"tile_n": 64, "num_warps": 4, "num_stages": 3, "kv_convert": 1, "int32_offsets": True},
}


def _next_pow2(x: int) -> int:
    return 1 << max(0, x - 1).bit_length()


@attrs.frozen(kw_only=True)
class LaunchPart:
    """A contiguous run of requests served by one kernel launch.

    Attributes
    ----------
    req_begin, req_end:
        Requests ``[req_begin, req_end)`` of the step.
    token_begin, token_end:
        Their flattened query tokens ``[token_begin, token_end)``.
    max_query_len:
        Largest query length among them (picks the tile shape).
    num_segments:
        Split-KV segments per request (1 = one pass).
    prefill_only:
        Every request of the part has more than one query token (no decodes among them:
        allows the 256-row prefill tiles, see `tile_config`).
    flat_programs:
        None for the classic grid ``(q_blocks, Hkv, num_segments)``. Otherwise a captured
        mixed step's *flat* grid (`flat_grid_size`): about this many programs in all, which
        the kernel deals out at run time over the q-blocks the step really uses times up to
        `num_segments` segments each (fewer q-blocks get more segments).
    min_segment_tokens:
        With `flat_programs`: context tokens a segment holds at least (a short context
        leaves the later segments empty; they exit before loading anything). With
        `balanced_programs`: the least tokens per segment (`balanced_segments`).
    tma_prefill:
        A prefill-only part planned for the Hopper kernel (``kernels/prefill_tma.py``, see
        ``plan_tma``); a layer that kernel does not serve runs the gather kernel instead.
    has_context:
        Some request of the part continues a cached prefix (``seq_len > query_len``).
    balanced_programs:
        None, or a single-token decode launch on the length-balanced grid of this many
        programs per KV head (`balanced_grid_size`; ``kernels/balanced.py``): the kernel
        sizes each request's segments by its length at run time. `num_segments` is then 1.
    context_segments:
        A prefill part whose contexts dominate its queries may split them into at most this
        many segments (`context_segments`); the impl's first layer of a step picks how many
        its grid leaves room for (`fit_segments`) and, when more than one, runs the gather
        kernel split instead of the Hopper one. 1: no context split.
    query_lens:
        With `context_segments` > 1: each request's query length, so that the impl counts
        the q-blocks its grid really uses (the classic grid's bound adds one per request).
    """

    req_begin: int
    req_end: int
    token_begin: int
    token_end: int
    max_query_len: int
    num_segments: int = 1
    prefill_only: bool = False
    flat_programs: int | None = None
    min_segment_tokens: int = 0
    balanced_programs: int | None = None
    tma_prefill: bool = False
    has_context: bool = True
    context_segments: int = 1
    query_lens: tuple[int, ...] = ()

    @property
    def num_reqs(self) -> int:
        return self.req_end - self.req_begin


@attrs.frozen(kw_only=True)
class SplitRule:
    """When a decode launch splits each request's context into segments.

    Split only decode launches whose one-pass grid (``num_reqs * num_kv_heads`` programs)
    has fewer than `min_programs` programs; then pick the largest power of two
    ``S <= max_segments`` that keeps at least `min_tokens_per_segment` context tokens in each
    segment and no more than `target_programs` programs in all. The defaults (about four
    programs per SM) were measured on an H200 (132 SMs); see ``docs/benchmarks/triton.md``.

    With `balanced` set, captured decode launches, and eager ones where it pays
    (`balanced_pays`), use the length-balanced plan instead (`balanced_grid_size`,
    `balanced_segments`): segments of about ``sum tiles / (target_programs / Hkv)`` tiles, at
    least `min_tokens_per_segment` tokens, so that a long request gets many segments and
    short ones one each. The metadata builder's ``PAGEDCORE_TRITON_DECODE_PLAN``
    environment variable overrides it (`decode_plan`).

    Prefill parts whose queries are short against their contexts (a prefix hit's remainder,
    a chat turn over a cached conversation) split too (`context_segments`, `fit_segments`):
    when the longest context holds at least `context_ratio` times the longest query, the
    part's q-blocks get the largest power of two ``S <= max_segments`` of segments that
    keeps the launch within one program per SM and at least `context_min_tokens` tokens per
    segment (the impl's first layer decides: the grid depends on the query heads). Measured on an
    H100 (``docs/benchmarks/h100_s30/README.md``): 64 tokens over 4,096 cached, Qwen2-0.5B
    heads, 76.6 -> 17.8 us a layer; Llama-3-8B heads over 16,384, 368 -> 125 us; a plain
    prefill (no context) keeps the one-pass Hopper kernel, which splitting only slows.
    """

    min_programs: int = 512
    target_programs: int = 512
    min_tokens_per_segment: int = 256
    max_segments: int = 64
    balanced: bool = False
    context_ratio: int = 4
    context_min_tokens: int = 128


def choose_num_segments(
    rule: SplitRule, *, num_reqs: int, num_kv_heads: int, max_seq_len: int, max_query_len: int
) -> int:
    """Segments for one launch by `rule`; 1 means the one-pass kernel."""
    programs = num_reqs * num_kv_heads
    if max_query_len > 1 or programs >= rule.min_programs or programs == 0:
        return 1
    return pow2_splits(programs, max_splits=rule.max_segments,
                       target_programs=rule.target_programs, max_seq_len=max_seq_len,
                       min_tokens=rule.min_tokens_per_segment)


def context_segments(
    rule: SplitRule, *, max_query_len: int, max_context_len: int, max_seq_len: int
) -> int:
    """Most split-KV segments a prefill part may take by `rule` (see `SplitRule`): 1 unless
    its longest context (``seq_len - query_len``) holds at least ``rule.context_ratio``
    times its longest query; then the largest power of two ``<= rule.max_segments`` keeping
    ``rule.context_min_tokens`` tokens of `max_seq_len` per segment. The launch takes as many
    of them as its grid leaves room for (`fit_segments`).

    >>> context_segments(SplitRule(), max_query_len=64, max_context_len=4096, max_seq_len=4160)
    32
    >>> context_segments(SplitRule(), max_query_len=2048, max_context_len=0, max_seq_len=2048)
    1
    """
    if max_context_len < rule.context_ratio * max(1, max_query_len):
        return 1
    return pow2_splits(1, max_splits=rule.max_segments, target_programs=rule.max_segments,
                       max_seq_len=max_seq_len, min_tokens=rule.context_min_tokens)


def fit_segments(max_segments: int, *, programs: int, num_sms: int) -> int:
    """The largest power of two ``S <= max_segments`` (1 at least) with ``programs * S <=
    num_sms``: a context split that keeps the launch within one program per SM.

    >>> fit_segments(32, programs=4, num_sms=132), fit_segments(32, programs=32, num_sms=132)
    (32, 4)
    """
    # `pow2_splits` without its tokens-per-split bound (`context_segments` applied it).
    return pow2_splits(programs, max_splits=max_segments, target_programs=num_sms,
                       max_seq_len=0, min_tokens=0)


def context_split(
    part: LaunchPart, *, num_heads: int, num_kv_heads: int, head_size: int, itemsize: int,
    kv_itemsize: int, num_sms: int, interpreting: bool,
) -> int:
    """Segments a prefill part with ``context_segments > 1`` takes for `num_heads` query
    heads: `fit_segments` over the q-blocks of its prefill tiles (`tile_config`) that its
    requests use (``part.query_lens``; else the classic grid's bound) times the KV heads.

    >>> part = LaunchPart(req_begin=0, req_end=1, token_begin=0, token_end=64,
    ...                   max_query_len=64, prefill_only=True, context_segments=32,
    ...                   query_lens=(64,))
    >>> context_split(part, num_heads=14, num_kv_heads=2, head_size=64, itemsize=2,
    ...               kv_itemsize=2, num_sms=132, interpreting=False)
    32
    """
    cfg = tile_config(part.max_query_len, num_heads // num_kv_heads, head_size,
                      interpreting=interpreting, prefill_only=part.prefill_only,
                      itemsize=itemsize, kv_itemsize=kv_itemsize)
    if part.query_lens:
        q_blocks = sum(-(-q // cfg.block_q) for q in part.query_lens)
    else:
        q_blocks = part.token_end // cfg.block_q - part.token_begin // cfg.block_q + part.num_reqs
    return fit_segments(part.context_segments, programs=q_blocks * num_kv_heads,
                        num_sms=num_sms)


def pow2_splits(
    programs: int, *, max_splits: int, target_programs: int, max_seq_len: int, min_tokens: int
) -> int:
    """The largest power of two ``S <= max_splits`` (1 at least) with ``programs * S <=
    target_programs`` and at least `min_tokens` context tokens per split of `max_seq_len`:
    the split-KV rule of the attention and MLA decodes."""
    splits = 1
    while (
        splits * 2 <= max_splits
        and programs * splits * 2 <= target_programs
        and max_seq_len // (splits * 2) >= min_tokens
    ):
        splits *= 2
    return splits


def balanced_grid_size(rule: SplitRule, *, num_reqs: int, num_kv_heads: int) -> int:
    """Programs per KV head of a length-balanced decode grid: ``R + G``, ``G =
    max(1, target_programs // Hkv)`` (the split budget), from the shapes only.

    Every request gets at least one program and the segments share the budget ``G``, so
    ``sum s_r <= G + R`` for any lengths (see `balanced_segments`).

    >>> balanced_grid_size(SplitRule(), num_reqs=24, num_kv_heads=8)
    88
    """
    return num_reqs + max(1, rule.target_programs // num_kv_heads)


def balanced_segments(
    seq_lens: list[int], *, budget: int, tile_n: int, min_tiles: int,
    window: int | None = None,
) -> list[int]:
    """Segments of each request on a length-balanced grid (the kernel's `_balanced_layout`).

    ``tiles_r = cdiv(len_r, tile_n)`` (only the window's tiles with `window`), ``L =
    max(cdiv(sum tiles, budget), min_tiles)``, ``s_r = max(1, cdiv(tiles_r, L))``.

    >>> balanced_segments([32768] + [256] * 20, budget=64, tile_n=64, min_tiles=4)[:3]
    [52, 1, 1]
    """
    tiles = []
    for n in seq_lens:
        hi = -(-n // tile_n)
        tiles.append(hi - max(n - window, 0) // tile_n if window is not None else hi)
    per = max(-(-sum(tiles) // max(budget, 1)), min_tiles, 1)
    return [max(1, -(-t // per)) for t in tiles]


def balanced_pays(
    seq_lens: list[int], *, budget: int, tile_n: int, min_tiles: int, uniform_segments: int
) -> bool:
    """Whether a decode step goes to the balanced grid: its longest program would read fewer
    than ``1 / BALANCED_GAIN`` of the tiles of the uniform plan's longest (`uniform_segments`
    per request). Otherwise (equal lengths, or nothing to split) the uniform launch serves
    it without the layout work. (Without a sliding window: the kernel redoes the layout
    exactly, this only picks the launch.)

    >>> balanced_pays([32768] + [300] * 20, budget=64, tile_n=64, min_tiles=4,
    ...               uniform_segments=2)
    True
    >>> balanced_pays([32768] * 8, budget=64, tile_n=64, min_tiles=4, uniform_segments=8)
    False
    """
    segs = balanced_segments(seq_lens, budget=budget, tile_n=tile_n, min_tiles=min_tiles)
    tiles = [-(-n // tile_n) for n in seq_lens]
    balanced = max(-(-t // s) for t, s in zip(tiles, segs, strict=True))
    uniform = max(-(-t // uniform_segments) for t in tiles)
    return max(segs) > 1 and uniform > BALANCED_GAIN * balanced


def decode_plan(rule: SplitRule, env: str) -> tuple[bool, int]:
    """``(balanced, min_tokens_per_segment)`` of decode launches from `rule` and the
    ``PAGEDCORE_TRITON_DECODE_PLAN`` value `env`: ``""`` follows ``rule.balanced``,
    ``"uniform"`` / ``"balanced"`` force it, ``"balanced:N"`` also sets the least tokens per
    segment to ``N`` (tests: splits short contexts too).

    >>> decode_plan(SplitRule(), "balanced:16")
    (True, 16)
    """
    name, _, tokens = env.partition(":")
    if env == "":
        return rule.balanced, rule.min_tokens_per_segment
    if env == "uniform":
        return False, rule.min_tokens_per_segment
    if name == "balanced" and (tokens == "" or (tokens.isdecimal() and int(tokens) > 0)):
        return True, int(tokens) if tokens else rule.min_tokens_per_segment
    raise ValueError(
        f"{DECODE_PLAN_ENV}={env!r}: expected 'balanced', 'balanced:N' (N > 0 tokens per "
        "segment at least) or 'uniform' (or unset for SplitRule.balanced)"
    )


def flat_grid_size(
    *, num_tokens: int, num_reqs: int, block_q: int, num_segments: int, target_programs: int
) -> int:
    """Programs per KV head of a flat mixed-step grid (`LaunchPart.flat_programs`).

    A step of at most `num_tokens` tokens over `num_reqs` request slots, every non-empty
    request starting a fresh q-block, uses at most ``cdiv(num_tokens, block_q) +
    min(num_reqs, num_tokens)`` q-blocks (a request with query length 0 adds none: see the
    kernel's ``_flat_layout``). The grid covers that bound once, and grows towards
    `target_programs` (the split budget) so that a step using few q-blocks can give each one
    up to `num_segments` segments.

    Examples
    --------
    >>> flat_grid_size(num_tokens=16, num_reqs=64, block_q=18, num_segments=64,
    ...                target_programs=256)
    256
    >>> flat_grid_size(num_tokens=8192, num_reqs=64, block_q=18, num_segments=1,
    ...                target_programs=256)
    520
    """
    q_blocks = -(-num_tokens // block_q) + min(num_reqs, num_tokens)
    return max(q_blocks, min(q_blocks * num_segments, target_programs))


@attrs.frozen(kw_only=True)
class TileConfig:
    """Tile shape and launch parameters of one attention launch."""

    block_m: int
    block_q: int
    tile_n: int
    num_warps: int
    num_stages: int
    #: Run interior tiles without masks (prefill-sized tiles; see the kernel).
    skip_interior_masks: bool = False
    #: Launch the q-blocks that see the most keys first (causal prefill load balance).
    longest_first: bool = False
    #: The masked loops (causal diagonal, window edge, sequence tail) are not pipelined.
    unpipelined_edges: bool = False
    #: K/V offsets in int32 where the cache allows it (fewer than 2**31 elements).
    int32_offsets: bool = False
    #: Hopper prefill kernel only: warp-specialize its unmasked loop (``plan_tma``).
    warp_specialize: bool = False
    #: Hopper prefill kernel only: keys near the causal diagonal in tiles of this many
    #: (0: in `tile_n` tiles), so that only the last one is masked.
    diag_tile_n: int = 0
    #: How an fp8 cache's tiles become dot operands (the kernels' ``KV_CVT``, read only for
    #: fp8 caches with 16-bit queries): 0 a cast to the query's dtype, 1 a cast to float16,
    #: 2 float16 rebuilt from the fp8 bits, 3 the ``cvt.rn.f16x2`` PTX instruction (see
    #: ``kernels/attention.py``'s `_fp8_operand`).
    kv_convert: int = 0
    #: Registers per thread at most (Triton's ``maxnreg``; None: the compiler's choice).
    maxnreg: int | None = None
    #: fp8 single-token decodes only: 0 runs the general kernel; 1, 2 or 3 runs
    #: ``kernels/decode_fp8.py`` with that ``MODE`` (1: swapped dots, K/V tiles the A
    #: operands; 2: float32 multiply-adds, no dots; 3: Q @ K^T, then V^T @ P^T) and
    #: `fp8_rows` rows (the GQA group padded, at least 16 for the dots of modes 1 and 3).
    fp8_decode: int = 0
    fp8_rows: int = 16
    #: With `fp8_decode`: 1 loads tile t + 1's K/V into registers while the kernel computes
    #: tile t, 2 also the block table two tiles ahead (``PREFETCH``; with ``num_stages`` 1
    #: instead of Triton's software pipelining); 0 leaves it to Triton.
    fp8_prefetch: int = 0
    #: Hopper prefill kernel only: the KV head is the grid's fast axis (``plan_tma``).
    heads_fast: bool = False
    #: Hopper prefill kernel only: the warp-specialized kernel for launches without a
    #: cached prefix (``prefill_tma_ws_kernel``; ``block_q == block_m``, no GQA packing).
    tma_ws: bool = False
    #: With `tma_ws`: the persistent kernel (``prefill_tma_ws_persistent_kernel``, one
    #: program per SM looping over the q-blocks and heads) instead of one program each.
    persistent: bool = False


def parse_tiles(text: str, num_queries_per_kv: int) -> TileConfig:
    """A prefill `TileConfig` from ``"BLOCK_M,TILE_N,WARPS,STAGES[,FLAG...]"`` (tuning).

    Flags (`TILE_FLAGS`): ``fwd`` keeps the natural q-block order instead of longest-first;
    ``m1`` leaves the masked edge loops unpipelined; ``i32`` computes K/V offsets in int32
    when the cache is small enough.
    """
    fields = [f.strip() for f in text.split(",")]
    try:
        block_m, tile_n, warps, stages = (int(f) for f in fields[:4])
    except ValueError:
        block_m = tile_n = warps = stages = 0
    flags = fields[4:]
    ok = len(fields) >= 4 and all(f in TILE_FLAGS for f in flags) and len(set(flags)) == len(
        flags
    )
    pow2 = all(x >= 16 and x & (x - 1) == 0 for x in (block_m, tile_n))
    if not ok or not pow2 or min(warps, stages) <= 0:
        raise ValueError(
            f"{PREFILL_TILES_ENV}={text!r}: expected 'BLOCK_M,TILE_N,WARPS,STAGES[,FLAG...]' "
            "with BLOCK_M and TILE_N powers of two >= 16, positive WARPS and STAGES and each "
            f"FLAG at most once, one of {', '.join(TILE_FLAGS)}; e.g. '128,64,4,3' or "
            "'128,128,8,2,i32'"
        )
    block_m = max(block_m, _next_pow2(num_queries_per_kv))
    return TileConfig(
        block_m=block_m,
        block_q=max(1, block_m // num_queries_per_kv),
        tile_n=tile_n,
        num_warps=warps,
        num_stages=stages,
        skip_interior_masks=block_m >= 64,
        longest_first="fwd" not in flags,
        unpipelined_edges="m1" in flags,
        int32_offsets="i32" in flags,
    )


def parse_decode_tiles(text: str, base: TileConfig) -> TileConfig:
    """`base` (a decode `TileConfig`) with the ``PAGEDCORE_TRITON_DECODE_TILES`` text applied:
    ``"TILE_N,WARPS,STAGES[,FLAG...]"``, flags ``cvtN`` (N in 0..3: `TileConfig.kv_convert`),
    ``s`` (unmasked interior tiles), ``i32`` (int32 K/V offsets), ``rN`` (``maxnreg``),
    ``kN`` (N in 0..3: `TileConfig.fp8_decode`), ``b4`` / ``b8`` / ``b16``
    (`TileConfig.fp8_rows`), ``pf1`` / ``pf2`` (`TileConfig.fp8_prefetch`).

    >>> base = TileConfig(block_m=16, block_q=4, tile_n=64, num_warps=4, num_stages=3)
    >>> cfg = parse_decode_tiles("128,4,5,cvt1,i32", base)
    >>> (cfg.tile_n, cfg.num_stages, cfg.kv_convert, cfg.int32_offsets, cfg.block_m)
    (128, 5, 1, True, 16)
    """
    fields = [f.strip() for f in text.split(",")]
    try:
        tile_n, warps, stages = (int(f) for f in fields[:3])
    except ValueError:
        tile_n = warps = stages = 0
    flags = fields[3:]
    cvt, regs = base.kv_convert, base.maxnreg
    mode, rows, prefetch = base.fp8_decode, base.fp8_rows, base.fp8_prefetch
    ok = len(fields) >= 3 and tile_n >= 16 and tile_n & (tile_n - 1) == 0 and warps > 0
    ok = ok and stages > 0 and len(set(flags)) == len(flags)
    for flag in flags:
        if flag.startswith("cvt") and flag[3:] in ("0", "1", "2", "3"):
            cvt = int(flag[3:])
        elif flag in ("k0", "k1", "k2", "k3"):
            mode = int(flag[1:])
        elif flag in ("b4", "b8", "b16"):
            rows = int(flag[1:])
        elif flag in ("pf1", "pf2"):
            prefetch = int(flag[2:])
        elif flag.startswith("r") and flag[1:].isdecimal() and int(flag[1:]) > 0:
            regs = int(flag[1:])
        elif flag not in ("s", "i32"):
            ok = False
    if not ok:
        raise ValueError(
            f"{DECODE_TILES_ENV}={text!r}: expected 'TILE_N,WARPS,STAGES[,FLAG...]' with "
            "TILE_N a power of two >= 16, positive WARPS and STAGES, and each FLAG at most once, "
            "one of cvt0..cvt3, s, i32, rN, k0..k3 (fp8 decode kernel mode), b4/b8/b16 (its "
            "rows), pf1/pf2 (its register prefetch); e.g. '128,4,5,cvt1' or '64,4,1,k3,pf2'"
        )
    return attrs.evolve(base, tile_n=tile_n, num_warps=warps, num_stages=stages,
                        kv_convert=cvt, maxnreg=regs, fp8_decode=mode, fp8_rows=rows,
                        fp8_prefetch=prefetch,
                        skip_interior_masks="s" in flags or base.skip_interior_masks,
                        int32_offsets="i32" in flags or base.int32_offsets)


def kv_convert(cfg: TileConfig, *, kv_fp8: bool, itemsize: int, interpreting: bool) -> int:
    """The kernels' ``KV_CVT`` for a launch: ``cfg.kv_convert`` for an fp8 cache read by 16-bit
    queries (`itemsize` 2) on the GPU, else 0 (a cast to the query's dtype: fp32 dots and
    Triton's interpreter keep it).

    >>> cfg = TileConfig(block_m=16, block_q=4, tile_n=128, num_warps=4, num_stages=3,
    ...                  kv_convert=2)
    >>> kv_convert(cfg, kv_fp8=True, itemsize=2, interpreting=False)
    2
    >>> kv_convert(cfg, kv_fp8=True, itemsize=4, interpreting=False)
    0
    """
    if not kv_fp8 or interpreting or itemsize != 2:
        return 0
    return cfg.kv_convert


def tile_config(
    max_query_len: int,
    num_queries_per_kv: int,
    head_size: int,
    *,
    interpreting: bool,
    prefill_override: str | None = None,
    prefill_only: bool = False,
    itemsize: int = 2,
    kv_itemsize: int | None = None,
) -> TileConfig:
    """Tile shape for a launch: rows = query tokens x the GQA group, a power of two >= 16.

    Decodes get 16-row tiles (the smallest ``tl.dot``), 64-token K/V tiles, 4 warps, 3 stages
    (head sizes above 128: 32-token tiles);
    prefills up to 128 rows (64 for head sizes above 128, to bound registers and shared
    memory) with 64-token tiles, 4 warps, 3 stages, unmasked interior tiles and int32 K/V
    offsets (where the cache allows). A `prefill_only` launch (every request has more than
    one query token) of a 16-bit dtype (`itemsize` 2) with head size <= 128 grows to 256 rows
    on 8 warps, two warpgroups sharing each K/V tile: 0.615x / 0.738x SDPA at 4x2048 /
    4x8192 against 0.609x / 0.688x for 128 rows, but a launch that may hold decodes (a
    unified or captured mixed step) keeps 128 rows, where a 256-row tile would make each
    decode's K/V stream compute-bound. All were the fastest of the variants swept on the
    H200 (``docs/benchmarks/triton.md``). Prefill tiles launch their q-blocks longest-first.
    `prefill_override` (the ``PAGEDCORE_TRITON_PREFILL_TILES`` text, see `parse_tiles`)
    replaces the prefill shape. Decodes with head size <= 128 take `DECODE_TILES` by the
    cache's element size (`kv_itemsize`; fp8: 128-token tiles on 5 stages with float16
    operands), those with head size <= 64 `SMALL_HEAD_DECODE_TILES`;
    ``PAGEDCORE_TRITON_DECODE_TILES`` overrides the decode shape (tuning, see
    `parse_decode_tiles`).
    """
    if prefill_override and max_query_len > 1:
        return parse_tiles(prefill_override, num_queries_per_kv)
    head_pad = _next_pow2(head_size)
    max_rows = 128 if head_pad <= 128 else 64
    if prefill_only and head_pad <= 128 and itemsize <= 2:
        max_rows = 256
    if interpreting:
        max_rows = 64
    rows = max(16, _next_pow2(max_query_len * num_queries_per_kv))
    block_m = max(min(rows, max_rows), _next_pow2(num_queries_per_kv))
    block_q = max(1, block_m // num_queries_per_kv)
    if interpreting:
        tile_n = 16
    elif head_pad <= 128:
        tile_n = 64
    else:
        tile_n = 32
    cfg = TileConfig(
        block_m=block_m,
        block_q=block_q,
        tile_n=tile_n,
        num_warps=8 if block_m >= 256 else 4,
        num_stages=3,
        skip_interior_masks=block_m >= 64,
        longest_first=max_query_len > 1,
        int32_offsets=max_query_len > 1,
    )
    if max_query_len > 1:
        return cfg
    if interpreting:  # the interpreter's small tiles, but the fp8 decode kernel the GPU runs
        fp8_mode = DECODE_TILES[1].get("fp8_decode", 0) if kv_itemsize == 1 else 0
        fp8_mode = fp8_mode if head_pad <= 128 else 0
        if not fp8_mode:
            return cfg
        return attrs.evolve(cfg, fp8_decode=fp8_mode,
                            fp8_prefetch=DECODE_TILES[1].get("fp8_prefetch", 0))
    if head_pad <= 128:
        table = SMALL_HEAD_DECODE_TILES if head_pad <= 64 else DECODE_TILES
        cfg = attrs.evolve(cfg, **table[1 if kv_itemsize == 1 else 2])
    override = os.environ.get(DECODE_TILES_ENV)
    return parse_decode_tiles(override, cfg) if override else cfg

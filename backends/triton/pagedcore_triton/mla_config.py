"""Launch configurations of the Triton MLA decode (`MLAKernelConfig`) and the split-KV rule.

`MLA_KERNEL_CONFIGS` names the variants `pagedcore bench mla --variants` times;
``DEFAULT_MLA_KERNEL`` is the one `pagedcore_triton.mla.TritonMLAImpl` ships (the best measured
on the H200, see docs/mla.md). Pure Python: no torch or Triton import.
"""

from __future__ import annotations

import attrs

from pagedcore_triton.plan import pow2_splits

__all__ = [
    "DEFAULT_MLA_KERNEL",
    "MLA_KERNEL_CONFIGS",
    "MLAKernelConfig",
    "MLASplitRule",
    "choose_mla_splits",
    "merge_layout",
]

#: Default of `MLAKernelConfig.merge_row_pairs` (``TritonMLAImpl.merge_whole_row_pairs``).
MERGE_WHOLE_ROW_PAIRS = 1024


@attrs.frozen(kw_only=True)
class MLASplitRule:
    """Split-KV rule: double the splits while the grid stays within `target_programs` programs
    (about one wave of resident programs on an H200's 132 SMs), each split keeps at least
    `min_tokens_per_split` positions, and the count stays at most `max_splits` (a power of
    two)."""

    target_programs: int = 264
    min_tokens_per_split: int = 128
    max_splits: int = 64


def choose_mla_splits(
    rule: MLASplitRule, *, num_tokens: int, head_blocks: int, max_seq_len: int
) -> int:
    """Power-of-two split count for one launch (1 = no split)."""
    return pow2_splits(max(1, num_tokens * head_blocks), max_splits=rule.max_splits,
                       target_programs=rule.target_programs, max_seq_len=max_seq_len,
                       min_tokens=rule.min_tokens_per_split)


def _pow2(x: int) -> bool:
    return x >= 1 and not x & (x - 1)


@attrs.frozen(kw_only=True)
class MLAKernelConfig:
    """One launch configuration of the decode kernel (the variants the bench times).

    Attributes
    ----------
    name:
        Short label used by the bench and in ``MLA_KERNEL_CONFIGS``.
    block_n:
        Cache positions per inner tile (``BLOCK_N``).
    num_warps, num_stages:
        Triton launch options. ``num_stages`` 2-4 leave the row tile single-buffered (the
        block-table load takes a pipeline stage), 5-6 double-buffer it, 7-8 triple-buffer it.
    maxnreg:
        Register cap per thread (None = the compiler's choice); lower caps fit more programs
        per SM. Ignored under the interpreter.
    lat_split:
        Latent column chunks (1, 2 or 4; fewer when the latent is narrow): each chunk has its
        own score MMA chain and accumulator, so the MMAs of a tile do not form one chain.
    split:
        When to split the context into segments (split-KV).
    pdl:
        Launch the kernels with programmatic dependent launch (sm_90 and newer; ignored on
        older GPUs and under the interpreter): each kernel's programs are placed while the
        previous kernel drains and wait for its results (``griddepcontrol.wait``) before
        reading anything, which hides the launch gaps between the decode and merge kernels
        and between steps.
    merge_chunk:
        Most split partials the merge kernel reads per round trip (a power of two; fewer
        when the split count or the register budget is smaller).
    merge_cols:
        Latent columns per merge program when the (token, head) pairs are few (a power of
        two >= 16): smaller slices give more, shorter merge programs.
    merge_row_pairs:
        From this many (token, head) pairs on, one merge program combines a whole latent row
        (None = ``TritonMLAImpl.merge_whole_row_pairs``, 1024).
    merge_warps:
        Warps of a merge program over `merge_cols` columns (whole-row programs have 4).
    split_first:
        Launch split grids as ``(splits, head blocks, tokens)`` so that the splits of one
        token are placed next to each other.
    short_split_warps, short_split_len:
        When set, the warps of a split launch whose segments have at most `short_split_len`
        positions (few tiles per program, e.g. 4 requests of 32768 tokens in 64 splits).
    fused_fanin:
        When set (a power of two >= 2), no merge kernel: the split programs merge their
        partials themselves, as a tree of this fan-in. Each program writes its partial and
        counts itself in with an atomic counter per group of `fused_fanin` splits; the last
        arrival of a group merges the group (and resets the counter to 0), then does the same
        one level up. The merge settings (`merge_chunk` ... `merge_warps`) are then unused.
    half_partials:
        Store the split partials' ``acc / sum`` in the query's dtype when it is 16-bit
        (bf16, fp16; fp32 queries keep fp32 partials): half the bytes the split programs
        write and the merge reads. A normalised partial is a convex combination of cache
        rows, so it lies within the cache dtype's range; the maxima and sums stay fp32 and
        the merge accumulates in fp32. Needs the merge kernel (not `fused_fanin`, whose
        partials are unnormalised).
    rowsum_2d:
        Keep the softmax row sums as a ``[BLOCK_H, BLOCK_N]`` tile (rescaled and added to
        elementwise) and sum it across the tile's columns once after the loop, instead of a
        row sum per tile: one cross-warp reduction less per tile (9 -> 6 barriers per tile
        in Triton 3.6's sm_90 SASS).
    merge_values:
        Most partial values a merge thread holds per round trip (``chunk * cols`` over the
        program's threads); the merge accumulates them in fp32 registers.
    merge_row_warps:
        Warps of a whole-row merge program (`merge_row_pairs`). With 16-bit partials, 2
        warps give each warp whole columns of a 512-wide row (4 would split the splits'
        rows across warps and sum them through shared memory).
    narrow_heads, narrow_min_splits:
        When set (a power of two below ``TritonMLAImpl.block_h``, 16), a launch that would
        split into at least `narrow_min_splits` segments serves only `narrow_heads` query
        heads per program instead (the MMA keeps 16 rows, the rest masked): more head
        blocks, so fewer splits, longer segments and fewer partials (none at all when the
        split count drops to 1). Each cache row is then read by ``16 // narrow_heads``
        programs that run side by side: one read from DRAM, the others from L2.
    """

    name: str
    block_n: int = 32
    num_warps: int = 4
    num_stages: int = 2
    maxnreg: int | None = None
    lat_split: int = 1
    split: MLASplitRule = MLASplitRule()
    pdl: bool = False
    merge_chunk: int = 16
    merge_cols: int = 128
    merge_row_pairs: int | None = None
    merge_warps: int = 4
    split_first: bool = False
    short_split_warps: int | None = None
    short_split_len: int = 512
    fused_fanin: int | None = None
    half_partials: bool = False
    narrow_heads: int | None = None
    narrow_min_splits: int = 2
    rowsum_2d: bool = False
    merge_row_warps: int = 4
    merge_values: int = 64

    def launch_warps(self, splits: int, split_len: int) -> int:
        """``num_warps``, or `short_split_warps` for a split launch of short segments."""
        if self.short_split_warps is not None and splits > 1 and (
            split_len <= self.short_split_len
        ):
            return self.short_split_warps
        return self.num_warps

    def __attrs_post_init__(self) -> None:
        if self.lat_split not in (1, 2, 4):
            raise ValueError(f"lat_split must be 1, 2 or 4, got {self.lat_split}")
        if self.merge_chunk < 2 or not _pow2(self.merge_chunk):
            raise ValueError(f"merge_chunk must be a power of two >= 2, got {self.merge_chunk}")
        if self.merge_values < 2 or not _pow2(self.merge_values):
            raise ValueError(f"merge_values must be a power of two >= 2, got {self.merge_values}")
        if self.merge_cols < 16 or not _pow2(self.merge_cols):
            raise ValueError(f"merge_cols must be a power of two >= 16, got {self.merge_cols}")
        if self.block_n < 16 or not _pow2(self.block_n):
            raise ValueError(f"block_n must be a power of two >= 16, got {self.block_n}")
        if self.fused_fanin is not None and (self.fused_fanin < 2 or not _pow2(self.fused_fanin)):
            raise ValueError(
                f"fused_fanin must be None or a power of two >= 2, got {self.fused_fanin}")
        if self.half_partials and self.fused_fanin is not None:
            raise ValueError("half_partials needs the merge kernel (fused_fanin=None): the "
                             "fused merge keeps unnormalised partials, which may overflow "
                             "16 bits")
        if self.narrow_heads is not None and (
            not _pow2(self.narrow_heads) or self.fused_fanin is not None
        ):
            raise ValueError(f"narrow_heads must be None or a power of two, without "
                             f"fused_fanin (got {self.narrow_heads}, fused_fanin="
                             f"{self.fused_fanin})")
        for what, warps in (("num_warps", self.num_warps), ("merge_warps", self.merge_warps),
                            ("short_split_warps", self.short_split_warps or 1),
                            ("merge_row_warps", self.merge_row_warps)):
            if not _pow2(warps):
                raise ValueError(f"{what} must be a power of two, got {warps}")


def merge_layout(
    cfg: MLAKernelConfig, *, num_tokens: int, num_heads: int, lat_pad: int, splits: int,
    whole_row_pairs: int = MERGE_WHOLE_ROW_PAIRS,
) -> tuple[int, int, int]:
    """``(cols, chunk, warps)`` of the merge launch: latent columns per program, splits read
    per round trip, warps per program.

    About one wave of merge programs: whole rows when there are at least `merge_row_pairs`
    (else `whole_row_pairs`) (token, head) pairs, `merge_cols`-column slices when there are
    few (few long requests; `merge_warps` warps). A program holds ``[chunk, cols]`` fp32
    partials in registers, at most `MLAKernelConfig.merge_values` per thread.
    """
    threshold = cfg.merge_row_pairs or whole_row_pairs
    many = num_tokens * num_heads >= threshold
    cols = lat_pad if many else min(cfg.merge_cols, lat_pad)
    warps = cfg.merge_row_warps if many else cfg.merge_warps
    chunk = max(2, min(cfg.merge_chunk, 1 << max(0, splits - 1).bit_length(),
                       cfg.merge_values * 32 * warps // cols))
    return cols, chunk, warps


def _default_like(name: str, **kw: object) -> MLAKernelConfig:
    """The shipped default's settings (PDL, 64-split merge) with `kw` changed."""
    base: dict[str, object] = dict(block_n=32, num_stages=5, lat_split=4, pdl=True,
                                   merge_chunk=64)
    base.update(kw)
    return MLAKernelConfig(name=name, **base)  # type: ignore[arg-type]


#: The ninth run's default's merge and row-sum settings (the tenth run widens its merge).
_SHIPPED_MERGE: dict[str, object] = dict(merge_row_pairs=256, merge_cols=32, merge_warps=1,
                                         rowsum_2d=True, half_partials=True,
                                         merge_row_warps=2)

#: Names: ``n<BLOCK_N>``, ``s<stages>``, ``c<lat_split>``,
#: ``w<warps>`` (when not 4), ``p`` (``pdl``), ``m<merge_chunk>`` (when not 16), ``w2s``
#: (``short_split_warps`` 2), ``k<merge_cols>`` (when not 128), ``R<merge_row_pairs>``,
#: ``mw<merge_warps>`` (when not 4),
#: ``x<max_splits>`` (when not 64), ``f`` (``split_first``), ``r<maxnreg>``, ``t<split
#: target>`` (when not 264), ``u<fused_fanin>`` (merge fused into the split programs),
#: ``h`` (``half_partials``), ``g<narrow_heads>``,
#: ``d`` (``rowsum_2d``), ``rw<merge_row_warps>``, ``v<merge_values>`` (when not 64).
MLA_KERNEL_CONFIGS: dict[str, MLAKernelConfig] = {
    c.name: c
    for c in (
        # The shipped one (tenth run): the ninth run's kernel and merge, with 64-column
        # one-warp merge slices where the (token, head) pairs are few and up to 128 partial
        # values per merge thread (16 splits in one round trip on whole rows): PDL, up to
        # 64 splits merged in one round trip, whole-row 2-warp merge programs from 256
        # pairs on, the row sums kept as a tile, 16-bit split partials. 82.2-88.0 % of copy
        # at 4 of the 5 bench shapes, 73.9-75.8 % at 4 x 32768 (docs/mla.md, tenth run).
        _default_like("n32s5c4pm64R256k64mw1dhrw2v128", merge_values=128,
                      **{**_SHIPPED_MERGE, "merge_cols": 64}),
        # Eleventh run (removed): L2 prefetch hints, every tile for a tile 2-8 ahead (12-28
        # points slower), or for the first 2-4 tiles before the PDL wait (the forward +1.2-1.6
        # points at the unsplit 256 x 1024, 0.5-3 slower where a merge kernel precedes it).
        # The ninth run's default: 32-column merge slices, at most 64 values per merge
        # thread (72-73 % at 4 x 32768, the merge 2.7 us there instead of 2.1).
        _default_like("n32s5c4pm64R256k32mw1dhrw2", **_SHIPPED_MERGE),
        # The previous default (sixth to eighth runs): fp32 partials, a row sum per tile.
        _default_like("n32s5c4pm64R256k32mw1", merge_row_pairs=256, merge_cols=32,
                      merge_warps=1),
        # No merge kernel: the last-finishing split of each group of 4 splits merges the
        # group (a tree: 64 splits in 3 levels). Correct (CUDA-graph replay included) but
        # 1.5-21 points slower than the default at every split shape (seventh run; fan-in
        # 2, 8, 64 and two partials per round trip were no better and were removed).
        _default_like("n32s5c4pu4", fused_fanin=4),
        # The same with 4-warp, 128-column merge programs below 256 pairs:
        _default_like("n32s5c4pm64R256", merge_row_pairs=256),
        # The previous default (whole-row merges from 1024 pairs on):
        _default_like("n32s5c4pm64"),
        # 2 warps where the segments are short (4 x 32768 in 64 splits of 512): slower with
        # this merge (67.9 vs 69.7 %).
        _default_like("n32s5c4pm64w2s", short_split_warps=2),
        # Narrower merge slices when the pairs are few (more, shorter programs):
        _default_like("n32s5c4pm64k32", merge_cols=32),
        # The splits of one token launched side by side (grid (splits, heads, tokens)):
        _default_like("n32s5c4pm64f", split_first=True),
        # At most 32 splits (4 x 32768: 128 programs of 1024 positions, half the partials):
        _default_like("n32s5c4pm64x32", split=MLASplitRule(max_splits=32)),
        _default_like("n32s5c4w2pm64", num_warps=2),
        # Eighth run (docs/mla.md): the decode is bound per SM by the chain of dependent
        # steps of a tile (2 programs x 4 warps per SM), not by DRAM or by the instruction
        # count (lazy rescaling and clamped rows, fewer instructions per tile, were slower
        # and were removed).
        # 16-bit partials: the decode 2 us faster at every split shape, but the whole-row
        # merge programs 3-4x slower on them (76.2 / 71.2 / 84.4 / 79.9 / 73.6 %).
        _default_like("n32s5c4pm64R256k32mw1h", merge_row_pairs=256, merge_cols=32,
                      merge_warps=1, half_partials=True),
        # 8 heads per program on split launches, each row read by two programs side by side:
        # DRAM traffic unchanged, but every program still needs 2.4 us per tile, so twice
        # the time (41-45 % at the split shapes; 4 heads (g4): 23 %, removed).
        _default_like("n32s5c4pm64R256k32mw1g8", merge_row_pairs=256, merge_cols=32,
                      merge_warps=1, narrow_heads=8),
        # Ninth run: the default's two changes alone (row sums as a tile: +2-3 points at
        # every shape but 4 x 32768; 16-bit partials on 2-warp whole-row merges: +1-2.5).
        _default_like("n32s5c4pm64R256k32mw1d", merge_row_pairs=256, merge_cols=32,
                      merge_warps=1, rowsum_2d=True),
        _default_like("n32s5c4pm64R256k32mw1hrw2", merge_row_pairs=256, merge_cols=32,
                      merge_warps=1, half_partials=True, merge_row_warps=2),
        MLAKernelConfig(name="n32s5c4p", block_n=32, num_stages=5, lat_split=4, pdl=True),
        # No PDL, 16 splits per merge round trip:
        MLAKernelConfig(name="n32s5c4", block_n=32, num_stages=5, lat_split=4),
        # One score-MMA chain over all 576 dims, single-buffered rows (the first kernel):
        MLAKernelConfig(name="n32s2", block_n=32, num_stages=2,
                        split=MLASplitRule(target_programs=528)),
    )
}
DEFAULT_MLA_KERNEL = MLA_KERNEL_CONFIGS["n32s5c4pm64R256k64mw1dhrw2v128"]

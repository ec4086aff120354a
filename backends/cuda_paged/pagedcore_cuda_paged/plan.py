"""Planning one step for the cuda_paged kernels: which requests decode, how prefill rows are
tiled, and whether decode runs in one pass or in partitions.

Everything here is plain arithmetic on CPU ints, mirrored exactly by the kernels
(``csrc/decode.cuh`` `decode_span`, ``csrc/prefill.cuh`` tiling), so it is unit-tested on CPU.
"""

from __future__ import annotations

import enum

import attrs

from pagedcore.kv_cache.spec import cdiv

__all__ = [
    "DEFAULT_PREFILL_KERNEL",
    "MMA_MAX_HEAD_SIZE",
    "PREFILL_TILE_ROWS",
    "DecodeKernel",
    "DecodeLaunch",
    "DecodePass",
    "DecodePolicy",
    "PrefillKernel",
    "capture_span_bound",
    "decode_grouped_smem_bytes",
    "decode_mma_smem_bytes",
    "decode_plan",
    "decode_smem_bytes",
    "decode_span",
    "mma_applies",
    "num_partitions",
    "prefill_kernel_code",
    "prefill_tiles",
]

#: Query rows per prefill thread block (csrc/prefill.cuh kPrefillRows).
PREFILL_TILE_ROWS = 64
#: Threads per decode thread block (csrc/params.h kDecodeThreads).
_DECODE_THREADS = 128
#: Query heads a grouped decode block accumulates at once, at most (csrc/params.h).
_GROUP_CHUNK_MAX = 8
#: Largest head size of the tensor-core kernels (csrc/decode_mma.cuh, csrc/prefill_mma.cuh);
#: 256 would need more than the 255 registers a thread has, so it keeps the classic kernels.
MMA_MAX_HEAD_SIZE = 128
#: Query heads one mma decode thread block serves (the M rows of one mma tile).
_MMA_HEADS = 16


class DecodeKernel(enum.Enum):
    """Which decode kernel family runs.

    ``MMA`` (csrc/decode_mma.cuh): tensor cores, the GQA group as the M rows, scores, softmax
    and output in registers; float16/bfloat16 and head sizes up to `MMA_MAX_HEAD_SIZE`.
    ``CLASSIC`` (csrc/decode.cuh, decode_grouped.cuh): CUDA cores, every dtype and head size.
    Where MMA is asked for but does not apply, CLASSIC runs.
    """

    MMA = "mma"
    CLASSIC = "classic"


class PrefillKernel(enum.Enum):
    """Which prefill kernel runs (csrc/prefill_mma.cuh or csrc/prefill.cuh).

    ``MMA``: FlashAttention-2 style, `mma.m16n8k16` with S, P and O in registers, cp.async
    double-buffered K/V tiles, 64 query rows a thread block; float16/bfloat16 and head sizes
    up to `MMA_MAX_HEAD_SIZE` (elsewhere ``WMMA`` runs). ``MMA_128``: the same with 128 rows
    (32 a warp: each K/V fragment feeds two mmas). ``MMA_PIPE`` / ``MMA_128_PIPE``: the same
    with the pipelined K/V gather (block-table entries read a tile ahead, every cp.async of a
    tile issued back to back). ``MMA_W8_PIPE``: pipelined, 128 rows as 8 warps of 16 rows
    (Q fragments in registers, no spills). ``MMA_128_K32_PIPE``: pipelined, 128 rows as 4
    warps of 32 rows with 32-key tiles (half the score registers). ``MMA_256_K32_PIPE``:
    pipelined, 256 rows as 8 warps of 32 rows, 32-key tiles. ``MMA_128_K32_3STAGE`` and
    ``MMA_W8_3STAGE``: ``MMA_128_K32_PIPE`` and ``MMA_W8_PIPE`` with three K/V tiles in
    flight (a cp.async ring, one barrier per tile). ``MMA_128_K32_3STAGE_FAST`` and
    ``MMA_128_FAST`` (``MMA_128_PIPE``): the same with a straight-line softmax
    on unmasked tiles without ALiBi / soft-cap and the output rescaled only when a row maximum
    moved. ``MMA_128_K32_3STAGE_FAST_HM``: ``MMA_128_K32_3STAGE_FAST`` with the query heads
    of a tile as consecutive thread blocks (the heads of one KV head read the same K/V tiles
    side by side, heaviest tiles first over all heads) and the whole shared-memory carveout
    requested. ``MMA_64_K32_3STAGE_FAST_HM``: the same with 64-row tiles (4 warps of 16
    rows, Q fragments in registers, <= 168 registers: three thread blocks per SM).
    ``MMA_128_K32_4STAGE_FAST_HM``: ``MMA_128_K32_3STAGE_FAST_HM`` with four K/V tiles in
    flight. ``MMA_128_FAST_HM`` (the default): ``MMA_128_FAST`` launched head-major the same way.
    ``MMA_128_FAST_WM`` and ``MMA_128_FAST_HM_WM``: ``MMA_128_FAST`` and ``MMA_128_FAST_HM``
    with the masks decided per warp (on the causal diagonal a warp whose rows see the whole
    key tile takes the straight-line softmax, one whose rows see none of it skips the tile).
    ``MMA_128_FAST_WM_1B``: ``MMA_128_FAST_WM`` with one barrier per K/V tile (the next tile
    is requested after the barrier that follows the current tile's arrival).
    ``MMA_128_FAST_WMP`` and ``MMA_128_FAST_WMP_1B``: ``MMA_128_FAST_WM`` and
    ``MMA_128_FAST_WM_1B`` where masked tiles without ALiBi / soft-cap also take a straight-
    line softmax (each row's visible keys are one range: a select per score).
    ``WMMA``: the first tensor-core kernel
    (WMMA 16x16x16, scores and output through shared memory; float32 on CUDA cores).
    ``WMMA_LANE_PER_KEY``: the same with its first softmax formulation, a slower reference
    path.
    """

    MMA = "mma"
    MMA_128 = "mma_128"
    MMA_PIPE = "mma_pipe"
    MMA_128_PIPE = "mma_128_pipe"
    MMA_W8_PIPE = "mma_w8_pipe"
    MMA_128_K32_PIPE = "mma_128_k32_pipe"
    MMA_256_K32_PIPE = "mma_256_k32_pipe"
    MMA_128_K32_3STAGE = "mma_128_k32_3stage"
    MMA_W8_3STAGE = "mma_w8_3stage"
    MMA_128_K32_3STAGE_FAST = "mma_128_k32_3stage_fast"
    MMA_128_FAST = "mma_128_fast"
    MMA_128_K32_3STAGE_FAST_HM = "mma_128_k32_3stage_fast_hm"
    MMA_64_K32_3STAGE_FAST_HM = "mma_64_k32_3stage_fast_hm"
    MMA_128_K32_4STAGE_FAST_HM = "mma_128_k32_4stage_fast_hm"
    MMA_128_FAST_HM = "mma_128_fast_hm"
    MMA_128_FAST_WM = "mma_128_fast_wm"
    MMA_128_FAST_HM_WM = "mma_128_fast_hm_wm"
    MMA_128_FAST_WM_1B = "mma_128_fast_wm_1b"
    MMA_128_FAST_WMP = "mma_128_fast_wmp"
    MMA_128_FAST_WMP_1B = "mma_128_fast_wmp_1b"
    WMMA = "wmma"
    WMMA_LANE_PER_KEY = "wmma_lane_per_key"


def mma_applies(*, head_size: int, is_float32: bool) -> bool:
    """Whether the tensor-core kernels cover this head size and dtype."""
    return not is_float32 and head_size <= MMA_MAX_HEAD_SIZE


#: The prefill kernel builders use unless told otherwise: the fastest of the checked candidates
#: at both causal prompt shapes in two timing runs on the H200 (`bench/pick_prefill.py`; see
#: docs/benchmarks/cuda_paged.md, session 5).
DEFAULT_PREFILL_KERNEL = PrefillKernel.MMA_128_FAST_HM

#: (extension variant, rows per tile) of the MMA prefill kernels (csrc/ops.cpp `prefill`).
_MMA_PREFILL = {
    PrefillKernel.MMA: (0, 64),
    PrefillKernel.MMA_128: (0, 128),
    PrefillKernel.MMA_PIPE: (3, 64),
    PrefillKernel.MMA_128_PIPE: (3, 128),
    PrefillKernel.MMA_W8_PIPE: (4, 128),
    PrefillKernel.MMA_128_K32_PIPE: (5, 128),
    PrefillKernel.MMA_256_K32_PIPE: (6, 256),
    PrefillKernel.MMA_128_K32_3STAGE: (7, 128),
    PrefillKernel.MMA_W8_3STAGE: (8, 128),
    PrefillKernel.MMA_128_K32_3STAGE_FAST: (9, 128),
    PrefillKernel.MMA_128_FAST: (10, 128),
    PrefillKernel.MMA_128_K32_3STAGE_FAST_HM: (11, 128),
    PrefillKernel.MMA_64_K32_3STAGE_FAST_HM: (12, 64),
    PrefillKernel.MMA_128_K32_4STAGE_FAST_HM: (13, 128),
    PrefillKernel.MMA_128_FAST_HM: (14, 128),
    PrefillKernel.MMA_128_FAST_WM: (15, 128),
    PrefillKernel.MMA_128_FAST_HM_WM: (16, 128),
    PrefillKernel.MMA_128_FAST_WM_1B: (17, 128),
    PrefillKernel.MMA_128_FAST_WMP: (18, 128),
    PrefillKernel.MMA_128_FAST_WMP_1B: (19, 128),
}


def prefill_kernel_code(
    kernel: PrefillKernel, *, head_size: int, is_float32: bool
) -> tuple[int, int]:
    """``(variant, tile_rows)`` of the extension's prefill for `kernel`: variant 0 mma,
    1 wmma, 2 wmma lane per key, 3 mma with the pipelined gather, 4 the same with 8 warps,
    5 with 32-key tiles, 6 with 32-key tiles and 8 warps, 7 = 5 and 8 = 4 with three stages,
    9 = 7 and 10 = 3 (128 rows) with the fast softmax, 11-14 head-major ones, 15 = 10 and
    16 = 14 with per-warp masks, 17 = 15 with one barrier per tile, 18 = 15 and 19 = 17 with
    straight-line masked plain tiles (csrc/ops.cpp); the MMA kernels fall back to WMMA where
    they do not apply."""
    if kernel in _MMA_PREFILL:
        if mma_applies(head_size=head_size, is_float32=is_float32):
            return _MMA_PREFILL[kernel]
        return 1, PREFILL_TILE_ROWS
    return (1 if kernel is PrefillKernel.WMMA else 2), PREFILL_TILE_ROWS


class DecodePass(enum.Enum):
    """The two decode kernels' launch modes."""

    ONE_PASS = "one_pass"
    PARTITIONED = "partitioned"


@attrs.frozen(kw_only=True)
class DecodePolicy:
    """Which decode kernel runs, and when it splits the context into partitions.

    The partitioned pass pays a second launch and a reduction, and wins when the one pass would
    leave the GPU idle: few thread blocks, each walking a long context. So the planner
    partitions when the longest decode spans more than the one-pass limit *and* the one pass
    would launch fewer than `min_one_pass_blocks` thread blocks, or when the CLASSIC one
    pass's score buffer would not fit in shared memory. ``None`` fields take the defaults
    measured on the H200 (``docs/benchmarks/cuda_paged.md``) for the kernel that runs:

    * MMA: one pass up to 1024 tokens of span or from 512 thread blocks (``num_decodes *
      num_kv_heads``); otherwise partitions of the smallest of 512 / 1024 / 2048 tokens that
      keeps the grid at or below 256 thread blocks (else 2048); unroll 2 in one pass, 1 when
      partitioned.
    * CLASSIC: 1024-token partitions; one pass from 8192 thread blocks.

    Attributes
    ----------
    partition_size:
        Tokens per partition, a multiple of 32 (every block size divides it); None: measured.
    min_one_pass_blocks:
        Fewest thread blocks (``num_decodes * num_heads``, or ``* num_kv_heads`` when
        grouped) for which the one pass is used; None: measured.
    group_heads:
        CLASSIC: let one thread block serve all query heads of a KV head (GQA/MQA), so K/V are
        read once per group instead of once per query head (MMA always groups).
    force:
        Always use this pass (benchmarks, tests); the shared-memory limit still applies.
    kernel:
        Decode kernel family (`DecodeKernel`); MMA falls back to CLASSIC where it does not
        apply.
    unroll:
        MMA: 1 or 2 = 16-key tiles whose loads each warp issues together into registers;
        3 = a 3-stage cp.async ring per warp in shared memory (the next two tiles stream in
        while one is computed; correct on the H200 but slower than 1 / 2 at every measured
        shape, so never chosen by default); None: measured (1 or 2).
    """

    partition_size: int | None = attrs.field(default=None)
    min_one_pass_blocks: int | None = attrs.field(default=None)
    group_heads: bool = True
    force: DecodePass | None = None
    kernel: DecodeKernel = DecodeKernel.MMA
    unroll: int | None = None

    def __attrs_post_init__(self) -> None:
        if self.unroll not in (None, 1, 2, 3):
            raise ValueError(f"DecodePolicy.unroll must be 1, 2 or 3, got {self.unroll}")
        for name in ("partition_size", "min_one_pass_blocks"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"DecodePolicy.{name} must be positive, got {value}")
        if self.partition_size is not None and self.partition_size % 32:
            raise ValueError(
                f"DecodePolicy.partition_size must be a multiple of 32 (the largest block "
                f"size), got {self.partition_size}"
            )


#: Measured defaults (H200, see DecodePolicy): CLASSIC partition / one-pass threshold,
#: MMA one-pass span and thread-block thresholds, partition sizes and grid target.
_CLASSIC_PARTITION, _CLASSIC_MIN_ONE_PASS = 1024, 8192
_MMA_ONE_PASS_SPAN, _MMA_MIN_ONE_PASS = 1024, 512
_MMA_PARTITIONS, _MMA_TARGET_BLOCKS = (512, 1024, 2048), 256


def decode_smem_bytes(head_size: int, partition_size: int) -> int:
    """Dynamic shared memory of one decode thread block (csrc/params.h decode_smem_bytes)."""
    return 4 * (head_size + partition_size + (_DECODE_THREADS // 32) * head_size + 32)


def decode_grouped_smem_bytes(head_size: int, partition_size: int, group: int) -> int:
    """Dynamic shared memory of one grouped decode block (csrc/params.h, same name)."""
    return 4 * (
        group * head_size
        + group * partition_size
        + (_DECODE_THREADS // 32) * _GROUP_CHUNK_MAX * head_size
        + 2 * group
    )


def decode_mma_smem_bytes(head_size: int) -> int:
    """Dynamic shared memory of one mma decode block (csrc/params.h, same name)."""
    return 4 * (_DECODE_THREADS // 32) * _MMA_HEADS * (head_size + 2)


def capture_span_bound(max_seq_len: int, *, block_size: int, sliding_window: int | None) -> int:
    """Largest span (``seq_len - begin``, see `decode_span`) of any decode with ``seq_len`` in
    ``[1, max_seq_len]``: with a window W the span is at most ``W + block_size - 1``."""
    if sliding_window is None:
        return max_seq_len
    return min(max_seq_len, sliding_window + block_size - 1)


def decode_span(seq_len: int, *, block_size: int, sliding_window: int | None) -> tuple[int, int]:
    """``(begin, ctx_start)`` of one decode: visible keys are ``[ctx_start, seq_len)`` and the
    partitions start at ``begin``, the block boundary at or below `ctx_start`."""
    if seq_len <= 0:
        raise ValueError(f"a decode needs seq_len >= 1, got {seq_len}")
    ctx_start = 0 if sliding_window is None else max(0, seq_len - sliding_window)
    return (ctx_start // block_size) * block_size, ctx_start


def num_partitions(
    seq_len: int, *, partition_size: int, block_size: int, sliding_window: int | None
) -> int:
    """Partitions of one decode's context (never 0: the query always sees itself)."""
    begin, _ = decode_span(seq_len, block_size=block_size, sliding_window=sliding_window)
    return cdiv(seq_len - begin, partition_size)


@attrs.frozen(kw_only=True)
class DecodeLaunch:
    """How the decode kernel runs this step: kernel family, grouped or per head (CLASSIC),
    partition size, grid depth, unroll (MMA)."""

    mode: DecodePass
    partition_size: int
    max_partitions: int
    grouped: bool = False
    kernel: DecodeKernel = DecodeKernel.CLASSIC
    unroll: int = 1

    @property
    def kernel_code(self) -> int:
        """The extension's `kernel` argument: 0 classic, 1 mma."""
        return 1 if self.kernel is DecodeKernel.MMA else 0


def decode_plan(
    seq_lens: list[int],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    sliding_window: int | None,
    policy: DecodePolicy,
    smem_limit: int,
    is_float32: bool = False,
    max_span: int | None = None,
) -> DecodeLaunch:
    """Choose the decode kernel and pass for the decodes' `seq_lens` (see `DecodePolicy`).

    MMA where ``policy.kernel`` asks for it and it applies (`mma_applies`; `is_float32` is the
    query dtype's); it keeps its softmax in registers, so its one pass has no shared-memory
    bound. CLASSIC: grouped when ``policy.group_heads`` and several query heads share a KV
    head; in one pass, a single partition spans the longest context (rounded up to the block
    size) and needs that many scores per head in shared memory, within `smem_limit` bytes.

    `max_span`, when given, replaces the spans computed from `seq_lens` by an upper bound
    (CUDA-graph capture: the launch must hold for any lengths up to a maximum; the kernels
    read the actual lengths on the device and skip partitions past them).
    """
    group = num_heads // num_kv_heads
    mma = policy.kernel is DecodeKernel.MMA and mma_applies(
        head_size=head_size, is_float32=is_float32)
    kernel = DecodeKernel.MMA if mma else DecodeKernel.CLASSIC
    grouped = mma or (policy.group_heads and group > 1)
    unroll = (policy.unroll or 1) if mma else 1

    def smem(partition: int) -> int:
        if mma:
            return decode_mma_smem_bytes(head_size)
        if grouped:
            return decode_grouped_smem_bytes(head_size, partition, group)
        return decode_smem_bytes(head_size, partition)

    if not seq_lens:
        return DecodeLaunch(mode=DecodePass.ONE_PASS, partition_size=block_size,
                            max_partitions=1, grouped=grouped, kernel=kernel, unroll=unroll)
    spans = [
        s - decode_span(s, block_size=block_size, sliding_window=sliding_window)[0]
        for s in seq_lens
    ]
    if max_span is not None:
        spans = [max_span] * len(seq_lens)
    one_len = cdiv(max(spans), block_size) * block_size
    fits = smem(one_len) <= smem_limit
    per_req = num_heads
    if mma:
        per_req = num_kv_heads * cdiv(group, _MMA_HEADS)
    elif grouped:
        per_req = num_kv_heads
    blocks = len(seq_lens) * per_req
    part = policy.partition_size
    if part is None:
        part = _CLASSIC_PARTITION
        if mma:  # smallest partition keeping the grid <= the target, else the largest
            fitting = [p for p in _MMA_PARTITIONS
                       if blocks * cdiv(max(spans), p) <= _MMA_TARGET_BLOCKS]
            part = fitting[0] if fitting else _MMA_PARTITIONS[-1]
    min_blocks = policy.min_one_pass_blocks
    if min_blocks is None:
        min_blocks = _MMA_MIN_ONE_PASS if mma else _CLASSIC_MIN_ONE_PASS
    one_pass_span = part
    if mma and policy.partition_size is None:
        one_pass_span = _MMA_ONE_PASS_SPAN
    if policy.force is not None:
        partitioned = policy.force is DecodePass.PARTITIONED or not fits
    else:
        partitioned = not fits or (one_len > one_pass_span and blocks < min_blocks)
    unroll = 1
    if mma:
        unroll = policy.unroll if policy.unroll is not None else (1 if partitioned else 2)
    if not partitioned:
        return DecodeLaunch(mode=DecodePass.ONE_PASS, partition_size=one_len, max_partitions=1,
                            grouped=grouped, kernel=kernel, unroll=unroll)
    if smem(part) > smem_limit:
        raise ValueError(
            f"DecodePolicy.partition_size {part} needs {smem(part)} bytes of shared memory, "
            f"over the device's {smem_limit}; use a smaller one"
        )
    return DecodeLaunch(
        mode=DecodePass.PARTITIONED,
        partition_size=part,
        max_partitions=max(cdiv(s, part) for s in spans),
        grouped=grouped,
        kernel=kernel,
        unroll=unroll,
    )


def prefill_tiles(
    query_lens: list[int], rows: int = PREFILL_TILE_ROWS
) -> list[tuple[int, int]]:
    """``(request, first query row)`` of every prefill tile of `rows` query rows, for requests
    with > 1 new token."""
    return [
        (req, row)
        for req, q in enumerate(query_lens)
        if q > 1
        for row in range(0, q, rows)
    ]

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
    "PREFILL_TILE_ROWS",
    "DecodeLaunch",
    "DecodePass",
    "DecodePolicy",
    "decode_grouped_smem_bytes",
    "decode_plan",
    "decode_smem_bytes",
    "decode_span",
    "num_partitions",
    "prefill_tiles",
]

#: Query rows per prefill thread block (csrc/prefill.cuh kPrefillRows).
PREFILL_TILE_ROWS = 64
#: Threads per decode thread block (csrc/params.h kDecodeThreads).
_DECODE_THREADS = 128
#: Query heads a grouped decode block accumulates at once, at most (csrc/params.h).
_GROUP_CHUNK_MAX = 8


class DecodePass(enum.Enum):
    """The two decode kernels' launch modes."""

    ONE_PASS = "one_pass"
    PARTITIONED = "partitioned"


def _positive(_inst: object, attribute: attrs.Attribute[int], value: int) -> None:
    if value <= 0:
        raise ValueError(f"DecodePolicy.{attribute.name} must be positive, got {value}")


@attrs.frozen(kw_only=True)
class DecodePolicy:
    """When decode splits the context into partitions.

    The partitioned pass pays a second launch and a reduction, and wins when the one pass would
    leave the GPU idle: few thread blocks, each walking a long context. So the planner
    partitions when the longest decode spans more than one partition *and* the one pass would
    launch fewer than `min_one_pass_blocks` thread blocks, or when the one pass's score buffer
    would not fit in shared memory. The defaults come from the crossover measured on the H200
    (``docs/benchmarks/cuda_paged.md``): up to 1024 tokens the one pass won or tied at every
    batch; beyond, 1024-token partitions won at every batch measured (up to 4096 per-head and
    2048 grouped thread blocks), so the block-count condition only keeps the one pass for
    grids larger than any measured.

    Attributes
    ----------
    partition_size:
        Tokens per partition; a multiple of every block size (8, 16, 32).
    min_one_pass_blocks:
        Fewest thread blocks (``num_decodes * num_heads``, or ``* num_kv_heads`` when grouped)
        for which the one pass is used.
    group_heads:
        Let one thread block serve all query heads of a KV head (GQA/MQA), so K/V are read
        once per group instead of once per query head.
    force:
        Always use this pass (benchmarks, tests); the shared-memory limit still applies.
    """

    partition_size: int = attrs.field(default=1024, validator=_positive)
    min_one_pass_blocks: int = attrs.field(default=8192, validator=_positive)
    group_heads: bool = True
    force: DecodePass | None = None

    def __attrs_post_init__(self) -> None:
        if self.partition_size % 32:
            raise ValueError(
                f"DecodePolicy.partition_size must be a multiple of 32 (the largest block "
                f"size), got {self.partition_size}"
            )


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
    """How the decode kernel runs this step: grouped or per head, partition size, grid depth."""

    mode: DecodePass
    partition_size: int
    max_partitions: int
    grouped: bool = False


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
) -> DecodeLaunch:
    """Choose the decode kernel and pass for the decodes' `seq_lens` (see `DecodePolicy`).

    Grouped when ``policy.group_heads`` and several query heads share a KV head. In one pass, a
    single partition spans the longest context (rounded up to the block size); it needs that
    many scores per head in shared memory, within `smem_limit` bytes.
    """
    group = num_heads // num_kv_heads
    grouped = policy.group_heads and group > 1

    def smem(partition: int) -> int:
        if grouped:
            return decode_grouped_smem_bytes(head_size, partition, group)
        return decode_smem_bytes(head_size, partition)

    if not seq_lens:
        return DecodeLaunch(mode=DecodePass.ONE_PASS, partition_size=block_size,
                            max_partitions=1, grouped=grouped)
    spans = [
        s - decode_span(s, block_size=block_size, sliding_window=sliding_window)[0]
        for s in seq_lens
    ]
    one_len = cdiv(max(spans), block_size) * block_size
    fits = smem(one_len) <= smem_limit
    part = policy.partition_size
    if policy.force is not None:
        partitioned = policy.force is DecodePass.PARTITIONED or not fits
    else:
        blocks = len(seq_lens) * (num_kv_heads if grouped else num_heads)
        partitioned = not fits or (one_len > part and blocks < policy.min_one_pass_blocks)
    if not partitioned:
        return DecodeLaunch(mode=DecodePass.ONE_PASS, partition_size=one_len, max_partitions=1,
                            grouped=grouped)
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
    )


def prefill_tiles(query_lens: list[int]) -> list[tuple[int, int]]:
    """``(request, first query row)`` of every prefill tile, for requests with > 1 new token."""
    return [
        (req, row)
        for req, q in enumerate(query_lens)
        if q > 1
        for row in range(0, q, PREFILL_TILE_ROWS)
    ]

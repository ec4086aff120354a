"""Named batch specs and the case list derived from what a backend declares.

Pure bookkeeping (no torch): which batches, shapes, dtypes and features to run.
"""

from __future__ import annotations

import zlib
from typing import TypeVar

import attrs

from pagedcore.attention.backend import AttentionBackend, MultipleOf
from pagedcore.attention.kv_quant import FP8_UNIT_ROUNDOFF

__all__ = [
    "ANY_HEAD_SIZES",
    "BATCHES",
    "GQA_RATIOS",
    "SATURATING_FP8_SCALES",
    "SHARED_PREFIX_BATCHES",
    "SMALL_ANY_HEAD_SIZES",
    "TOLERANCES",
    "BatchSpec",
    "CaseSpec",
    "build_cases",
]

_T = TypeVar("_T")

#: Max relative error allowed per model dtype: ``max|out - ref| / max|ref|`` over the real
#: output rows, against the reference run in float32 on the same (already rounded) inputs.
#: float32 leaves room for reassociated accumulation but not for TF32 matmuls (a kernel that
#: claims float32 should compute in IEEE float32); float16/bfloat16 allow for the probabilities
#: being rounded to the model dtype before the P·V product. Any indexing or masking bug costs
#: O(1) relative error, far above all three.
TOLERANCES: dict[str, float] = {"float32": 1e-3, "float16": 5e-3, "bfloat16": 2e-2}

#: Extra relative error an fp8 case allows, as a fraction of the fp8 dtype's unit roundoff
#: ``u`` (e4m3: 2**-4, e5m2: 2**-3). The reference quantizes the same inputs with the same
#: scales, so a conforming backend stores the same fp8 bits; what remains is a single-step
#: rounding difference where a kernel divides in a different precision, which moves one
#: element by at most ``2u`` and the output (a weighted mean over keys) by far less. A backend
#: that ignores a scale is off by the scale itself (O(1) or more), far above ``u / 4``.
FP8_TOLERANCE_FRACTION = 0.25

#: Query heads per KV head that every backend is tried with (Hq = ratio * 2 KV heads).
GQA_RATIOS = (1, 4, 7, 8)

#: Head sizes tried when a backend declares ``supported_head_sizes = None`` (any). 16 and 32
#: (the built-in random models use 16) catch a kernel wrong only below 32; they are cheap
#: variants (less work than the base 128) and run in quick mode too.
ANY_HEAD_SIZES = (16, 32, 64, 80, 128, 256)
#: The small sizes of `ANY_HEAD_SIZES` that quick mode keeps as well.
SMALL_ANY_HEAD_SIZES = (16, 32)


@attrs.frozen
class BatchSpec:
    """One step's requests as ``(context_len, query_len)`` pairs, plus padding tokens.

    ``context_len`` tokens are already in the cache (written before the step); ``query_len``
    are new this step. ``pad`` tokens with slot ``-1`` follow the real ones.
    """

    name: str
    requests: tuple[tuple[int, int], ...]
    pad: int
    doc: str
    stretch: bool = True
    #: Context positions whose keys every query scores far above the rest ("needles", see
    #: `pagedcore.conformance.harness.make_batch`), in every request whose context holds them;
    #: a negative position counts from the end of the context (-1: its last position).
    needles: tuple[int, ...] = ()
    #: Leading context tokens every request shares (same K/V; the same physical blocks for
    #: the full blocks among them, a copy for a last partial block), for cascade attention.
    shared_prefix: int = 0

    def _factor(self, block_size: int) -> int:
        return max(1, block_size // 16) if self.stretch else 1

    def scaled(self, block_size: int) -> tuple[tuple[int, int], ...]:
        """Contexts stretched with the block size (when `stretch`), so large blocks still
        span several."""
        factor = self._factor(block_size)
        return tuple((c * factor, q) for c, q in self.requests)

    def scaled_shared_prefix(self, block_size: int) -> int:
        """`shared_prefix` stretched like the contexts."""
        return self.shared_prefix * self._factor(block_size)


#: The batches of quick mode (the others run only in the full suite).
QUICK_BATCHES = ("decode", "prefill", "mixed", "chunked_prefill")

BATCHES: dict[str, BatchSpec] = {
    b.name: b
    for b in (
        BatchSpec(
            "decode",
            ((16, 1), (5, 1), (33, 1), (1, 1), (47, 1), (0, 1)),
            2,
            "decode-only: seq_lens one past a block, mid-block, exactly full blocks, 1",
        ),
        BatchSpec("prefill", ((0, 16), (0, 7), (0, 37)), 3, "prefill-only, empty cache"),
        BatchSpec("mixed", ((20, 1), (8, 1), (0, 13), (0, 30)), 2, "decodes then prefills"),
        BatchSpec(
            "chunked_prefill",
            ((31, 1), (32, 16), (10, 21), (45, 3)),
            1,
            "prefill chunks continuing a cached prefix (block-aligned and not)",
        ),
        BatchSpec(
            "long",
            ((1531, 1), (700, 1), (2100, 1), (64, 1), (900, 37)),
            1,
            "long contexts (split-KV decode paths), a chunk continuing a long prefix",
            stretch=False,
        ),
        BatchSpec(
            "needles",
            ((1531, 1), (700, 1), (2100, 1), (64, 1), (900, 37)),
            1,
            "the long batch with needle keys on block, tile and split edges, so that reading "
            "one wrong position fails in 16-bit tolerances too",
            stretch=False,
            needles=(0, 15, 16, 31, 32, 63, 64, 127, 128, 255, 256, 511, 512, 1023, 1024, 2047,
                     -2, -1),
        ),
        BatchSpec(
            "long_prefill",
            ((0, 100), (40, 90), (0, 130)),
            2,
            "prefill chunks past 64- and 128-row query tiles, with and without a context",
        ),
        BatchSpec(
            "very_long",
            ((5000, 1), (300, 1), (4200, 20)),
            1,
            "contexts past 4,096 keys (split-KV partition caps), a chunk continuing one",
            stretch=False,
        ),
        BatchSpec(
            "wide",
            (*((5 + 7 * i, 1) for i in range(12)), (9, 5)),
            2,
            "12 decodes and a chunk: more than 8 requests (launch and split thresholds)",
        ),
        BatchSpec(
            "shared_decode",
            ((40, 1), (45, 1), (37, 1), (64, 1), (36, 1)),
            2,
            "decodes sharing a 35-token prefix (cascade: 2 full shared blocks of 16, the "
            "prefix ending mid-block)",
            shared_prefix=35,
        ),
        BatchSpec(
            "shared_mixed",
            ((40, 1), (50, 1), (36, 12), (48, 5)),
            1,
            "decodes and prefill chunks continuing one shared 36-token prefix (cascade in a "
            "mixed step)",
            shared_prefix=36,
        ),
    )
}

#: Batches run only for backends that declare ``supports_cascade``.
SHARED_PREFIX_BATCHES = ("shared_decode", "shared_mixed")


@attrs.frozen(kw_only=True)
class CaseSpec:
    """One conformance case: a batch, shapes, a dtype and the features switched on.

    Attributes
    ----------
    optional:
        A combination of individually declared features; if `validate_configuration`
        rejects it the case is skipped rather than failed.
    large_offsets:
        Use a block count whose flat element offsets overflow int32 (CUDA only).
    use_output_buffer:
        Pass a preallocated ``output=`` buffer to `forward` and read the result from it.
    repeat_forward:
        Call `forward` twice on the same metadata (as for two layers) and check both.
    skip:
        Why the case cannot run here (None when it can).
    """

    name: str
    batch: str
    dtype: str
    head_size: int
    block_size: int
    num_heads: int
    num_kv_heads: int
    sliding_window: int | None = None
    alibi: bool = False
    logits_soft_cap: float | None = None
    large_offsets: bool = False
    use_output_buffer: bool = False
    repeat_forward: bool = False
    optional: bool = False
    skip: str | None = None
    kv_cache_dtype: str = "auto"
    sinks: bool = False
    #: Steps on one impl, one builder and one cache: the batch, then `steps` - 1 decode steps
    #: of every request (as an engine runs them: a plan or a cache copy kept from an earlier
    #: step shows).
    steps: int = 1
    #: fp8: build the impl with scales 1.0 and set the real ones with `set_kv_scales` before
    #: the first write (as the engine does when it calibrates on the first prefill).
    late_scales: bool = False
    #: fp8: these ``(k_scale, v_scale)`` instead of the suite's
    #: (`pagedcore.conformance.harness.FP8_SCALES`); small ones make the cache write saturate.
    fp8_scales: tuple[float, float] | None = None

    @property
    def seed(self) -> int:
        """A stable per-case seed, so a failure reproduces."""
        return zlib.crc32(self.name.encode())

    @property
    def tolerance(self) -> float:
        tol = TOLERANCES[self.dtype]
        if self.kv_cache_dtype != "auto":
            tol += FP8_TOLERANCE_FRACTION * FP8_UNIT_ROUNDOFF[self.kv_cache_dtype]
        return tol


#: Small scales of the saturating fp8 cases: the suite's N(0, 1) inputs then reach ~1,000
#: scales, past e4m3's 448 (and a cache write that does not saturate stores NaN or inf).
SATURATING_FP8_SCALES = (0.004, 0.005)


def _block_sizes(backend: type[AttentionBackend]) -> list[int]:
    """Declared ints, and for ``MultipleOf(n)``: n, 2n, 3n, and 16, 32 and 64 where n divides
    them (tiles of 16 tokens that read only part of a larger block show there)."""
    sizes: list[int] = []
    for decl in backend.supported_block_sizes:
        if isinstance(decl, MultipleOf):
            base = decl.base
            candidates = [base * k for k in (1, 2, 3)]
            candidates += [b for b in (16, 32, 64) if b % base == 0]
            sizes.extend(candidates)
        else:
            sizes.append(decl)
    return sorted(set(sizes))


def _head_sizes(backend: type[AttentionBackend]) -> list[int]:
    declared = backend.supported_head_sizes
    return list(ANY_HEAD_SIZES if declared is None else declared)


def _prefer(options: list[_T], preferred: tuple[_T, ...]) -> _T:
    """The first of `preferred` among `options`, else the first option."""
    for p in preferred:
        if p in options:
            return p
    return options[0]


def _base_dtype(backend: type[AttentionBackend], device: str) -> str:
    """The dtype most cases run in: float16 first on CUDA, float32 first on the CPU."""
    if device == "cuda":
        preferred = ("float16", "bfloat16", "float32")
    else:
        preferred = ("float32", "float16", "bfloat16")
    return _prefer(list(backend.supported_dtypes), preferred)


def _suffix(case: dict[str, object]) -> str:
    parts = []
    if case.get("sliding_window") is not None:
        parts.append(f"window{case['sliding_window']}")
    if case.get("alibi"):
        parts.append("alibi")
    if case.get("logits_soft_cap") is not None:
        parts.append(f"softcap{case['logits_soft_cap']:g}")
    if case.get("sinks"):
        parts.append("sinks")
    if case.get("kv_cache_dtype", "auto") != "auto":
        parts.append(str(case["kv_cache_dtype"]))
    if case.get("late_scales"):
        parts.append("late_scales")
    if case.get("fp8_scales") is not None:
        parts.append("saturating")
    if case.get("large_offsets"):
        parts.append("int32_overflow")
    if int(case.get("steps", 1)) > 1:  # type: ignore[call-overload]
        parts.append(f"steps{case['steps']}")
    return "".join("/" + p for p in parts)


def build_cases(
    backend: type[AttentionBackend], *, quick: bool = False, device: str = "cpu"
) -> list[CaseSpec]:
    """Every case the backend's declarations call for (fewer, one per axis, when `quick`).

    The cases form a star around a base configuration (preferred dtype, head size 128 or the
    nearest declared, block size 16 or the nearest declared, GQA ratio 4): each axis (batch,
    dtype, head size, block size, GQA ratio, each declared feature) is varied on its own, then
    all declared features together.
    """
    if backend.mla_only:
        return []  # MLA layers have their own cases (pagedcore.conformance.mla).
    dtypes = list(backend.supported_dtypes)
    head_sizes = _head_sizes(backend)
    block_sizes = _block_sizes(backend)
    base_dtype = _base_dtype(backend, device)
    base_head = _prefer(head_sizes, (128, 64, 256, 96, 80))
    base_block = _prefer(block_sizes, (16, 32, 8, 64))
    base: dict[str, object] = {
        "batch": "mixed",
        "dtype": base_dtype,
        "head_size": base_head,
        "block_size": base_block,
        "num_heads": 8,
        "num_kv_heads": 2,
    }
    variants: list[dict[str, object]] = []
    # Decode and chunked-prefill steps write into a preallocated ``output=`` buffer; the
    # chunked-prefill step also reuses its metadata for a second forward (a second layer).
    variants += [
        {
            "batch": b,
            "use_output_buffer": b in ("decode", "chunked_prefill"),
            "repeat_forward": b == "chunked_prefill",
        }
        for b in BATCHES
        if (b in QUICK_BATCHES or not quick) and b not in SHARED_PREFIX_BATCHES
    ]
    # One impl, builder and cache over three steps (a plan or cache state kept between steps).
    variants.append({"batch": "mixed", "steps": 3, "use_output_buffer": True})
    if backend.supports_cascade:
        # Cascade attention: shared physical prefix blocks, the plan reused by two layers.
        variants.append({"batch": "shared_decode", "use_output_buffer": True})
        variants.append({"batch": "shared_mixed", "repeat_forward": True})
        if not quick:
            variants.append({"batch": "shared_decode", "steps": 3})
    other_dtypes = [d for d in dtypes if d != base_dtype]
    variants += [{"dtype": d} for d in other_dtypes]
    # The ``output=`` buffer in every dtype (a 16-bit path that returns a new tensor instead).
    variants += [{"batch": "decode", "dtype": d, "use_output_buffer": True} for d in other_dtypes]
    other_heads = [h for h in head_sizes if h != base_head]
    other_blocks = [b for b in block_sizes if b != base_block]
    ratios = [r for r in GQA_RATIOS if r != 4]
    if quick:
        small = (
            [h for h in other_heads if h in SMALL_ANY_HEAD_SIZES]
            if backend.supported_head_sizes is None else []
        )
        rest = [h for h in other_heads if h not in small]
        other_heads = small + sorted(rest, key=lambda h: (h % 64 == 0, h < 64, h))[:1]
        other_blocks = other_blocks[:1]
        ratios = [1, 7]
    variants += [{"head_size": h} for h in other_heads]
    variants += [{"block_size": b} for b in other_blocks]
    variants += [{"num_heads": 2 * r} for r in ratios]
    if not quick:
        variants.append({"num_heads": 8, "num_kv_heads": 1})  # MQA
        variants.append({"num_heads": 16, "num_kv_heads": 8})  # more KV heads than 2
    combo: dict[str, object] = {}
    if backend.supports_sliding_window:
        variants.append({"sliding_window": 8})
        if not quick:
            variants.append({"batch": "chunked_prefill", "sliding_window": 19})
            variants.append({"batch": "decode", "sliding_window": 13})
        combo["sliding_window"] = 11
    if backend.supports_alibi:
        variants.append({"alibi": True})
        combo["alibi"] = True
        if backend.supports_cascade:
            variants.append({"batch": "shared_mixed", "alibi": True})
    if backend.supports_logits_soft_cap:
        variants.append({"logits_soft_cap": 1.0})
        combo["logits_soft_cap"] = 2.0
        if backend.supports_cascade:
            variants.append({"batch": "shared_decode", "logits_soft_cap": 1.0})
    if backend.supports_sink:
        variants.append({"sinks": True})
        variants.append({"batch": "decode", "sinks": True, "use_output_buffer": True})
        if backend.supports_sliding_window:
            variants.append({"sinks": True, "sliding_window": 8})
        if not quick:
            variants.append({"batch": "chunked_prefill", "sinks": True})
            if backend.supports_cascade:  # the sink joins the merged state once
                variants.append({"batch": "shared_decode", "sinks": True,
                                 "use_output_buffer": True})
        combo["sinks"] = True
    fp8 = [k for k in backend.supported_kv_cache_dtypes if k != "auto"]
    for kv in fp8:
        variants += [
            {"batch": b, "kv_cache_dtype": kv} for b in BATCHES
            if (b in QUICK_BATCHES or not quick) and b not in SHARED_PREFIX_BATCHES
        ]
    variants += [{"dtype": dt, "kv_cache_dtype": fp8[0]} for dt in other_dtypes[:1] if fp8]
    if fp8:
        # Scales set after construction (calibration), and scales small enough to saturate.
        variants.append({"batch": "chunked_prefill", "kv_cache_dtype": fp8[0],
                         "late_scales": True})
        variants.append({"kv_cache_dtype": fp8[0], "fp8_scales": SATURATING_FP8_SCALES})
        if backend.supports_cascade and not quick:  # the shared prefix dequantized too
            variants += [{"batch": b, "kv_cache_dtype": fp8[0]} for b in SHARED_PREFIX_BATCHES]
    if fp8 and backend.supports_sink and not quick:
        variants.append({"batch": "long", "kv_cache_dtype": fp8[0], "sinks": True})
    if fp8 and backend.supports_sink:
        variants.append({"batch": "chunked_prefill", "kv_cache_dtype": fp8[0], "sinks": True,
                         "sliding_window": 8 if backend.supports_sliding_window else None})
    if len(combo) > 1 and not quick:
        variants.append(
            {"batch": "chunked_prefill", "num_heads": 14, "optional": True, **combo}
        )
    if not quick:
        skip = None if device == "cuda" else "int32 offset overflow is checked on CUDA only"
        variants.append({"batch": "chunked_prefill", "large_offsets": True, "skip": skip})

    cases: list[CaseSpec] = []
    seen: set[str] = set()
    for v in variants:
        spec = {**base, **v}
        name = (
            f"{spec['batch']}/{spec['dtype']}/hs{spec['head_size']}/bs{spec['block_size']}/"
            f"h{spec['num_heads']}kv{spec['num_kv_heads']}{_suffix(spec)}"
        )
        if spec.get("use_output_buffer"):
            name += "/out_buffer"
        if spec.get("repeat_forward"):
            name += "/plan_reused"
        if name in seen:
            continue
        seen.add(name)
        cases.append(CaseSpec(name=name, **spec))  # type: ignore[arg-type]
    return cases

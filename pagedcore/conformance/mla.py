"""MLA conformance: named latent-cache batch specs run for every backend that declares MLA,
checked against the reference MLA (`pagedcore.reference.mla`).

Each case builds a paged latent cache ``[num_blocks, block_size, L + R]`` whose physical blocks
are a random permutation (block 0, the null block, never used), fills every slot of a referenced
block that holds no token with NaN, writes history rows directly and this step's rows through
the backend's own ``do_kv_cache_update`` (with ``-1`` padding tokens at the end of the batch),
and compares ``forward`` with the reference on the real tokens (relative error).

A spec with `MLABatchSpec.needles` also plants "needle" rows: cache positions whose key every
query of the batch scores about 5 (natural-log units) above a typical row (through the rope
dims), so that each needle, whose value stays its own random latent, carries a large share of
the softmax. A kernel that skips, repeats or misplaces one of those
positions (a tile or split boundary, a block edge) then misses by far more than the 16-bit
tolerances, which a single dropped position among hundreds of random rows does not.

FP8 latent caches (for backends that declare ``"fp8_e4m3"`` / ``"fp8_e5m2"`` in
``supported_kv_cache_dtypes``): the history rows are stored as ``quantize_fp8(row, k_scale)``
with one per-case scale (``max|row| / fp8 max`` over the case's rows, so needles do not
saturate), this step's rows through the backend's own write, and the reference reads the
same fp8 cache (dequantized in float32), so a conforming backend stores the same bits and
reads what the reference reads. The tolerance adds ``FP8_TOLERANCE_FRACTION * u`` (the fp8
dtype's unit roundoff) to the model dtype's, as for the non-MLA fp8 cases.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs
import torch

from pagedcore.attention.kv_quant import (
    FP8_UNIT_ROUNDOFF,
    calibrated_scale,
    kv_cache_torch_dtype,
    quantize_fp8,
)
from pagedcore.attention.metadata import CommonAttentionMetadata
from pagedcore.conformance.cases import FP8_TOLERANCE_FRACTION
from pagedcore.kv_cache.spec import MLAAttentionSpec, cdiv

if TYPE_CHECKING:
    from pagedcore.attention.backend import AttentionBackend

__all__ = [
    "MLA_LARGE_SPEC",
    "MLA_SPECS",
    "MLABatchSpec",
    "MLACase",
    "MLAResult",
    "build_mla_case",
    "run_mla_case",
    "run_mla_suite",
]

#: Largest relative error accepted per model dtype.
TOLERANCE = {"float32": 2e-4, "float16": 1e-2, "bfloat16": 3e-2}

#: Specs run with an fp8 cache (per declared fp8 dtype), as ``(spec, model dtype)``: decode,
#: mixed with padding, chunked over a prefix, long split-KV decodes and the needles.
FP8_SPEC_NAMES = ("decode", "mixed", "chunked_prefix", "decode_long", "needles")


def mla_tolerance(dtype: str, kv_cache_dtype: str = "auto") -> float:
    """The accepted relative error of an MLA case: `TOLERANCE` of the model dtype, plus
    ``FP8_TOLERANCE_FRACTION`` of the fp8 dtype's unit roundoff for an fp8 cache."""
    tol = TOLERANCE[dtype]
    if kv_cache_dtype != "auto":
        tol += FP8_TOLERANCE_FRACTION * FP8_UNIT_ROUNDOFF[kv_cache_dtype]
    return tol


@attrs.frozen(kw_only=True)
class MLABatchSpec:
    """One named MLA batch: per-request (new tokens, total tokens) in decode-first order."""

    name: str
    query_lens: tuple[int, ...]
    seq_lens: tuple[int, ...]
    block_size: int = 16
    num_heads: int = 4
    kv_lora_rank: int = 64
    rope_head_dim: int = 16
    num_pad_tokens: int = 0
    extra_blocks: int = 5
    #: At least this many blocks in the cache (to push offsets past 32 bits); 0 = just enough.
    min_num_blocks: int = 0
    #: History positions that hold a needle row (see the module docstring), in every request
    #: whose history covers them.
    needles: tuple[int, ...] = ()

    def __attrs_post_init__(self) -> None:
        if len(self.query_lens) != len(self.seq_lens):
            raise ValueError(f"{self.name}: query_lens and seq_lens differ in length")
        for q, s in zip(self.query_lens, self.seq_lens, strict=True):
            if not 0 < q <= s:
                raise ValueError(f"{self.name}: need 0 < query_len <= seq_len, got {q}, {s}")


MLA_SPECS: tuple[MLABatchSpec, ...] = (
    MLABatchSpec(name="decode", query_lens=(1, 1, 1), seq_lens=(1, 17, 40)),
    MLABatchSpec(name="prefill", query_lens=(5, 33), seq_lens=(5, 33)),
    MLABatchSpec(name="mixed", query_lens=(1, 1, 7, 20), seq_lens=(9, 30, 7, 20),
                 num_pad_tokens=3),
    MLABatchSpec(name="chunked_prefix", query_lens=(1, 6, 13), seq_lens=(25, 38, 29),
                 block_size=8),
    MLABatchSpec(name="decode_long", query_lens=(1, 1), seq_lens=(300, 129), block_size=16,
                 num_heads=16),
    MLABatchSpec(name="block1_odd_dims", query_lens=(1, 4), seq_lens=(6, 9), block_size=1,
                 kv_lora_rank=48, rope_head_dim=8, num_heads=3),
    # Needles on block, tile and split edges (16-, 32-, 64-row tiles; 128-position splits).
    MLABatchSpec(name="needles", query_lens=(1, 1, 4), seq_lens=(300, 129, 40), block_size=16,
                 num_heads=16, needles=(0, 15, 16, 31, 32, 63, 64, 127, 128, 255, 256, 298)),
)

#: DeepSeek-V2-Lite shapes over a cache whose element offsets pass 2**31 (GPU only: ~4 GiB in
#: 16-bit dtypes); physical blocks are spread over the whole range.
MLA_LARGE_SPEC = MLABatchSpec(
    name="int32_overflow", query_lens=(1, 1, 5), seq_lens=(700, 64, 90), block_size=16,
    num_heads=16, kv_lora_rank=512, rope_head_dim=64,
    min_num_blocks=2**31 // (16 * 576) + 4096,
)


@attrs.frozen(kw_only=True)
class MLACase:
    """A built batch: cache, inputs and the step's metadata (all on one device)."""

    spec: MLABatchSpec
    kv_cache: torch.Tensor  # [N, B, L + R], NaN in unused slots of referenced blocks
    query: torch.Tensor  # [T, H, L + R], T includes padding tokens
    key: torch.Tensor  # [T, 1, L + R]
    common: CommonAttentionMetadata
    scale: float
    #: ``"auto"`` or the fp8 name the cache is stored in (then `kv_cache` holds fp8 rows).
    kv_cache_dtype: str = "auto"
    #: The fp8 cache's dequantization scale (1.0 for ``"auto"``).
    k_scale: float = 1.0


def build_mla_case(
    spec: MLABatchSpec, *, dtype: torch.dtype, device: str | torch.device = "cpu", seed: int = 0,
    kv_cache_dtype: str = "auto",
) -> MLACase:
    """Build `spec`'s batch: permuted blocks, NaN-poisoned free slots, history rows written
    (as ``quantize_fp8(row, k_scale)`` for an fp8 `kv_cache_dtype`)."""
    gen = torch.Generator().manual_seed(seed)
    dev = torch.device(device)
    bs, dim = spec.block_size, spec.kv_lora_rank + spec.rope_head_dim
    blocks_per_req = [cdiv(s, bs) for s in spec.seq_lens]
    num_blocks = max(1 + sum(blocks_per_req) + spec.extra_blocks, spec.min_num_blocks)
    physical = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    max_blocks = max(blocks_per_req)
    table = torch.zeros(len(spec.seq_lens), max_blocks, dtype=torch.int32)
    # Every slot starts as NaN; only history rows of referenced blocks get data.
    cache = torch.full((num_blocks, bs, dim), float("nan"), dtype=dtype, device=dev)
    used = 0
    for r, n in enumerate(blocks_per_req):
        ids = physical[used : used + n]
        used += n
        table[r, :n] = torch.tensor(ids, dtype=torch.int32)
        history = spec.seq_lens[r] - spec.query_lens[r]
        data = torch.full((n * bs, dim), float("nan"))
        data[:history] = torch.randn(history, dim, generator=gen)
        cache[torch.tensor(ids, device=dev)] = data.view(n, bs, dim).to(dev, dtype)
    num_real = sum(spec.query_lens)
    num_tokens = num_real + spec.num_pad_tokens
    query = torch.randn(num_tokens, spec.num_heads, dim, generator=gen)
    key = torch.randn(num_tokens, 1, dim, generator=gen)
    if spec.needles:
        _plant_needles(spec, cache, table, query, gen)
    k_scale = 1.0
    if kv_cache_dtype != "auto":
        real = cache[~cache.isnan().any(-1)]
        k_scale = calibrated_scale(torch.cat([real.float().cpu(), key[:, 0]]), kv_cache_dtype)
        cache = quantize_fp8(cache, k_scale, kv_cache_torch_dtype(kv_cache_dtype, dtype))
    slots: list[int] = []
    positions: list[int] = []
    for r, (q, s) in enumerate(zip(spec.query_lens, spec.seq_lens, strict=True)):
        for pos in range(s - q, s):
            slots.append(int(table[r, pos // bs]) * bs + pos % bs)
            positions.append(pos)
    slots += [-1] * spec.num_pad_tokens
    positions += [0] * spec.num_pad_tokens
    qsl = torch.tensor([0, *torch.tensor(spec.query_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor(spec.seq_lens, dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=qsl.to(dev),
        query_start_loc_cpu=qsl,
        seq_lens=seq_lens.to(dev),
        seq_lens_cpu=seq_lens,
        num_reqs=len(spec.seq_lens),
        num_actual_tokens=num_real,
        max_query_len=max(spec.query_lens),
        max_seq_len=max(spec.seq_lens),
        block_table=table.to(dev),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
        positions=torch.tensor(positions, dtype=torch.int64, device=dev),
    )
    return MLACase(
        spec=spec,
        kv_cache=cache,
        query=query.to(dev, dtype),
        key=key.to(dev, dtype),
        common=common,
        scale=dim**-0.5,
        kv_cache_dtype=kv_cache_dtype,
        k_scale=k_scale,
    )


#: How far (natural-log units, after the softmax scale) a needle's score stands above a
#: typical row's.
NEEDLE_LIFT = 5.0


def _plant_needles(spec: MLABatchSpec, cache: torch.Tensor, table: torch.Tensor,
                   query: torch.Tensor, gen: torch.Generator) -> None:
    """Make `spec.needles` of every request's history needles: their rope part becomes
    ``sqrt(dim) * u`` (``u`` a random unit vector of the rope dims) and every query row gets
    ``NEEDLE_LIFT * u`` added in place, so that with the ``dim ** -0.5`` scale each needle
    scores ``NEEDLE_LIFT`` plus noise above a typical row. Their latent parts (the values)
    stay random and distinct, so the output depends on each needle by itself."""
    lat, dim = spec.kv_lora_rank, spec.kv_lora_rank + spec.rope_head_dim
    u = torch.randn(spec.rope_head_dim, generator=gen)
    u = u / u.norm()
    query[..., lat:] += NEEDLE_LIFT * u
    rope = (dim**0.5 * u).to(cache.device, cache.dtype)
    for r, (q, s) in enumerate(zip(spec.query_lens, spec.seq_lens, strict=True)):
        for pos in spec.needles:
            if pos < s - q:
                cache[int(table[r, pos // spec.block_size]), pos % spec.block_size, lat:] = rope


@attrs.frozen(kw_only=True)
class MLAResult:
    """One case's outcome: the relative error, or the error raised."""

    backend: str
    spec: str
    dtype: str
    block_size: int
    rel_err: float | None
    passed: bool
    detail: str = ""
    kv_cache_dtype: str = "auto"
    tolerance: float | None = None


def _run(backend: type[AttentionBackend], case: MLACase, device: torch.device) -> torch.Tensor:
    spec = case.spec
    kv_spec = MLAAttentionSpec(
        block_size=spec.block_size,
        kv_lora_rank=spec.kv_lora_rank,
        rope_head_dim=spec.rope_head_dim,
        dtype=case.query.dtype,
    )
    builder = backend.get_builder_cls()(kv_spec, ["model.layers.0.self_attn"], device)
    metadata = builder.build(case.common)
    impl_cls: Any = backend.get_impl_cls()
    fp8: dict[str, Any] = {}
    if case.kv_cache_dtype != "auto":
        fp8 = {"kv_cache_dtype": case.kv_cache_dtype, "k_scale": case.k_scale,
               "v_scale": case.k_scale}
    impl = impl_cls(
        spec.num_heads, kv_spec.head_size, case.scale, kv_lora_rank=spec.kv_lora_rank, **fp8
    )
    cache = case.kv_cache.clone()
    impl.do_kv_cache_update(case.key, case.key, cache, case.common.slot_mapping)
    out: torch.Tensor = impl.forward(case.query, case.key, case.key, cache, metadata)
    return out[: case.common.num_actual_tokens]


def run_mla_case(
    backend: type[AttentionBackend], case: MLACase, *, device: str | torch.device = "cpu"
) -> MLAResult:
    """Run `backend` on `case` and compare with the reference MLA (float32 oracle)."""
    from pagedcore.reference.mla import ReferenceMLABackend

    dev = torch.device(device)
    dtype_name = str(case.query.dtype).removeprefix("torch.")
    spec = case.spec
    lat = spec.kv_lora_rank
    tol = mla_tolerance(dtype_name, case.kv_cache_dtype)
    common: dict[str, Any] = {"backend": backend.name, "spec": spec.name, "dtype": dtype_name,
                              "block_size": spec.block_size,
                              "kv_cache_dtype": case.kv_cache_dtype, "tolerance": tol}
    try:
        expected = _run(ReferenceMLABackend, _as_float32(case), dev)
        got = _run(backend, case, dev)
    except Exception as exc:  # a claim that fails is a failure, not a skip
        return MLAResult(**common, rel_err=None, passed=False,
                         detail=f"{type(exc).__name__}: {exc}")
    want = (case.common.num_actual_tokens, spec.num_heads, lat)
    if tuple(got.shape) != want:
        return MLAResult(**common, rel_err=None, passed=False,
                         detail=f"output shape {tuple(got.shape)}, expected {want}")
    diff = (got.float() - expected.float()).norm()
    rel = float(diff / expected.float().norm().clamp_min(1e-12))
    ok = rel == rel and rel <= tol  # NaN never passes
    return MLAResult(**common, rel_err=rel, passed=ok,
                     detail="" if ok else f"relative error {rel:.3g} > {tol:.3g}")


def _as_float32(case: MLACase) -> MLACase:
    """The oracle's inputs: queries and keys in float32; an fp8 cache stays as it is (the
    reference dequantizes the same bits the backend reads)."""
    cache = case.kv_cache if case.kv_cache_dtype != "auto" else case.kv_cache.float()
    return attrs.evolve(case, kv_cache=cache, query=case.query.float(), key=case.key.float())


def run_mla_suite(
    backend: type[AttentionBackend],
    *,
    device: str | torch.device = "cpu",
    dtypes: Sequence[str] | None = None,
    specs: Sequence[MLABatchSpec] = MLA_SPECS,
    quick: bool = False,
) -> list[MLAResult]:
    """Every MLA spec, in every dtype the backend claims (float32 only on CPU; one dtype when
    `quick`); on CUDA, unless `quick`, also `MLA_LARGE_SPEC` (offsets past 32 bits). The
    specs of `FP8_SPEC_NAMES` also run once per fp8 cache dtype the backend declares (the
    first only when `quick`), in the last model dtype tried.

    Returns an empty list for a backend that does not declare ``supports_mla``.
    """
    if not backend.supports_mla:
        return []
    dev = torch.device(device)
    names = list(dtypes) if dtypes is not None else list(backend.supported_dtypes)
    if dev.type == "cpu":
        names = [n for n in names if n == "float32"] or names[:1]
    if quick:
        names = names[:1]
    results: list[MLAResult] = []
    if dev.type == "cuda" and not quick and specs is MLA_SPECS:
        specs = (*specs, MLA_LARGE_SPEC)
    fp8 = [k for k in backend.supported_kv_cache_dtypes if k != "auto"]
    for spec in specs:
        if not backend.supports_block_size(spec.block_size):
            spec = attrs.evolve(spec, block_size=_claimed_block_size(backend))
        spec = _at_claimed_dims(backend, spec)
        for name in names:
            case = build_mla_case(spec, dtype=getattr(torch, name), device=dev)
            results.append(run_mla_case(backend, case, device=dev))
        if spec.name.split("/")[0] not in FP8_SPEC_NAMES:
            continue
        for kv in fp8[:1] if quick else fp8:
            case = build_mla_case(spec, dtype=getattr(torch, names[-1]), device=dev,
                                  kv_cache_dtype=kv)
            results.append(run_mla_case(backend, case, device=dev))
    return results


def _at_claimed_dims(backend: type[AttentionBackend], spec: MLABatchSpec) -> MLABatchSpec:
    """`spec` at latent widths the backend declares (`supported_mla_dims`): unchanged when it
    declares any or these; else at the declared pair nearest in size, named ``NAME/L{L}R{R}``."""
    dims = backend.supported_mla_dims
    here = (spec.kv_lora_rank, spec.rope_head_dim)
    if dims is None or here in dims:
        return spec
    lat, rope = min(dims, key=lambda d: (abs(d[0] - here[0]) + abs(d[1] - here[1]), d))
    return attrs.evolve(spec, name=f"{spec.name}/L{lat}R{rope}", kv_lora_rank=lat,
                        rope_head_dim=rope)


def _claimed_block_size(backend: type[AttentionBackend]) -> int:
    for size in (16, 32, 64, 8, 128, 256, 1):
        if backend.supports_block_size(size):
            return size
    raise ValueError(f"{backend.name} declares no usable block size")


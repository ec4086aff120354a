"""The three roles of an attention backend: descriptor, metadata builder, per-layer impl.

A backend is a static descriptor class (`AttentionBackend`, never instantiated) that names a
`MetadataBuilder` (built once per KV-cache group, `build()` once per engine step: the "plan")
and an `AttentionImpl` (one per layer: `do_kv_cache_update()` then `forward()` each step).

Conventions every backend follows (the conformance suite checks them):

* Scores are ``s = scale * q·k``; then, where configured, the logits soft-cap
  ``s = cap * tanh(s / cap)``; then the ALiBi bias ``s += slope_h * (pos_k - pos_q)``; then masks.
* Causal with the query aligned to the end of its sequence: query token ``i`` of a request with
  ``q_len`` new tokens and ``seq_len`` total tokens sits at position ``seq_len - q_len + i`` and
  sees keys at positions ``<=`` its own.
* Sliding window ``W``: a key at ``pos_k`` is visible to a query at ``pos_q`` iff
  ``pos_q - pos_k < W`` (the query itself counts; this is transformers' and FlashAttention's
  ``window_size=(W - 1, 0)`` convention).
* Unused slots of referenced blocks may hold anything (the suite fills them with NaN); a backend
  must never let them reach the output.
* FP8 KV cache (``kv_cache_dtype`` ``"fp8_e4m3"`` / ``"fp8_e5m2"``): the cache write stores
  ``saturate(x / scale)`` rounded to the fp8 dtype (``x`` in float32;
  `pagedcore.attention.kv_quant`), with the layer's per-tensor ``k_scale`` / ``v_scale``;
  attention reads ``fp8 * scale``, inside the kernel (never a dequantized copy of the cache).
* Attention sinks: a per-query-head logit ``sink_h`` joins the softmax denominator
  (``p_j = exp(s_j - m) / (exp(sink_h - m) + sum_k exp(s_k - m))``) and contributes no value; it
  is neither scaled nor soft-capped, and windows and masks do not apply to it.
"""

from __future__ import annotations

import abc
import enum
import math
import numbers
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypedDict, TypeVar

import attrs

if TYPE_CHECKING:
    import torch

    from pagedcore.attention.metadata import CommonAttentionMetadata
    from pagedcore.kv_cache.spec import AttentionSpec

__all__ = [
    "AttentionBackend",
    "AttentionConfig",
    "AttentionImpl",
    "AttentionImplOptions",
    "CudaGraphSupport",
    "MetadataBuilder",
    "MultipleOf",
]

#: Names of KV-cache dtypes a backend may declare. "auto" means "same as the model dtype".
KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2")
#: Accepted spellings of the KV-cache dtypes, mapped to their names in `KV_CACHE_DTYPES`.
KV_CACHE_DTYPE_ALIASES = {
    "fp8": "fp8_e4m3", "float8_e4m3fn": "fp8_e4m3", "float8_e5m2": "fp8_e5m2",
}


@attrs.frozen
class MultipleOf:
    """A block-size declaration meaning "any positive multiple of `base`"."""

    base: int = attrs.field()

    @base.validator
    def _check(self, _attr: attrs.Attribute[int], value: int) -> None:
        if value <= 0:
            raise ValueError(f"MultipleOf(base={value}): base must be a positive integer")

    def accepts(self, block_size: int) -> bool:
        return block_size > 0 and block_size % self.base == 0

    def __str__(self) -> str:
        return f"multiple of {self.base}"


class CudaGraphSupport(enum.IntEnum):
    """How much of a step a backend's kernels can run under CUDA-graph capture."""

    NEVER = 0
    UNIFORM_SINGLE_TOKEN_DECODE = 1
    UNIFORM_BATCH = 2
    ALWAYS = 3


def _positive_int(field: str, value: Any, *, optional: bool) -> int:
    """`value` as an int when it is a positive integer (not a bool), else a ValueError."""
    expected = "a positive integer" + (" or None" if optional else "")
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        hint = ""
        if isinstance(value, float) and value.is_integer() and value > 0:
            hint = f"; did you mean {int(value)}?"
        raise ValueError(f"{field} must be {expected}, got {type(value).__name__} {value!r}{hint}")
    if value <= 0:
        raise ValueError(f"{field} must be {expected}, got {value}")
    return int(value)


def _torch_dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


@attrs.frozen(kw_only=True)
class AttentionConfig:
    """What an engine asks of a backend; the selector's input.

    Attributes
    ----------
    head_size:
        Per-head dimension of queries and keys (for MLA: ``kv_lora_rank + rope_head_dim``).
    dtype:
        Model (query/output) dtype name: ``"float16"``, ``"bfloat16"`` or ``"float32"``.
    block_size:
        Tokens per KV-cache block.
    kv_cache_dtype:
        ``"auto"`` (same as ``dtype``) or an fp8 name from ``KV_CACHE_DTYPES`` (``"fp8"`` is
        accepted and stored as ``"fp8_e4m3"``).
    has_sink:
        The layers carry per-head attention-sink logits (GPT-OSS).
    device:
        ``"cpu"`` or ``"cuda"``.
    """

    head_size: int
    dtype: str
    block_size: int
    kv_cache_dtype: str = "auto"
    use_mla: bool = False
    sliding_window: int | None = None
    use_alibi: bool = False
    logits_soft_cap: float | None = None
    device: str = "cpu"
    has_sink: bool = False

    def __attrs_post_init__(self) -> None:
        # Checked by type first: NaN, 64.5, True or "no" must never reach a backend's
        # validate_configuration (NaN compares False with everything; "no" is truthy).
        for field, optional in (("head_size", False), ("block_size", False),
                                ("sliding_window", True)):
            value = getattr(self, field)
            if value is None and optional:
                continue
            object.__setattr__(self, field, _positive_int(field, value, optional=optional))
        for field in ("use_mla", "use_alibi", "has_sink"):
            value = getattr(self, field)
            if not isinstance(value, bool):
                raise ValueError(
                    f"{field} must be True or False, got {type(value).__name__} {value!r}"
                    + ("; a non-empty string is not a boolean" if isinstance(value, str) else "")
                )
        cap = self.logits_soft_cap
        if cap is not None:
            if isinstance(cap, bool) or not isinstance(cap, (int, float)):
                raise ValueError(
                    f"logits_soft_cap must be a positive finite number or None, got "
                    f"{type(cap).__name__} {cap!r}"
                )
            if not math.isfinite(cap) or cap <= 0:
                raise ValueError(
                    f"logits_soft_cap must be a positive finite number or None, got {cap!r}; "
                    "pass None for no soft-cap"
                )
            object.__setattr__(self, "logits_soft_cap", float(cap))
        if self.dtype not in ("float16", "bfloat16", "float32"):
            raise ValueError(
                f"dtype {self.dtype!r} is not one of 'float16', 'bfloat16', 'float32'"
            )
        kv_name = KV_CACHE_DTYPE_ALIASES.get(self.kv_cache_dtype, self.kv_cache_dtype)
        object.__setattr__(self, "kv_cache_dtype", kv_name)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype {self.kv_cache_dtype!r} is not one of {KV_CACHE_DTYPES}"
            )
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device {self.device!r} is not one of 'cpu', 'cuda'")

    @classmethod
    def create(cls, *, dtype: Any, device: Any = "cpu", **kwargs: Any) -> AttentionConfig:
        """Build from torch objects as well as names (``torch.bfloat16``, ``torch.device``)."""
        device_name = getattr(device, "type", None) or str(device).split(":")[0]
        return cls(dtype=_torch_dtype_name(dtype), device=device_name, **kwargs)


class AttentionBackend(abc.ABC):
    """Static descriptor of a backend: what it supports and which classes implement it.

    Never instantiated. Subclasses set the class attributes and implement the abstract class
    methods; the registry rejects a subclass that leaves any abstract method unimplemented.
    """

    name: ClassVar[str] = ""
    #: Lower wins when several backends can serve a configuration.
    priority: ClassVar[int] = 100
    #: Why this priority: the measurement that set it (a sentence naming the bench and its
    #: JSON file), or None when none was made. `pagedcore select --explain` prints it.
    priority_reason: ClassVar[str | None] = None
    supported_dtypes: ClassVar[tuple[str, ...]] = ("float16", "bfloat16", "float32")
    supported_kv_cache_dtypes: ClassVar[tuple[str, ...]] = ("auto",)
    #: None means any head size.
    supported_head_sizes: ClassVar[tuple[int, ...] | None] = None
    supported_block_sizes: ClassVar[tuple[int | MultipleOf, ...]] = (MultipleOf(1),)
    supported_devices: ClassVar[tuple[str, ...]] = ("cuda",)
    supports_sliding_window: ClassVar[bool] = False
    supports_mla: ClassVar[bool] = False
    #: True when the backend serves *only* MLA layers.
    mla_only: ClassVar[bool] = False
    #: MLA backends: the ``(kv_lora_rank, rope_head_dim)`` latent widths the kernels serve
    #: (``((512, 64),)`` for DeepSeek's); None means any. The MLA conformance cases run at
    #: these widths.
    supported_mla_dims: ClassVar[tuple[tuple[int, int], ...] | None] = None
    supports_alibi: ClassVar[bool] = False
    supports_logits_soft_cap: ClassVar[bool] = False
    #: Per-head attention-sink logits (`AttentionImpl`'s ``sinks``).
    supports_sink: ClassVar[bool] = False
    #: True when `MetadataBuilder.build` may be given ``common_prefix_len > 0`` (cascade
    #: attention, `pagedcore.attention.cascade`); the engine passes 0 to the others.
    supports_cascade: ClassVar[bool] = False
    #: True when the builder's `MetadataBuilder.build_cascade_for_cudagraph_capture` plans a
    #: decode bucket's cascade for CUDA graphs (needs ``supports_cascade`` and
    #: ``cudagraph_support >= UNIFORM_SINGLE_TOKEN_DECODE``): the engine then replays a
    #: captured cascade graph for decode steps that share a prefix instead of running them
    #: eagerly.
    supports_cascade_cudagraph: ClassVar[bool] = False
    #: True when `MetadataBuilder.build_cascade_for_cudagraph_capture` also plans a *mixed*
    #: token bucket's cascade (needs ``supports_cascade_cudagraph`` and ``cudagraph_support
    #: == ALWAYS``): the engine then replays a captured cascade graph for mixed steps (new
    #: prompts beside decodes) whose requests share a prefix, instead of giving up either
    #: the cascade or the mixed-step graph.
    supports_cascade_mixed_cudagraph: ClassVar[bool] = False
    #: The backend whose kernel serves some prefills instead of this one's (named in the
    #: capability table as ``prefill:<name>``; the metadata builder decides per step, e.g.
    #: cuda_paged hands prompts without cached context to triton's Hopper kernel), or None.
    prefill_handoff: ClassVar[str | None] = None
    cudagraph_support: ClassVar[CudaGraphSupport] = CudaGraphSupport.NEVER

    def __init__(self) -> None:  # pragma: no cover - guard
        raise TypeError(f"{type(self).__name__} is a static descriptor; use the class itself")

    @classmethod
    def is_available(cls) -> str | None:
        """None when the backend can run here, else why not ("flash-attn is not installed")."""
        return None

    @classmethod
    def supports_block_size(cls, block_size: int) -> bool:
        return any(
            d.accepts(block_size) if isinstance(d, MultipleOf) else d == block_size
            for d in cls.supported_block_sizes
        )

    @classmethod
    def validate_configuration(cls, cfg: AttentionConfig) -> list[str]:
        """Every reason this backend cannot serve `cfg` (empty when it can)."""
        reasons: list[str] = []
        why = cls.is_available()
        if why is not None:
            reasons.append(f"not available: {why}")
        if cfg.device not in cls.supported_devices:
            reasons.append(
                f"device {cfg.device!r} not supported (supports {', '.join(cls.supported_devices)})"
            )
        if cfg.dtype not in cls.supported_dtypes:
            reasons.append(
                f"dtype {cfg.dtype} not supported (supports {', '.join(cls.supported_dtypes)})"
            )
        if cfg.kv_cache_dtype not in cls.supported_kv_cache_dtypes:
            reasons.append(
                f"kv_cache_dtype {cfg.kv_cache_dtype} not supported "
                f"(supports {', '.join(cls.supported_kv_cache_dtypes)})"
            )
        if cls.supported_head_sizes is not None and cfg.head_size not in cls.supported_head_sizes:
            reasons.append(
                f"head size {cfg.head_size} not supported "
                f"(supports {', '.join(map(str, cls.supported_head_sizes))})"
            )
        if not cls.supports_block_size(cfg.block_size):
            reasons.append(
                f"block size {cfg.block_size} not supported "
                f"(supports {', '.join(map(str, cls.supported_block_sizes))})"
            )
        if cfg.use_mla and not cls.supports_mla:
            reasons.append("MLA not supported")
        if not cfg.use_mla and cls.mla_only:
            reasons.append("serves only MLA layers")
        if cfg.sliding_window is not None and not cls.supports_sliding_window:
            reasons.append("sliding window not supported")
        if cfg.use_alibi and not cls.supports_alibi:
            reasons.append("ALiBi not supported")
        if cfg.logits_soft_cap is not None and not cls.supports_logits_soft_cap:
            reasons.append("logits soft-cap not supported")
        if cfg.has_sink and not cls.supports_sink:
            reasons.append("attention sinks not supported")
        return reasons

    @classmethod
    @abc.abstractmethod
    def get_builder_cls(cls) -> type[MetadataBuilder[Any]]:
        """The backend's `MetadataBuilder` subclass."""

    @classmethod
    @abc.abstractmethod
    def get_impl_cls(cls) -> type[AttentionImpl[Any]]:
        """The backend's `AttentionImpl` subclass."""

    @classmethod
    @abc.abstractmethod
    def get_kv_cache_shape(
        cls,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        cache_dtype: str = "auto",
    ) -> tuple[int, ...]:
        """Shape of one layer's KV-cache tensor (for MLA: ``num_kv_heads == 1``)."""


M = TypeVar("M")


def _as_floats(values: Any) -> list[float]:
    """A tensor's (any device, any float dtype) or a sequence's entries as Python floats."""
    if hasattr(values, "detach"):
        values = values.detach().float().cpu().reshape(-1).tolist()
    return [float(v) for v in values]


def _per_device(values: list[float] | None, cache: dict[str, torch.Tensor],
                device: torch.device) -> torch.Tensor | None:
    """`values` as a float32 tensor on `device`, made once per device and kept in `cache`."""
    if values is None:
        return None
    key = str(device)
    tensor = cache.get(key)
    if tensor is None:
        import torch

        tensor = torch.tensor(values, dtype=torch.float32, device=device)
        cache[key] = tensor
    return tensor


def _check_scales(k_scale: Any, v_scale: Any) -> tuple[float, float]:
    """Both scales as floats, or a ValueError naming the bad one."""
    out = []
    for name, value in (("k_scale", k_scale), ("v_scale", v_scale)):
        number = float(value)
        if not math.isfinite(number) or number <= 0:
            raise ValueError(
                f"{name} must be a positive finite number (the fp8 dequantization scale), "
                f"got {number!r}"
            )
        out.append(number)
    return out[0], out[1]


class AttentionImplOptions(TypedDict, total=False):
    """`AttentionImpl`'s optional keyword arguments, for an impl that adds its own and passes
    these on: ``**options: Unpack[AttentionImplOptions]`` keeps them typed."""

    alibi_slopes: Sequence[float] | None
    sliding_window: int | None
    logits_soft_cap: float | None
    kv_cache_dtype: str
    sinks: Sequence[float] | torch.Tensor | None
    k_scale: float
    v_scale: float


class MetadataBuilder(abc.ABC, Generic[M]):
    """Turns the step's `CommonAttentionMetadata` into the backend's own metadata (its plan).

    Built once per KV-cache group; `build()` runs once per engine step and its result is passed
    to every layer of the group.

    Parameters
    ----------
    kv_cache_spec:
        The group's spec (block size, KV heads, head size, dtype, window).
    layer_names:
        The layers of the group.
    device:
        Where the step's tensors live.
    """

    #: Requests with at most this many query tokens are treated as decodes; the engine places
    #: them first in the batch (decode-first order).
    reorder_batch_threshold: ClassVar[int] = 1

    def __init__(
        self, kv_cache_spec: AttentionSpec, layer_names: Sequence[str], device: torch.device
    ) -> None:
        self.kv_cache_spec = kv_cache_spec
        self.layer_names = list(layer_names)
        self.device = device

    @abc.abstractmethod
    def build(self, common: CommonAttentionMetadata, *, common_prefix_len: int = 0) -> M:
        """Plan this step.

        `common_prefix_len` (tokens, a multiple of the block size, at most every request's
        context length) is the cascade request: that many leading tokens sit in the same
        physical blocks for every request of the step, so a backend declaring
        ``supports_cascade`` may attend them once for all queries and merge (see
        `pagedcore.attention.cascade`). Backends without it always get 0.
        """

    def build_for_cudagraph_capture(self, common: CommonAttentionMetadata) -> M:
        """Plan a uniform decode batch once, for CUDA-graph capture and every later replay.

        Called only for backends whose ``cudagraph_support`` is at least
        ``UNIFORM_SINGLE_TOKEN_DECODE``. `common` describes ``num_reqs`` requests of one query
        token each; its device tensors (``query_start_loc``, ``seq_lens``, ``block_table``,
        ``slot_mapping``, ``positions``) are the engine's persistent buffers, and
        ``common.max_seq_len`` is the largest sequence length any replay will hold (the
        engine's ``max_model_len``). The engine then rewrites those buffers *in place* before
        each replay: the returned metadata must stay valid for any batch of the same
        ``num_reqs`` with every query length 1 and every ``seq_lens`` entry in
        ``[1, common.max_seq_len]``. Padding requests have ``seq_lens`` 1, a block-table row of
        zeros (the null block) and ``slot_mapping`` -1; their outputs are discarded.

        So nothing in the result may depend on the buffers' current *values* (no host reads of
        device data, no plan chosen from this step's lengths): only on ``num_reqs``,
        ``common.max_seq_len`` and the shapes. The default calls `build`, which is right for a
        backend whose plan uses no values; a backend whose plan does must override this.

        Mixed steps (backends declaring ``ALWAYS`` only): the engine also captures steps of
        any mix of decodes and prefill chunks, per *token* bucket ``T``. Then `common` has
        ``num_reqs`` = the engine's ``max_num_seqs``, ``num_actual_tokens`` = ``T``,
        ``max_query_len`` = ``T`` and ``max_seq_len`` = ``max_model_len``, and the metadata
        must stay valid for any later contents in which requests keep decode-first order,
        every query length is in ``[0, T]`` with their sum at most ``T``, and every
        ``seq_lens`` entry is at least its query length and at most ``max_seq_len``.
        Padding requests (after the real ones) have query length 0, ``seq_lens`` 0 and a
        block-table row of zeros; padding tokens (after the last real token) belong to no
        request, have ``slot_mapping`` -1 and position 0, and their outputs are discarded.
        """
        return self.build(common)

    def build_cascade_for_cudagraph_capture(
        self, common: CommonAttentionMetadata, prefix_len: torch.Tensor, capacity: int
    ) -> M:
        """Plan a decode bucket with cascade attention, once, for capture and every replay.

        Called only for backends declaring ``supports_cascade_cudagraph``, with `common` as
        `build_for_cudagraph_capture` receives it. `prefix_len` is a ``[1]`` int32 device
        tensor the engine rewrites before each replay (``fill_``, no host sync) with that
        step's shared prefix ``P``: a multiple of the block size, at most `capacity` tokens
        (the block table's width in tokens) and at most every real request's context, so
        every query lies after it; the first ``P // block_size`` block-table entries are the
        same for every real request (row 0 holds them). ``P`` may be 0 (nothing shared:
        the plan must then equal the plain one). Padding requests are as in
        `build_for_cudagraph_capture`. Buffers the plan derives from the step (suffix
        lengths, a shifted block table) are refreshed in `prepare_replay`, which the engine
        calls after writing `prefix_len`.

        Mixed token buckets (backends declaring ``supports_cascade_mixed_cudagraph``):
        `common` is then a mixed bucket as `build_for_cudagraph_capture` describes it
        (``max_query_len`` = ``num_actual_tokens`` = ``T``, ``num_reqs`` = the engine's
        ``max_num_seqs``, padding requests with query length 0 and ``seq_lens`` 0), and the
        plan must stay valid for any contents allowed there whose real requests share ``P``
        tokens, every query after them.
        """
        raise NotImplementedError(
            f"{type(self).__name__} does not plan cascade attention for CUDA graphs; a "
            "backend declaring supports_cascade_cudagraph = True must override "
            "build_cascade_for_cudagraph_capture"
        )

    def prepare_replay(self, metadata: M, common: CommonAttentionMetadata) -> None:
        """Refresh a captured plan's fixed buffers before its decode graph is replayed.

        Called by the engine before every replay of a decode graph (``cudagraph_support`` at
        least ``UNIFORM_SINGLE_TOKEN_DECODE``), after the step's inputs were written into the
        persistent buffers. `metadata` is what `build_for_cudagraph_capture` returned for that
        graph; `common` is the step being replayed (``num_reqs`` = the graph's bucket, padding
        requests as described there), with its host arrays (``seq_lens_cpu``,
        ``query_start_loc_cpu``) filled. A backend whose plan keeps its own arrays (a library's
        ``use_cuda_graph`` wrappers with preallocated indptr / indices / last-page buffers)
        rewrites them here, *in place*: same tensors, same shapes, nothing the graph's
        kernels were launched with may move. The default does nothing (plans that read the
        engine's buffers at run time need no refresh). Not called for plain mixed-step
        graphs. Also called for the plans of `build_cascade_for_cudagraph_capture` (decode
        and mixed buckets), after the engine wrote the replay's inputs and shared prefix
        length.
        """


class AttentionImpl(abc.ABC, Generic[M]):
    """One attention layer's computation over the paged KV cache.

    Parameters
    ----------
    num_heads:
        Query heads ``Hq``.
    head_size:
        Head dimension ``D``.
    scale:
        Softmax scale applied to ``q·k``.
    num_kv_heads:
        KV heads ``Hkv``; ``Hq % Hkv == 0`` (GQA/MQA).
    alibi_slopes:
        ``[Hq]`` float32 slopes, or None.
    sliding_window:
        Window ``W`` (see the module docstring), or None for full attention.
    logits_soft_cap:
        Cap ``c`` for ``c * tanh(s / c)``, or None.
    kv_cache_dtype:
        ``"auto"`` or an fp8 name (``"fp8"`` means ``"fp8_e4m3"``; stored normalized).
    sinks:
        ``[Hq]`` attention-sink logits (a sequence or a tensor; kept as float32), or None.
    k_scale, v_scale:
        Per-tensor dequantization scales of this layer's fp8 K and V cache (the cache holds
        ``x / scale``); ignored with ``kv_cache_dtype="auto"``. `set_kv_scales` changes them
        later (e.g. after calibrating on the first prefill).

    Notes
    -----
    Subclasses do not re-declare this constructor. It checks what holds for every backend
    (head counts, one ALiBi slope per query head, a positive window and soft-cap), stores the
    arguments as attributes of the same names (plus ``num_queries_per_kv``), then calls two
    hooks, in order, that a subclass overrides instead:

    * `check_supported` raises ValueError for an argument the impl cannot serve;
    * `setup` builds per-impl state (cached tensors, kernel handles).

    Only an impl that takes extra keyword arguments (MLA's ``kv_lora_rank``) declares
    ``__init__``: it stores them and passes the rest on to ``super().__init__``.

    Examples
    --------
    >>> class FullAttentionOnly(AttentionImpl[Any]):  # doctest: +SKIP
    ...     def check_supported(self) -> None:
    ...         if self.sliding_window is not None:
    ...             raise ValueError("no sliding window here; pick another backend")
    ...
    ...     def setup(self) -> None:
    ...         self._cache: dict[str, torch.Tensor] = {}
    """

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        *,
        num_kv_heads: int | None = None,
        alibi_slopes: Sequence[float] | None = None,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        kv_cache_dtype: str = "auto",
        sinks: Sequence[float] | torch.Tensor | None = None,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> None:
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_heads <= 0 or num_kv_heads <= 0 or num_heads % num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({num_heads}) must be a positive multiple of num_kv_heads "
                f"({num_kv_heads})"
            )
        if alibi_slopes is not None and len(alibi_slopes) != num_heads:
            raise ValueError(
                f"alibi_slopes has {len(alibi_slopes)} entries, expected one per query head "
                f"({num_heads})"
            )
        if sliding_window is not None and sliding_window <= 0:
            raise ValueError(f"sliding_window must be positive or None, got {sliding_window}")
        if logits_soft_cap is not None and logits_soft_cap <= 0:
            raise ValueError(f"logits_soft_cap must be positive or None, got {logits_soft_cap}")
        kv_cache_dtype = KV_CACHE_DTYPE_ALIASES.get(kv_cache_dtype, kv_cache_dtype)
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype {kv_cache_dtype!r} is not one of {KV_CACHE_DTYPES} "
                "(or 'fp8' for 'fp8_e4m3')"
            )
        sink_list = None if sinks is None else _as_floats(sinks)
        if sink_list is not None and len(sink_list) != num_heads:
            raise ValueError(
                f"sinks has {len(sink_list)} entries, expected one per query head ({num_heads})"
            )
        if sink_list is not None and not all(math.isfinite(s) for s in sink_list):
            raise ValueError("sinks must be finite numbers (one logit per query head)")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.num_queries_per_kv = num_heads // num_kv_heads
        self.alibi_slopes = None if alibi_slopes is None else [float(s) for s in alibi_slopes]
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap
        self.kv_cache_dtype = kv_cache_dtype
        self.sinks = sink_list
        self.k_scale, self.v_scale = _check_scales(k_scale, v_scale)
        self._alibi_on_device: dict[str, torch.Tensor] = {}
        self._sinks_on_device: dict[str, torch.Tensor] = {}
        self._scales_on_device: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.check_supported()
        self.setup()

    def alibi_slopes_on(self, device: torch.device) -> torch.Tensor | None:
        """The ALiBi slopes as a ``[Hq]`` float32 tensor on `device` (made once per device and
        kept, so a step never copies them again), or None without ALiBi."""
        return _per_device(self.alibi_slopes, self._alibi_on_device, device)

    def sinks_on(self, device: torch.device) -> torch.Tensor | None:
        """The sink logits as a ``[Hq]`` float32 tensor on `device` (made once per device),
        or None without sinks."""
        return _per_device(self.sinks, self._sinks_on_device, device)

    @property
    def kv_fp8(self) -> bool:
        """The cache holds fp8 values that need this layer's scales."""
        return self.kv_cache_dtype != "auto"

    def kv_scales_on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k_scale, v_scale)`` as ``[1]`` float32 tensors on `device`, made once per device
        and updated in place by `set_kv_scales` (so captured CUDA graphs see new values)."""
        key = str(device)
        scales = self._scales_on_device.get(key)
        if scales is None:
            import torch

            scales = (
                torch.tensor([self.k_scale], dtype=torch.float32, device=device),
                torch.tensor([self.v_scale], dtype=torch.float32, device=device),
            )
            self._scales_on_device[key] = scales
        return scales

    def set_kv_scales(self, k_scale: float, v_scale: float) -> None:
        """Set this layer's fp8 K/V scales (positive, finite); device copies update in place.

        Values already in the cache were quantized with the old scales: call this before
        the first cache write (checkpoint scales) or right after calibrating on it.
        """
        self.k_scale, self.v_scale = _check_scales(k_scale, v_scale)
        for k_t, v_t in self._scales_on_device.values():
            k_t.fill_(self.k_scale)
            v_t.fill_(self.v_scale)

    def check_supported(self) -> None:
        """Raise ValueError if this impl cannot serve its arguments (no-op by default).

        Runs at the end of ``__init__``, after the common checks, with every argument stored
        on ``self``. The message names what is unsupported and what to do instead (another
        value, or another backend). Overrides that extend another impl call
        ``super().check_supported()`` first.
        """

    def setup(self) -> None:
        """Build per-impl state after `check_supported` passed (no-op by default).

        Overrides that extend another impl call ``super().setup()`` first.
        """

    @abc.abstractmethod
    def do_kv_cache_update(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Scatter this step's K/V into the paged cache.

        Parameters
        ----------
        key, value:
            ``[T, Hkv, D]`` in the model dtype.
        kv_cache:
            This layer's cache, shaped as ``get_kv_cache_shape`` says.
        slot_mapping:
            ``[T]`` int64; ``slot = block_id * block_size + offset``; ``-1`` marks padding
            tokens, which are skipped.
        """

    @abc.abstractmethod
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: M,
        *,
        output: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention for the flattened batch, reading history (and this step's K/V, already
        written by `do_kv_cache_update`) from `kv_cache` through the block table.

        Parameters
        ----------
        query:
            ``[T, Hq, D]`` in the model dtype.
        key, value:
            ``[T, Hkv, D]``; this step's K/V (backends may ignore them and read the cache).
        kv_cache:
            This layer's cache.
        metadata:
            What this backend's builder returned for the step.
        output:
            Optional ``[T, Hq, D]`` buffer to write into.

        Returns
        -------
        torch.Tensor
            ``[T, Hq, D]`` in the model dtype; rows of padding tokens are unspecified.
        """

"""Choosing an attention backend for a configuration.

Every registered backend is asked `validate_configuration(cfg)`; the valid one with the lowest
``priority`` wins (ties: name order). A ``"cuda"`` configuration on a machine without a CUDA
device is refused by every backend (see `device_reasons`). ``backend=`` or the
``PAGEDCORE_BACKEND`` environment variable forces one backend, with no fallback. Results are
cached per configuration, registry generation, environment and CUDA availability, so
registering or removing a plugin is always noticed.

Examples
--------
>>> import torch, pagedcore
>>> pagedcore.select_backend(head_size=64, dtype=torch.float32, block_size=16, device="cpu")
... # doctest: +SKIP
<class 'pagedcore.reference.backend.ReferenceBackend'>
>>> print(pagedcore.explain_selection(head_size=64, dtype="bf16", block_size=16).format())
... # doctest: +SKIP
"""

from __future__ import annotations

import functools
import os
from typing import Any

import attrs

from pagedcore.attention.backend import (
    KV_CACHE_DTYPE_ALIASES,
    AttentionBackend,
    AttentionConfig,
    MultipleOf,
)
from pagedcore.plugins.errors import PluginError
from pagedcore.plugins.records import PluginFailure
from pagedcore.plugins.registry import PLUGINS_ENV, BackendRegistry, get_registry
from pagedcore.plugins.validation import PluginCodeError, call_plugin_code

__all__ = [
    "BACKEND_ENV",
    "NO_CUDA_REASON",
    "BackendSelectionError",
    "SelectionReport",
    "SelectionRow",
    "clear_selection_cache",
    "explain_selection",
    "make_config",
    "select_backend",
]

#: Forces one backend by name (no fallback), like ``backend=``.
BACKEND_ENV = "PAGEDCORE_BACKEND"
_DTYPE_ALIASES = {
    "bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32",
    "float": "float32",
}
_KV_DTYPE_ALIASES = KV_CACHE_DTYPE_ALIASES
_MAX_HINTS = 6
#: The reason every backend gets for ``device="cuda"`` when torch sees no CUDA device.
NO_CUDA_REASON = "no CUDA device is available here"


class BackendSelectionError(PluginError):
    """No backend can serve the configuration (or the forced one cannot).

    Attributes
    ----------
    report:
        The full `SelectionReport` (every backend with its reasons), when one was made.
    """

    def __init__(self, message: str, *, report: SelectionReport | None = None) -> None:
        super().__init__(message)
        self.report = report


@attrs.frozen
class SelectionRow:
    """One backend's verdict for one configuration."""

    name: str
    priority: int
    source: str
    chosen: bool
    reasons: tuple[str, ...]
    cls: type[AttentionBackend] = attrs.field(eq=False, repr=False)

    @property
    def valid(self) -> bool:
        return not self.reasons

    @property
    def priority_reason(self) -> str | None:
        """The backend's `AttentionBackend.priority_reason` (None when it gives none)."""
        reason = getattr(self.cls, "priority_reason", None)
        return reason if isinstance(reason, str) else None


@attrs.frozen
class SelectionReport:
    """Every backend's verdict, the choice and, when nothing fits, what would.

    Attributes
    ----------
    config:
        The configuration asked about.
    rows:
        One `SelectionRow` per registered backend, by (priority, name).
    chosen:
        Name of the selected backend, or None when none can serve `config`.
    forced, forced_by:
        The forced backend name and what forced it (``"backend="`` or ``PAGEDCORE_BACKEND``).
    failures:
        Plugins that failed to load (they may be why nothing fits).
    hints:
        Single changes of the configuration that some backend could serve.
    """

    config: AttentionConfig
    rows: tuple[SelectionRow, ...]
    chosen: str | None
    forced: str | None = None
    forced_by: str | None = None
    failures: tuple[PluginFailure, ...] = ()
    hints: tuple[str, ...] = ()

    def format(self) -> str:
        """The report as plain text: one line per backend, then failures and hints."""
        lines = [f"configuration: {describe_config(self.config)}"]
        if self.forced is not None:
            lines.append(f"forced by {self.forced_by}: {self.forced}")
        for row in self.rows:
            mark = "*" if row.chosen else ("ok" if row.valid else "--")
            why = "; ".join(row.reasons) if row.reasons else "can serve it"
            lines.append(f"  {mark:>2} {row.name} (priority {row.priority}, {row.source}): {why}")
        lines += [f"  failed plugin: {f.describe()}" for f in self.failures]
        lines += [f"  would work: {hint}" for hint in self.hints]
        lines.append(f"chosen: {self.chosen}" if self.chosen else "chosen: none")
        return "\n".join(lines)

    def explain_order(self) -> str:
        """Why the valid backends rank as they do: each one's priority and the measurement
        behind it (`AttentionBackend.priority_reason`), the chosen one first."""
        valid = [r for r in self.rows if r.valid]
        if not valid:
            return "no backend can serve this configuration, so there is no order to explain"
        lines = ["why this order (lower priority wins among the backends that can serve it):"]
        for row in valid:
            mark = "*" if row.chosen else "-"
            why = row.priority_reason or "no measurement recorded for this priority"
            lines.append(f"  {mark} {row.name} (priority {row.priority}): {why}")
        if self.forced is not None:
            lines.append(f"(forced by {self.forced_by}: {self.forced}; priorities do not apply)")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form of the report."""
        return {
            "config": attrs.asdict(self.config),
            "chosen": self.chosen,
            "forced": self.forced,
            "forced_by": self.forced_by,
            "backends": [
                {"name": r.name, "priority": r.priority, "source": r.source,
                 "chosen": r.chosen, "valid": r.valid, "reasons": list(r.reasons),
                 "priority_reason": r.priority_reason}
                for r in self.rows
            ],
            "failed_plugins": [f.describe() for f in self.failures],
            "hints": list(self.hints),
        }

    def error_message(self) -> str:
        """Why nothing was chosen: every backend with its reasons, failures and hints."""
        cfg = describe_config(self.config)
        if self.forced is not None:
            row = next(r for r in self.rows if r.name == self.forced)
            others = [r.name for r in self.rows if r.valid and r.name != self.forced]
            lines = [
                f"attention backend {self.forced!r} (forced by {self.forced_by}) cannot serve "
                f"{cfg}: {'; '.join(row.reasons)}.",
                "A forced backend has no fallback: "
                + (f"{', '.join(others)} could serve it; " if others else "")
                + f"pass another backend= or unset {BACKEND_ENV}.",
            ]
            return "\n".join(lines)
        if not self.rows:
            lines = [
                f"no attention backend is registered, so none can serve {cfg}. "
                "Install one (the core package provides 'reference'), check "
                f"{PLUGINS_ENV}, and run `pagedcore backends`."
            ]
        else:
            lines = [f"no attention backend can serve {cfg}:"]
            lines += [
                f"  - {r.name} (priority {r.priority}, {r.source}): {'; '.join(r.reasons)}"
                for r in self.rows
            ]
        if self.failures:
            lines.append("plugins that failed to load:")
            lines += [f"  - {f.describe()}" for f in self.failures]
        if self.hints:
            lines.append("what would work (one change each):")
            lines += [f"  - {hint}" for hint in self.hints]
        return "\n".join(lines)


def describe_config(cfg: AttentionConfig) -> str:
    """``head_size=128, dtype=bfloat16, block_size=16, device=cuda`` plus any features set."""
    text = (
        f"head_size={cfg.head_size}, dtype={cfg.dtype}, block_size={cfg.block_size}, "
        f"device={cfg.device}"
    )
    extras = {
        "kv_cache_dtype": None if cfg.kv_cache_dtype == "auto" else cfg.kv_cache_dtype,
        "use_mla": cfg.use_mla or None,
        "sliding_window": cfg.sliding_window,
        "use_alibi": cfg.use_alibi or None,
        "logits_soft_cap": cfg.logits_soft_cap,
        "has_sink": cfg.has_sink or None,
    }
    return text + "".join(f", {k}={v}" for k, v in extras.items() if v is not None)


def _dtype_name(dtype: Any, aliases: dict[str, str]) -> str:
    name = str(dtype).removeprefix("torch.").strip().lower()
    return aliases.get(name, name)


def _default_device() -> str:
    import torch  # lazy: `import pagedcore` stays cheap

    return "cuda" if torch.cuda.is_available() else "cpu"


def cuda_available() -> bool:
    """Whether torch sees a CUDA device, asked at call time (torch is imported lazily)."""
    import torch

    return bool(torch.cuda.is_available())


def device_reasons(cfg: AttentionConfig, *, cuda_available: bool) -> tuple[str, ...]:
    """Why no backend can serve `cfg` on this machine's devices (empty when it can).

    Checked here, for every backend, rather than in `AttentionBackend.validate_configuration`:
    that method states what a backend *supports* (plugins override it, and a forgotten
    ``super()`` call would drop a machine check), while whether this machine has a CUDA
    device is a fact about the machine, the same for every backend. It is asked at call time
    and is part of the selection cache key, so the hints ("device=cuda: ...") stay honest too.
    ``device="cpu"`` (the reference backend, Triton's interpreter mode) is never affected.
    """
    if cfg.device == "cuda" and not cuda_available:
        return (NO_CUDA_REASON,)
    return ()


def make_config(
    *,
    head_size: int,
    dtype: Any,
    block_size: int,
    kv_cache_dtype: str = "auto",
    use_mla: bool = False,
    sliding_window: int | None = None,
    use_alibi: bool = False,
    logits_soft_cap: float | None = None,
    device: Any = None,
    has_sink: bool = False,
) -> AttentionConfig:
    """The `AttentionConfig` the selector validates against (names, aliases, torch objects)."""
    return AttentionConfig.create(
        head_size=head_size,
        dtype=_dtype_name(dtype, _DTYPE_ALIASES),
        block_size=block_size,
        kv_cache_dtype=_dtype_name(kv_cache_dtype, _KV_DTYPE_ALIASES),
        use_mla=use_mla,
        sliding_window=sliding_window,
        use_alibi=use_alibi,
        logits_soft_cap=logits_soft_cap,
        device=_default_device() if device is None else device,
        has_sink=has_sink,
    )


def _reasons(
    cls: type[AttentionBackend], cfg: AttentionConfig, *, cuda: bool
) -> tuple[str, ...]:
    machine = device_reasons(cfg, cuda_available=cuda)
    try:  # a plugin bug (even sys.exit()) must not hide the other backends
        reasons = call_plugin_code(
            "validate_configuration()", lambda: _reason_list(cls.validate_configuration(cfg))
        )
    except PluginCodeError as err:
        return (*machine, str(err))
    return machine + tuple(str(r) for r in reasons)


def _reason_list(value: Any) -> list[str]:
    """`validate_configuration`'s result as its list of reasons; TypeError for anything but
    a list or tuple of str (a bare str would read as one reason per character, an empty one
    as "no reason": valid)."""
    if not isinstance(value, (list, tuple)) or not all(isinstance(r, str) for r in value):
        raise TypeError(
            f"validate_configuration() must return a list of str (empty: it can serve the "
            f"configuration), got {type(value).__name__} {value!r:.60}")
    return list(value)


def _nearest(values: set[int], target: int, count: int = 2) -> list[int]:
    return sorted(values, key=lambda v: (abs(v - target), v))[:count]


def _hints(
    classes: list[type[AttentionBackend]], cfg: AttentionConfig, *, cuda: bool
) -> tuple[str, ...]:
    heads = {h for c in classes for h in (c.supported_head_sizes or ())}
    blocks: set[int] = set()
    for c in classes:
        for b in c.supported_block_sizes:
            if isinstance(b, MultipleOf):
                blocks |= {b.base, -(-cfg.block_size // b.base) * b.base}
            else:
                blocks.add(b)
    changes: list[tuple[str, Any]] = [("head_size", h) for h in _nearest(heads, cfg.head_size)]
    changes += [("block_size", b) for b in _nearest(blocks, cfg.block_size)]
    changes += [("dtype", d) for d in ("bfloat16", "float16", "float32")]
    changes += [("kv_cache_dtype", "auto"), ("device", "cuda"), ("device", "cpu")]
    changes += [("sliding_window", None), ("use_alibi", False), ("logits_soft_cap", None),
                ("has_sink", False)]
    hints: list[str] = []
    for field, value in changes:
        if getattr(cfg, field) == value:
            continue
        alt = attrs.evolve(cfg, **{field: value})
        fits = [c.name for c in classes if not _reasons(c, alt, cuda=cuda)]
        if fits:
            hints.append(f"{field}={value}: {', '.join(fits)}")
    return tuple(hints[:_MAX_HINTS])


@functools.lru_cache(maxsize=256)
def _explain(
    registry: BackendRegistry,
    generation: int,
    cfg: AttentionConfig,
    forced: str | None,
    forced_by: str | None,
    plugins_env: str | None,
    cuda: bool,
) -> SelectionReport:
    del generation, plugins_env  # cache keys only
    entries = sorted(registry.backends.values(), key=lambda e: (e.cls.priority, e.name))
    verdicts = [(e, _reasons(e.cls, cfg, cuda=cuda)) for e in entries]
    if forced is not None:
        chosen = forced if not dict((e.name, r) for e, r in verdicts)[forced] else None
    else:
        chosen = next((e.name for e, r in verdicts if not r), None)
    rows = tuple(
        SelectionRow(e.name, e.cls.priority, e.source, e.name == chosen, r, e.cls)
        for e, r in verdicts
    )
    hints = (
        () if chosen is not None or forced else _hints([e.cls for e in entries], cfg, cuda=cuda)
    )
    return SelectionReport(
        cfg, rows, chosen, forced, forced_by, registry.failures, hints
    )


def explain_selection(
    *,
    head_size: int,
    dtype: Any,
    block_size: int,
    kv_cache_dtype: str = "auto",
    use_mla: bool = False,
    sliding_window: int | None = None,
    use_alibi: bool = False,
    logits_soft_cap: float | None = None,
    device: Any = None,
    backend: str | None = None,
    has_sink: bool = False,
) -> SelectionReport:
    """Every backend's verdict on a configuration, and the choice `select_backend` makes.

    Takes the same arguments as `select_backend`. Does not raise when nothing fits (the
    report's ``chosen`` is None); it does raise for a bad configuration value or an unknown /
    failed forced backend. ``device="cuda"`` without a CUDA device here gives every backend the
    reason `NO_CUDA_REASON`.
    """
    cfg = make_config(
        head_size=head_size, dtype=dtype, block_size=block_size,
        kv_cache_dtype=kv_cache_dtype, use_mla=use_mla, sliding_window=sliding_window,
        use_alibi=use_alibi, logits_soft_cap=logits_soft_cap, device=device,
        has_sink=has_sink,
    )
    forced: str | None = backend
    forced_by: str | None = "backend="
    if forced is None:
        forced = os.environ.get(BACKEND_ENV, "").strip() or None
        forced_by = f"{BACKEND_ENV}={forced!r}"
    registry = get_registry()
    if forced is not None:
        registry.get(forced)  # raises UnknownBackendError / BackendLoadError (chained)
    else:
        forced_by = None
    return _explain(
        registry, registry.generation, cfg, forced, forced_by, os.environ.get(PLUGINS_ENV),
        cuda_available(),
    )


def select_backend(
    *,
    head_size: int,
    dtype: Any,
    block_size: int,
    kv_cache_dtype: str = "auto",
    use_mla: bool = False,
    sliding_window: int | None = None,
    use_alibi: bool = False,
    logits_soft_cap: float | None = None,
    device: Any = None,
    backend: str | None = None,
    has_sink: bool = False,
) -> type[AttentionBackend]:
    """The attention backend to use for a configuration.

    Parameters
    ----------
    head_size:
        Per-head dimension ``D`` (for MLA: ``kv_lora_rank + rope_head_dim``).
    dtype:
        Model dtype: a ``torch.dtype`` or a name (``"bfloat16"``, ``"bf16"``, ``"float16"``, ...).
    block_size:
        Tokens per KV-cache block.
    kv_cache_dtype:
        ``"auto"`` (the model dtype) or an fp8 name (``"fp8"`` = ``"fp8_e4m3"``).
    use_mla, sliding_window, use_alibi, logits_soft_cap, has_sink:
        Features the layers need (None / False: not used); ``has_sink``: per-head
        attention-sink logits (GPT-OSS).
    device:
        ``"cpu"``, ``"cuda"`` or a ``torch.device``; None picks ``"cuda"`` when available.
        ``"cuda"`` without a CUDA device here is refused (every backend gets the reason
        `NO_CUDA_REASON`).
    backend:
        Force this backend by name (else ``PAGEDCORE_BACKEND``, if set); no fallback.

    Returns
    -------
    type[AttentionBackend]
        The valid backend with the lowest priority (ties broken by name).

    Raises
    ------
    BackendSelectionError
        Nothing can serve the configuration, or the forced backend cannot; the message lists
        every backend with its reasons, failed plugins, and what would work.
    UnknownBackendError, BackendLoadError
        The forced name is unknown, or belongs to a plugin that failed to load.
    """
    report = explain_selection(
        head_size=head_size, dtype=dtype, block_size=block_size,
        kv_cache_dtype=kv_cache_dtype, use_mla=use_mla, sliding_window=sliding_window,
        use_alibi=use_alibi, logits_soft_cap=logits_soft_cap, device=device, backend=backend,
        has_sink=has_sink,
    )
    if report.chosen is None:
        raise BackendSelectionError(report.error_message(), report=report)
    return next(row.cls for row in report.rows if row.chosen)


def clear_selection_cache() -> None:
    """Forget cached selections (they are also keyed by registry generation and env)."""
    _explain.cache_clear()

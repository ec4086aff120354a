"""`FlexImpl`: one layer's attention through ``flex_attention`` over the packed keys."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from typing import Any

import torch

from pagedcore.attention.backend import AttentionImpl
from pagedcore.reference.impl import check_kv_cache, write_kv_cache
from pagedcore_flex.capabilities import HEAD_SIZES
from pagedcore_flex.metadata import FlexMetadata

__all__ = ["FlexImpl"]


def _eager_flex(*args: Any, **kwargs: Any) -> torch.Tensor:
    """``flex_attention`` without compilation, minus its "not compiled" warning (eager is the
    documented choice on CPU, where one compile takes ~30 s)."""
    from torch.nn.attention.flex_attention import flex_attention

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        out: torch.Tensor = flex_attention(*args, **kwargs)
    return out


#: Compiled graphs allowed for flex_attention: one per (bucket pair, dtype, head layout,
#: score_mod variant); dynamo's default (8) would silently fall back to eager past it.
RECOMPILE_LIMIT = 64


def _recompile_room(device: torch.device) -> contextlib.AbstractContextManager[object]:
    """Raise dynamo's recompile limit for the duration of a compiled flex call (CUDA only)."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    import torch._dynamo

    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    if not hasattr(config, name):
        return contextlib.nullcontext()
    limits: dict[str, Any] = {name: RECOMPILE_LIMIT}
    patch: contextlib.AbstractContextManager[object] = config.patch(**limits)
    return patch


class FlexImpl(AttentionImpl[FlexMetadata]):
    """Gathers the step's keys once per layer and runs one ``flex_attention`` call.

    See `AttentionImpl` for the parameters; only ``kv_cache_dtype="auto"`` is accepted. On
    CUDA ``flex_attention`` runs compiled (one ``torch.compile`` per padded shape bucket, the
    compiled callable kept by this impl); on CPU it runs eagerly in float32.
    """

    def check_supported(self) -> None:
        heads = HEAD_SIZES
        if self.head_size not in heads:
            raise ValueError(
                f"head size {self.head_size} is not supported by the flex backend (supports "
                f"{', '.join(map(str, heads))}); choose another backend"
            )
        if self.kv_cache_dtype != "auto":
            raise ValueError(
                f"the flex backend stores the KV cache in the model dtype only "
                f"(kv_cache_dtype='auto'), got {self.kv_cache_dtype!r}"
            )

    def setup(self) -> None:
        self._compiled: Callable[..., torch.Tensor] | None = None

    def _flex_for(self, device: torch.device) -> Callable[..., torch.Tensor]:
        if device.type != "cuda":
            return _eager_flex
        if self._compiled is None:
            from torch.nn.attention.flex_attention import flex_attention

            # dynamic=False: one graph per padded bucket (few: powers of two), no symbolic
            # shapes; torch.compile keeps them keyed by shape.
            self._compiled = torch.compile(flex_attention, dynamic=False)
        return self._compiled

    def score_mod(self, metadata: FlexMetadata, device: torch.device) -> Any:
        """The flex ``score_mod`` for soft-cap then ALiBi (None when neither is set)."""
        cap = self.logits_soft_cap
        slopes = self.alibi_slopes_on(device)
        if cap is None and slopes is None:
            return None
        q_pos, kv_pos = metadata.q_pos, metadata.kv_pos

        def mod(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            if cap is not None:
                score = cap * torch.tanh(score / cap)
            if slopes is not None:
                rel = kv_pos[b, kv_idx] - q_pos[b, q_idx]
                score = score + slopes[h] * rel.to(score.dtype)
            return score

        return mod

    def do_kv_cache_update(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Write ``key``/``value`` ``[T, Hkv, D]`` to their slots; ``-1`` slots are skipped.

        `kv_cache` is ``[2, num_blocks, block_size, Hkv, D]``; index 0 holds K, 1 holds V.
        """
        write_kv_cache(kv_cache, key, value, slot_mapping,
                       num_kv_heads=self.num_kv_heads, head_size=self.head_size)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: FlexMetadata,
        *,
        output: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention for the flattened batch; see `AttentionImpl.forward`.

        Parameters
        ----------
        query:
            ``[T, Hq, D]`` in the model dtype.
        key, value:
            ``[T, Hkv, D]``; unused (this step's K/V is read back from the cache).
        kv_cache:
            ``[2, num_blocks, block_size, Hkv, D]``.
        metadata:
            From `FlexMetadataBuilder.build`.
        output:
            Optional ``[T, Hq, D]`` buffer; padding rows are left untouched.

        Returns
        -------
        torch.Tensor
            ``[T, Hq, D]`` in ``query.dtype`` (`output` when given); padding rows are zero
            when `output` is None.
        """
        check_kv_cache(kv_cache, self.num_kv_heads, self.head_size)
        if query.dim() != 3 or query.shape[1:] != (self.num_heads, self.head_size):
            raise ValueError(
                f"query has shape {tuple(query.shape)}, expected [T, {self.num_heads}, "
                f"{self.head_size}]"
            )
        device = query.device
        # Eager flex on CPU runs in float32 (the half-precision CPU path loses too much);
        # compiled CUDA flex keeps the model dtype and accumulates in float32 itself.
        work_dtype = query.dtype if device.type == "cuda" else torch.float32
        n = metadata.num_actual_tokens
        f, t_pad, s_pad = metadata.flex_batch, metadata.padded_query_len, metadata.padded_kv_len
        live = metadata.kv_live(self.sliding_window).view(f * s_pad, 1, 1)
        flat_shape = (-1, self.num_kv_heads, self.head_size)
        slots = metadata.kv_slots.view(-1)
        zero = torch.zeros((), dtype=work_dtype, device=device)
        # Rows no query can see are zeroed: eager flex computes 0 * V there, and the null
        # block or an out-of-window block may hold NaN.
        k = torch.where(
            live, kv_cache[0].view(flat_shape).index_select(0, slots).to(work_dtype), zero
        ).view(f, s_pad, self.num_kv_heads, self.head_size)
        v = torch.where(
            live, kv_cache[1].view(flat_shape).index_select(0, slots).to(work_dtype), zero
        ).view(f, s_pad, self.num_kv_heads, self.head_size)
        # Query rows: the step's tokens, with padding rows reading an appended zero row.
        source = torch.cat([query[:n].to(work_dtype), query.new_zeros(1, *query.shape[1:],
                                                                      dtype=work_dtype)])
        q_rows = metadata.q_rows.view(-1)
        q = source.index_select(0, torch.where(q_rows >= 0, q_rows, n))
        q = q.view(f, t_pad, self.num_heads, self.head_size)
        flex = self._flex_for(device)
        with _recompile_room(device):
            out = flex(
                q.transpose(1, 2),
                k.transpose(1, 2),
                v.transpose(1, 2),
                score_mod=self.score_mod(metadata, device),
                block_mask=metadata.block_mask(self.sliding_window),
                scale=self.scale,
                enable_gqa=self.num_heads != self.num_kv_heads,
            )
        rows = out.transpose(1, 2).reshape(f * t_pad, self.num_heads, self.head_size)
        real = q_rows >= 0
        if output is None:
            output = torch.zeros_like(query)
        output.index_copy_(0, q_rows[real], rows[real].to(output.dtype))
        return output

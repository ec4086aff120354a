"""`RequestFit`: whether a request of a given shape could ever be served (config only).

The scheduler rejects such requests when they are added; the serve front end checks prompts
with the same object before admitting them, in its own process when the engine runs in
another one (the object is small and picklable).
"""

from __future__ import annotations

import attrs

from pagedcore.kv_cache.spec import KVCacheConfig, KVCacheSpec, cdiv

__all__ = ["RequestFit"]


@attrs.frozen(kw_only=True)
class RequestFit:
    """The limits a request must fit: the model length and the KV cache.

    Attributes
    ----------
    max_model_len:
        Most tokens (prompt and output) of one request.
    max_num_batched_tokens:
        The step's token budget (a sliding-window spec holds up to a window plus one chunk).
    specs:
        One KV-cache spec per group.
    num_blocks:
        KV blocks of the cache, the null block included.
    """

    max_model_len: int
    max_num_batched_tokens: int
    specs: tuple[KVCacheSpec, ...]
    num_blocks: int

    @classmethod
    def of(cls, *, max_model_len: int, max_num_batched_tokens: int,
           kv_cache_config: KVCacheConfig) -> RequestFit:
        """The limits of an engine with this cache layout."""
        return cls(max_model_len=max_model_len, max_num_batched_tokens=max_num_batched_tokens,
                   specs=tuple(g.spec for g in kv_cache_config.groups),
                   num_blocks=kv_cache_config.num_blocks)

    def blocks_needed(self, num_tokens: int) -> int:
        """KV blocks (summed over groups) one request of `num_tokens` tokens holds at most."""
        total = 0
        for spec in self.specs:
            need = spec.max_memory_usage_bytes(num_tokens, self.max_num_batched_tokens)
            total += cdiv(need, spec.page_size_bytes)
        return total

    def check(self, num_prompt_tokens: int, max_tokens: int | None) -> None:
        """Raise ValueError when a request of this shape could never be served (``max_tokens``
        None: up to ``max_model_len``)."""
        limit = self.max_model_len
        if num_prompt_tokens == 0:
            raise ValueError("the prompt is empty; give at least one token")
        if num_prompt_tokens > limit:
            raise ValueError(
                f"the prompt has {num_prompt_tokens} tokens, more than max_model_len={limit}; "
                "shorten the prompt or raise max_model_len"
            )
        # The last sampled token is never fed back, so it needs no KV slot.
        tokens = limit if max_tokens is None else min(num_prompt_tokens + max_tokens - 1, limit)
        need = self.blocks_needed(tokens)
        usable = self.num_blocks - 1  # block 0 is the null block
        if need > usable:
            raise ValueError(
                f"a request of {tokens} tokens needs {need} KV blocks but the cache has only "
                f"{usable}; raise kv_cache_memory_bytes, or lower max_tokens / the prompt length"
            )

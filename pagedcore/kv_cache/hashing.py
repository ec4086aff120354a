"""Chained block hashes for prefix caching.

A full block ``i`` of a request is named by ``H_i = h(H_{i-1}, tokens_i, extra_keys_i)``, with
``H_{-1}`` derived from a seed. Two requests share block ``i`` only if they agree on every token
and every extra key up to and including block ``i``.

The byte encoding is canonical and never uses pickle: the parent hash and every extra-key payload
are length-prefixed, token ids are packed as little-endian signed 64-bit integers after their
count, and every extra key starts with a one-byte tag naming its source, so a LoRA named ``"x"``
and a cache salt ``"x"`` encode differently.

``sha256`` (the default) is collision resistant. ``xxhash`` (xxh3, 128-bit) is several times
faster but *not* cryptographic: a party that can choose prompts could craft a collision and read
another tenant's cached KV. Use it only when all requests are trusted.
"""

from __future__ import annotations

import hashlib
import os
import struct
import sys
from array import array
from collections.abc import Callable, Sequence
from typing import Protocol

import attrs

__all__ = [
    "HASH_ALGOS",
    "BlockHash",
    "BlockHasher",
    "MultiModalSpan",
    "block_extra_keys",
    "encode_block",
    "hash_block_tokens",
    "make_hash_function",
    "root_hash",
]

#: A block hash: 32 bytes (sha256) or 16 bytes (xxhash).
BlockHash = bytes

#: Hash algorithms understood by `make_hash_function`.
HASH_ALGOS: tuple[str, ...] = ("sha256", "xxhash")

# One-byte source tags of extra keys. Distinct tags keep the sources apart in the encoding.
TAG_LORA = b"L"
TAG_MULTIMODAL = b"M"
TAG_SALT = b"S"

_U32 = struct.Struct("<I")
_MM_OFFSET = struct.Struct("<q")
_DOMAIN = b"pagedcore.kv_cache.block.v1"
# The fast path packs tokens with array("q"): native order, which must be little-endian.
_LITTLE_ENDIAN = sys.byteorder == "little"

#: An extra key: (source tag, payload bytes).
ExtraKey = tuple[bytes, bytes]


@attrs.frozen(kw_only=True)
class MultiModalSpan:
    """A multimodal item occupying token positions ``[offset, offset + length)`` of a prompt.

    Parameters
    ----------
    offset : int
        Position of the item's first placeholder token.
    length : int
        Number of placeholder tokens.
    content_hash : str
        Hash of the item's content (image bytes, audio, ...), computed by the caller.
    """

    offset: int = attrs.field(validator=attrs.validators.ge(0))
    length: int = attrs.field(validator=attrs.validators.gt(0))
    content_hash: str


_sha256 = hashlib.sha256


def _sha256_digest(data: bytes) -> BlockHash:
    return _sha256(data).digest()


def make_hash_function(algo: str) -> Callable[[bytes], BlockHash]:
    """Return the digest function named ``algo`` (``"sha256"`` or ``"xxhash"``).

    ``xxhash`` is imported only here, so it stays an optional dependency.
    """
    if algo == "sha256":
        return _sha256_digest
    if algo == "xxhash":
        try:
            import xxhash
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ImportError(
                "hash_algo='xxhash' needs the xxhash package; install it with "
                "`pip install xxhash` (or pagedcore[xxhash]), or use hash_algo='sha256'"
            ) from exc
        xxh128: Callable[[bytes], BlockHash] = xxhash.xxh3_128_digest
        return xxh128
    raise ValueError(
        f"hash_algo {algo!r} is not supported; expected one of {', '.join(HASH_ALGOS)}"
    )


def root_hash(hash_fn: Callable[[bytes], BlockHash], seed: bytes | int | None) -> BlockHash:
    """Return ``H_{-1}``, the parent of every first block.

    ``seed=None`` uses 32 random bytes drawn once per process, so hashes agree within a process
    but differ between processes (a cached block cannot be guessed from outside). Pass a seed
    for hashes reproducible across processes.
    """
    if seed is None:
        seed_bytes = _process_seed()
    elif isinstance(seed, bool):
        raise TypeError("hash_seed must be bytes, an int or None, not a bool")
    elif isinstance(seed, int):
        seed_bytes = seed.to_bytes(max(1, (seed.bit_length() + 8) // 8), "little", signed=True)
    elif isinstance(seed, bytes):
        seed_bytes = seed
    else:
        raise TypeError(f"hash_seed must be bytes, an int or None, got {type(seed).__name__}")
    return hash_fn(_DOMAIN + b"/root" + _U32.pack(len(seed_bytes)) + seed_bytes)


_PROCESS_SEED: list[bytes] = []


def _process_seed() -> bytes:
    if not _PROCESS_SEED:
        _PROCESS_SEED.append(os.urandom(32))
    return _PROCESS_SEED[0]


_PACKERS: dict[int, struct.Struct] = {}


def _pack_tokens(tokens: Sequence[int]) -> bytes:
    n = len(tokens)
    packer = _PACKERS.get(n)
    if packer is None:
        packer = _PACKERS.setdefault(n, struct.Struct(f"<I{n}q"))
    return packer.pack(n, *tokens)


def encode_block(
    parent: BlockHash, tokens: Sequence[int], extra_keys: Sequence[ExtraKey] = ()
) -> bytes:
    """Canonical bytes of one block: parent, tokens, tagged extra keys (all length-prefixed)."""
    parts = [_U32.pack(len(parent)), parent, _pack_tokens(tokens), _U32.pack(len(extra_keys))]
    for tag, payload in extra_keys:
        parts.append(tag)
        parts.append(_U32.pack(len(payload)))
        parts.append(payload)
    return b"".join(parts)


def hash_block_tokens(
    hash_fn: Callable[[bytes], BlockHash],
    parent: BlockHash,
    tokens: Sequence[int],
    extra_keys: Sequence[ExtraKey] = (),
) -> BlockHash:
    """Hash one block: ``h(parent, tokens, extra_keys)``."""
    return hash_fn(encode_block(parent, tokens, extra_keys))


def block_extra_keys(
    start: int,
    end: int,
    *,
    lora_name: str | None,
    cache_salt: str | None,
    mm_spans: Sequence[MultiModalSpan] = (),
) -> list[ExtraKey]:
    """Extra keys of the block covering token positions ``[start, end)``.

    The LoRA name enters every block; the cache salt only the first (``start == 0``), which is
    enough because every later hash chains through it; a multimodal item enters each block that
    overlaps it, with its content hash and its offset in the prompt.
    """
    keys: list[ExtraKey] = []
    if lora_name is not None:
        keys.append((TAG_LORA, lora_name.encode()))
    for span in mm_spans:
        if span.offset < end and span.offset + span.length > start:
            payload = _MM_OFFSET.pack(span.offset) + span.content_hash.encode()
            keys.append((TAG_MULTIMODAL, payload))
    if cache_salt is not None and start == 0:
        keys.append((TAG_SALT, cache_salt.encode()))
    return keys


class _HashableRequest(Protocol):
    @property
    def all_token_ids(self) -> Sequence[int]: ...

    @property
    def num_prompt_tokens(self) -> int: ...

    cache_salt: str | None
    lora_name: str | None


class BlockHasher:
    """Hashes requests' full blocks for one block size, incrementally.

    Keeps, per request id, the hashes computed so far; `hashes` hashes only the blocks completed
    since the last call. Call `forget` when a request is freed.
    """

    __slots__ = ("_cache", "_hash_fn", "_root", "block_size")

    def __init__(
        self, block_size: int, hash_fn: Callable[[bytes], BlockHash], root: BlockHash
    ) -> None:
        self.block_size = block_size
        self._hash_fn = hash_fn
        self._root = root
        self._cache: dict[str, list[BlockHash]] = {}

    def hashes(self, request_id: str, request: _HashableRequest) -> list[BlockHash]:
        """Return the hashes of all full blocks of ``request`` (the list is shared: don't mutate).

        Parameters
        ----------
        request_id : str
            Key of the per-request cache.
        request : KVRequest-like
            Supplies ``all_token_ids``, ``num_prompt_tokens``, ``lora_name``, ``cache_salt``
            and optionally ``mm_spans`` (a sequence of `MultiModalSpan`) and ``prompt_bytes``
            (its prompt's ids packed as little-endian int64, as the engine's prompt check
            leaves them: blocks inside the prompt are then sliced from it, not packed again).
        """
        hashes = self._cache.get(request_id)
        if hashes is None:
            hashes = self._cache[request_id] = []
        tokens = request.all_token_ids
        bs = self.block_size
        num_full = len(tokens) // bs
        if len(hashes) >= num_full:
            return hashes
        lora = request.lora_name
        salt = request.cache_salt
        spans: Sequence[MultiModalSpan] = getattr(request, "mm_spans", None) or ()
        hash_fn = self._hash_fn
        parent = hashes[-1] if hashes else self._root
        first = len(hashes)
        width = 8 * bs
        prompt_bytes = getattr(request, "prompt_bytes", None)
        if (
            prompt_bytes is not None
            and num_full * bs <= request.num_prompt_tokens
            and len(prompt_bytes) == 8 * request.num_prompt_tokens
        ):
            # Packed already (little-endian int64) when the prompt was checked.
            packed = prompt_bytes[first * width : num_full * width]
        else:
            # Pack all newly completed blocks at once (C speed), then slice per block.
            new_tokens = array("q", tokens[first * bs : num_full * bs])
            if not _LITTLE_ENDIAN:  # pragma: no cover - big-endian hosts
                new_tokens.byteswap()
            packed = new_tokens.tobytes()
        head = _U32.pack(len(parent))  # every parent has the same length
        count = _U32.pack(bs)
        no_extra = _U32.pack(0)
        if lora is None and not spans and (salt is None or first > 0):
            # No extra keys in any new block (the common case): the tightest loop, since a
            # request's first schedule hashes its whole prompt inside its time to first token.
            append = hashes.append
            if hash_fn is _sha256_digest:
                # The default: no Python call per block, and each block's hash starts from a
                # copy of one holding the constant head (cheaper than a new OpenSSL
                # context); the bytes hashed are the same.
                start_with_head = _sha256(head).copy
                for off in range(0, (num_full - first) * width, width):
                    h = start_with_head()
                    h.update(parent + count + packed[off : off + width] + no_extra)
                    parent = h.digest()
                    append(parent)
                return hashes
            for off in range(0, (num_full - first) * width, width):
                parent = hash_fn(head + parent + count + packed[off : off + width] + no_extra)
                append(parent)
            return hashes
        for i in range(first, num_full):
            start = i * bs
            body = packed[(i - first) * width : (i - first + 1) * width]
            if lora is None and not spans and (salt is None or start > 0):
                data = head + parent + count + body + no_extra
            else:
                extra = block_extra_keys(
                    start, start + bs, lora_name=lora, cache_salt=salt, mm_spans=spans
                )
                data = encode_block(parent, tokens[start : start + bs], extra)
            parent = hash_fn(data)
            hashes.append(parent)
        return hashes

    def forget(self, request_id: str) -> None:
        """Drop the cached hashes of ``request_id`` (no error if unknown)."""
        self._cache.pop(request_id, None)

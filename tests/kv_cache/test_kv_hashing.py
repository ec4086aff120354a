"""Block hashing: canonical encoding, chaining, seeds, tagged extra keys, incremental hashing."""

from __future__ import annotations

import hashlib
import struct
import subprocess
import sys

import pytest
from kv_fakes import FakeRequest

from pagedcore.kv_cache.hashing import (
    TAG_LORA,
    TAG_SALT,
    BlockHasher,
    MultiModalSpan,
    block_extra_keys,
    encode_block,
    hash_block_tokens,
    make_hash_function,
    root_hash,
)

SHA = make_hash_function("sha256")


def test_encoding_is_canonical_bytes() -> None:
    # Exactly: len(parent) u32, parent, n u32, n int64 tokens, num_extra u32, tag, u32 len, payload.
    got = encode_block(b"pp", [1, -2, 2**40], [(TAG_LORA, b"x")])
    want = (
        struct.pack("<I", 2) + b"pp" + struct.pack("<I3q", 3, 1, -2, 2**40)
        + struct.pack("<I", 1) + b"L" + struct.pack("<I", 1) + b"x"
    )
    assert got == want
    assert hash_block_tokens(SHA, b"pp", [1, -2, 2**40], [(TAG_LORA, b"x")]) == hashlib.sha256(
        want
    ).digest()


def test_chain_covers_parent_and_every_token() -> None:
    root = root_hash(SHA, 7)
    h0 = hash_block_tokens(SHA, root, [1, 2, 3, 4])
    assert h0 == hash_block_tokens(SHA, root, [1, 2, 3, 4])
    assert h0 != hash_block_tokens(SHA, root, [1, 2, 3, 5])
    assert h0 != hash_block_tokens(SHA, root_hash(SHA, 8), [1, 2, 3, 4])
    # Same tokens in block 1 but different block 0 -> different block 1 hash.
    a = hash_block_tokens(SHA, h0, [9, 9, 9, 9])
    b = hash_block_tokens(SHA, hash_block_tokens(SHA, root, [0, 2, 3, 4]), [9, 9, 9, 9])
    assert a != b
    # Length-prefixing: moving a token between parent/tokens boundaries cannot collide.
    assert hash_block_tokens(SHA, b"", [1]) != hash_block_tokens(SHA, b"\x01", [])


def test_seed_reproducible_and_random_by_default() -> None:
    assert root_hash(SHA, 123) == root_hash(SHA, 123)
    assert root_hash(SHA, b"abc") == root_hash(SHA, b"abc")
    assert root_hash(SHA, 123) != root_hash(SHA, 124)
    # No seed: random per process (same within one, different across processes).
    assert root_hash(SHA, None) == root_hash(SHA, None)
    code = (
        "from pagedcore.kv_cache.hashing import make_hash_function as m, root_hash as r;"
        "print(r(m('sha256'), None).hex())"
    )
    runs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True).stdout for _ in range(2)}
    assert len(runs) == 2
    with pytest.raises(TypeError, match="hash_seed"):
        root_hash(SHA, 1.5)  # type: ignore[arg-type]


def test_xxhash_is_128_bit_and_differs_from_sha() -> None:
    pytest.importorskip("xxhash")
    xx = make_hash_function("xxhash")
    assert len(xx(b"abc")) == 16 and len(SHA(b"abc")) == 32
    assert xx(b"abc") == xx(b"abc") != xx(b"abd")


def test_unknown_algo_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="sha256, xxhash"):
        make_hash_function("md5")


def test_extra_keys_are_tagged_by_source() -> None:
    lora = block_extra_keys(0, 4, lora_name="x", cache_salt=None)
    salt = block_extra_keys(0, 4, lora_name=None, cache_salt="x")
    assert lora == [(TAG_LORA, b"x")] and salt == [(TAG_SALT, b"x")]
    root = root_hash(SHA, 0)
    assert hash_block_tokens(SHA, root, [1], lora) != hash_block_tokens(SHA, root, [1], salt)
    # The salt enters the first block only; the LoRA name every block.
    assert block_extra_keys(4, 8, lora_name=None, cache_salt="x") == []
    assert block_extra_keys(4, 8, lora_name="x", cache_salt="x") == [(TAG_LORA, b"x")]


def test_multimodal_span_enters_overlapping_blocks_only() -> None:
    span = MultiModalSpan(offset=6, length=4, content_hash="img")  # positions 6..9
    keys = [block_extra_keys(s, s + 4, lora_name=None, cache_salt=None, mm_spans=[span])
            for s in (0, 4, 8, 12)]
    assert [len(k) for k in keys] == [0, 1, 1, 0]
    other = MultiModalSpan(offset=6, length=4, content_hash="img2")
    assert keys[1] != block_extra_keys(4, 8, lora_name=None, cache_salt=None, mm_spans=[other])


def test_hasher_is_incremental_and_matches_direct_chain() -> None:
    calls: list[bytes] = []

    def counting(data: bytes) -> bytes:
        calls.append(data)
        return SHA(data)

    root = root_hash(SHA, 5)
    hasher = BlockHasher(4, counting, root)
    req = FakeRequest("r", list(range(10)), cache_salt="s")
    first = list(hasher.hashes("r", req))
    assert len(first) == 2 and len(calls) == 2
    req.output = [10, 11, 12]  # 13 tokens -> 3 full blocks: only one new hash
    again = hasher.hashes("r", req)
    assert again[:2] == first and len(again) == 3 and len(calls) == 3
    # Direct chain with the salt in block 0 only.
    h0 = hash_block_tokens(SHA, root, [0, 1, 2, 3], [(TAG_SALT, b"s")])
    h1 = hash_block_tokens(SHA, h0, [4, 5, 6, 7])
    h2 = hash_block_tokens(SHA, h1, [8, 9, 10, 11])
    assert again == [h0, h1, h2]
    hasher.forget("r")
    hasher.hashes("r", req)
    assert len(calls) == 6
    # Without extra keys (the packed fast path) the chain is the same encoding.
    plain = BlockHasher(4, SHA, root).hashes("p", FakeRequest("p", [2**40, -1, 3, 4, 5]))
    assert plain == [hash_block_tokens(SHA, root, [2**40, -1, 3, 4])]
    many = BlockHasher(4, SHA, root).hashes("m", FakeRequest("m", list(range(13))))
    chain = [root]
    for b in range(3):
        chain.append(hash_block_tokens(SHA, chain[-1], list(range(4 * b, 4 * b + 4))))
    assert many == chain[1:]


@pytest.mark.parametrize("algo", ["sha256", "xxhash"])
@pytest.mark.parametrize("salt", [None, "s"])
def test_hasher_prompt_bytes_give_the_same_hashes(algo: str, salt: str | None) -> None:
    # `prompt_bytes` (the engine's packed prompt) only saves packing: the hashes are the ones
    # the token list gives, in every block, whether or not it lies inside the prompt.
    if algo == "xxhash":
        pytest.importorskip("xxhash")
    from array import array

    fn = make_hash_function(algo)
    root = root_hash(fn, 3)
    prompt = [2**40, -1, *range(3, 40)]  # 39 tokens: 9 full blocks of 4, 3 left over
    plain = FakeRequest("a", prompt, cache_salt=salt)
    packed = FakeRequest("b", prompt, cache_salt=salt)
    packed.prompt_bytes = array("q", prompt).tobytes()  # type: ignore[attr-defined]
    ha, hb = BlockHasher(4, fn, root), BlockHasher(4, fn, root)
    assert hb.hashes("b", packed) == ha.hashes("a", plain)
    assert len(ha.hashes("a", plain)) == 9
    for extra in ([7], [8, 9, 10, 11, 12]):  # blocks across and past the prompt's end
        plain.output += extra
        packed.output += extra
        assert hb.hashes("b", packed) == ha.hashes("a", plain)
    chain = [root]
    tokens = plain.all_token_ids
    for b in range(len(tokens) // 4):
        keys = [(TAG_SALT, b"s")] if salt is not None and b == 0 else []
        chain.append(hash_block_tokens(fn, chain[-1], tokens[4 * b : 4 * b + 4], keys))
    assert ha.hashes("a", plain) == chain[1:]
    # Bytes that do not match the prompt's length are not used.
    wrong = FakeRequest("c", prompt, cache_salt=salt)
    wrong.prompt_bytes = b"\0" * 8  # type: ignore[attr-defined]
    assert BlockHasher(4, fn, root).hashes("c", wrong) == chain[1:10]


def test_sha256_block_hashes_are_pinned() -> None:
    # The default algorithm's chain, byte for byte (prefix-cache keys must not drift).
    root = root_hash(SHA, 11)
    got = BlockHasher(2, SHA, root).hashes("p", FakeRequest("p", [5, 6, 7, 8, 9]))
    h0 = hashlib.sha256(struct.pack("<I", 32) + root + struct.pack("<I2q", 2, 5, 6)
                        + struct.pack("<I", 0)).digest()
    h1 = hashlib.sha256(struct.pack("<I", 32) + h0 + struct.pack("<I2q", 2, 7, 8)
                        + struct.pack("<I", 0)).digest()
    assert got == [h0, h1]

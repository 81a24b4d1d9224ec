"""Stable, chained content hashes of full KV blocks: the keys of the prefix cache.

A block's KV depends on every token before it, not only on its own tokens, so
block i is keyed by H(key of block i-1, tokens of block i): two blocks share a
key only when the whole prefix up to and including them is identical.

sha256 over a fixed byte encoding keeps keys identical across processes and
restarts (Python's hash() is salted per process and would not be).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

BlockHash = bytes

# Parent of a sequence's first block. Same length as every real digest, so the byte string fed to sha256 always
# splits the same way into parent and tokens.
ROOT_BLOCK_HASH: BlockHash = bytes(hashlib.sha256().digest_size)


def hash_block_tokens(parent_hash: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    """Key of a block: sha256(parent_hash || token ids as little-endian uint64)."""
    if len(parent_hash) != len(ROOT_BLOCK_HASH):
        raise ValueError(f"parent_hash must be {len(ROOT_BLOCK_HASH)} bytes, got {len(parent_hash)}.")
    digest = hashlib.sha256(parent_hash)
    # uint64: wide enough for any vocabulary; struct rejects negative ids.
    digest.update(struct.pack(f"<{len(token_ids)}Q", *token_ids))
    return digest.digest()


def hash_full_blocks(
    token_ids: Sequence[int], block_size: int, num_blocks: int, parent_hash: BlockHash = ROOT_BLOCK_HASH
) -> list[BlockHash]:
    """Chained keys of the first num_blocks full blocks of token_ids."""
    if num_blocks * block_size > len(token_ids):
        raise ValueError(f"{num_blocks} blocks of {block_size} tokens do not fit in {len(token_ids)} tokens.")
    hashes: list[BlockHash] = []
    for index in range(num_blocks):
        parent_hash = hash_block_tokens(parent_hash, token_ids[index * block_size : (index + 1) * block_size])
        hashes.append(parent_hash)
    return hashes

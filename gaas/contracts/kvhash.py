"""GaaS's prefix-block hashes: the one definition the router (which hashes each prompt) and the
KV directory (which hashes the blocks the engines report, from their token ids) share, so the two
cannot silently disagree the way an engine's own hashes and a router's reimplementation can.

A block's hash chains its parent's with the block's token ids; the chain's root is keyed by the
tenant's cache salt and the LoRA adapter, so a tenant's blocks never match another tenant's prompt
(and an adapter's never match the base model's). Only full blocks are hashed: a partial block is
never shared by the engine either.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from typing import NewType

BlockHash = NewType("BlockHash", int)

_DIGEST = 8  # 64-bit hashes: a collision needs ~4e9 blocks in one chain position


def _h(data: bytes) -> BlockHash:
    return BlockHash(int.from_bytes(hashlib.blake2b(data, digest_size=_DIGEST).digest(), "little"))


def public_salt(prefix_id: str) -> str:
    """The cache salt of prompts that begin with a public prefix (every tenant's alike): the router
    salts them so, and a new worker primes the prefix's blocks under it."""
    return f"public:{prefix_id}"


def root(cache_salt: str, lora: str = "") -> BlockHash:
    """The chain's root: what the first block's hash builds on."""
    return _h(b"gaas-kv-root\0" + cache_salt.encode("utf-8", "surrogatepass") + b"\0" + lora.encode("utf-8", "surrogatepass"))


def block(parent: int, token_ids: Sequence[int]) -> BlockHash:
    """The hash of a full block of token_ids whose predecessor hashed to parent (or a root)."""
    return _h(parent.to_bytes(_DIGEST, "little") + array("I", token_ids).tobytes())


def chain(parent: int, token_ids: Sequence[int], block_size: int) -> list[BlockHash]:
    """Hashes of the full blocks of token_ids, continuing the chain at parent (what block() gives,
    block after block)."""
    data = array("I", token_ids).tobytes()
    width = 4 * block_size
    out: list[BlockHash] = []
    for start in range(0, len(data) - width + 1, width):
        parent = _h(parent.to_bytes(_DIGEST, "little") + data[start : start + width])
        out.append(BlockHash(parent))
    return out


def prefix_hashes(token_ids: Sequence[int], block_size: int, cache_salt: str, lora: str = "") -> list[BlockHash]:
    """Hashes of a prompt's full blocks, in order: what a prefix lookup asks the directory for."""
    return chain(root(cache_salt, lora), token_ids, block_size)

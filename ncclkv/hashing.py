"""Stable chained block hashes for prefix matching across processes and hosts.

The contract is that of vLLM's ``hash_block_tokens`` / ``hash_request_tokens``
(a block's hash covers its tokens and, through its parent, every earlier
block), but the value is the same in every process and on every host, unlike
Python's per-process salted ``hash()``.

Encoding, version 1 (enough for another implementation to reproduce it).
All integers are little-endian; ``u64`` is unsigned, ``i64`` two's complement::

    message = b"ncclkv-block-v1"                       # 15 ASCII bytes, domain + version
            + parent                                  # b"\\x00" (first block), or
                                                      # b"\\x01" + parent digest (32 bytes)
            + u64(len(token_ids)) + u64(t) for t in token_ids
            + u64(len(extra_keys)) + key(k) for k in extra_keys
    key(None)    = b"N"
    key(int k)   = b"I" + i64(k)                      # -2**63 <= k < 2**63
    key(str k)   = b"S" + u64(len(utf8)) + utf8       # utf8 = k.encode("utf-8", "surrogatepass")
    key(bytes k) = b"B" + u64(len(k)) + k
    digest = sha256(message)                          # full 32 bytes, not truncated

``extra_keys=None`` and ``extra_keys=()`` encode the same (count 0). Token ids
are ints in ``[0, 2**64)``; ``bool`` is refused so ``True`` never hashes as
token 1. Extra keys carry what else makes KV differ for equal tokens: a cache
salt, a LoRA adapter id or name, a multimodal input hash.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "DIGEST_SIZE",
    "BlockHash",
    "ExtraKey",
    "ExtraKeys",
    "as_token_ids",
    "hash_block_tokens",
    "hash_request_tokens",
]

DIGEST_SIZE = 32
_DOMAIN = b"ncclkv-block-v1"
_NO_PARENT = b"\x00"
_HAS_PARENT = b"\x01"
_U64 = struct.Struct("<Q")
_I64 = struct.Struct("<q")

ExtraKey = int | str | bytes | None
ExtraKeys = tuple[ExtraKey, ...]


@dataclass(frozen=True, slots=True)
class BlockHash:
    """The sha256 digest (32 bytes) of one block given its parent chain."""

    digest: bytes

    def __post_init__(self) -> None:
        if not isinstance(self.digest, bytes):
            raise TypeError(f"BlockHash.digest must be bytes, got {type(self.digest).__name__}")
        if len(self.digest) != DIGEST_SIZE:
            raise ValueError(f"BlockHash.digest must be {DIGEST_SIZE} bytes, got {len(self.digest)}")

    @classmethod
    def from_hex(cls, text: str) -> BlockHash:
        try:
            return cls(bytes.fromhex(text))
        except ValueError as exc:
            raise ValueError(f"not a {DIGEST_SIZE}-byte hex digest: {text!r} ({exc})") from None

    def hex(self) -> str:
        return self.digest.hex()

    def __bytes__(self) -> bytes:
        return self.digest

    def __repr__(self) -> str:
        return f"BlockHash({self.digest[:8].hex()}…)"


def as_token_ids(token_ids: Sequence[int], what: str = "token_ids") -> tuple[int, ...]:
    """Validate token ids and return them as a tuple of Python ints.

    Accepts any sequence of ints, or an object with ``tolist()`` (a 1-D numpy
    array or torch tensor of integers). Raises TypeError for non-integers
    (bools, floats, str, bytes, nested lists) and ValueError for negative or
    too-large ids, naming ``what``, the first bad index and its value.
    """
    return tuple(_native_token_array(token_ids, what))


def _native_token_array(token_ids: Sequence[int], what: str) -> array:
    if isinstance(token_ids, (str, bytes, bytearray, memoryview)):
        # array() would silently reinterpret raw bytes as machine integers.
        raise TypeError(f"{what} must be a sequence of ints, got {type(token_ids).__name__}")
    seq: object = token_ids
    if not isinstance(seq, (list, tuple)):
        if hasattr(seq, "tolist"):
            seq = seq.tolist()
        else:
            try:
                seq = list(seq)  # type: ignore[call-overload]
            except TypeError:
                raise TypeError(f"{what} must be a sequence of ints, got {type(token_ids).__name__}") from None
    try:
        ids = array("Q", seq)  # type: ignore[arg-type]
    except (TypeError, OverflowError, ValueError):
        _raise_bad_token(seq, what)
        raise  # not reached for lists; keeps the original error for anything odder
    # array() takes anything with __index__: a bool, or a 0-d bool tensor or array, would hash as 0 or 1.
    if set(map(type, seq)) - {int} and any(map(_is_boolean, seq)):  # type: ignore[call-overload]
        _raise_bad_token(seq, what)
    return ids


def _wire_token_array(token_ids: Sequence[int]) -> array:
    """Validated token ids as u64 in little-endian byte order (the hashed encoding)."""
    ids = _native_token_array(token_ids, "token_ids")
    if sys.byteorder == "big":
        ids.byteswap()
    return ids


def _is_boolean(token: object) -> bool:
    """A bool, or a numpy or torch scalar of a bool dtype: never a token id, though it has ``__index__``."""
    return isinstance(token, bool) or str(getattr(token, "dtype", "")).endswith("bool")


def _raise_bad_token(token_ids: object, what: str) -> None:
    """Raise the error naming the first bad token of a list (called only on failure)."""
    if not isinstance(token_ids, (list, tuple)):
        raise TypeError(f"{what} must be a sequence of ints, got {type(token_ids).__name__} {token_ids!r}")
    for index, token in enumerate(token_ids):
        if _is_boolean(token) or not hasattr(token, "__index__"):
            raise TypeError(f"{what}[{index}] must be an int, got {type(token).__name__} {token!r}")
        try:
            value = token.__index__()
        except TypeError:  # an __index__ that refuses (a float or multi-element tensor): no int either
            raise TypeError(f"{what}[{index}] must be an int, got {type(token).__name__} {token!r}") from None
        if not 0 <= value < 2**64:
            raise ValueError(f"{what}[{index}]={value} is not a token id in [0, 2**64)")


def _encode_extra_keys(extra_keys: ExtraKeys | None) -> bytes:
    if extra_keys is None:
        return _U64.pack(0)
    if not isinstance(extra_keys, tuple):
        raise TypeError(f"extra_keys must be a tuple or None, got {type(extra_keys).__name__} {extra_keys!r}")
    parts = [_U64.pack(len(extra_keys))]
    for index, key in enumerate(extra_keys):
        if key is None:
            parts.append(b"N")
        elif isinstance(key, bool):
            raise TypeError(f"extra_keys[{index}]={key!r}: bool is ambiguous, use an int or str")
        elif isinstance(key, int):
            if not -(2**63) <= key < 2**63:
                raise ValueError(f"extra_keys[{index}]={key} does not fit in a signed 64-bit int")
            parts.append(b"I" + _I64.pack(key))
        elif isinstance(key, str):
            data = key.encode("utf-8", "surrogatepass")  # a lone surrogate (vLLM takes such a cache_salt) too
            parts.append(b"S" + _U64.pack(len(data)) + data)
        elif isinstance(key, bytes):
            parts.append(b"B" + _U64.pack(len(key)) + key)
        else:
            raise TypeError(f"extra_keys[{index}] must be int, str, bytes or None, got {type(key).__name__} {key!r}")
    return b"".join(parts)


def _parent_bytes(parent: BlockHash | None) -> bytes:
    if parent is None:
        return _NO_PARENT
    if not isinstance(parent, BlockHash):
        raise TypeError(f"parent must be a BlockHash or None, got {type(parent).__name__} {parent!r}")
    return _HAS_PARENT + parent.digest


def _digest(parent: bytes, tokens: memoryview | array, num_tokens: int, extra: bytes) -> BlockHash:
    state = hashlib.sha256(_DOMAIN)
    state.update(parent)
    state.update(_U64.pack(num_tokens))
    state.update(tokens)
    state.update(extra)
    return BlockHash(state.digest())


def hash_block_tokens(
    parent: BlockHash | None,
    token_ids: Sequence[int],
    extra_keys: ExtraKeys | None = None,
) -> BlockHash:
    """Hash one block: its parent's hash (None for the first block), its tokens and extra keys.

    The block may have any length >= 1 (vLLM hashes only full blocks; that is
    :func:`hash_request_tokens`' job). See the module docstring for the encoding.
    """
    parent_bytes = _parent_bytes(parent)
    ids = _wire_token_array(token_ids)
    if len(ids) == 0:
        raise ValueError("token_ids of a block must not be empty")
    return _digest(parent_bytes, ids, len(ids), _encode_extra_keys(extra_keys))


def hash_request_tokens(
    block_size: int,
    token_ids: Sequence[int],
    extra_keys: ExtraKeys | None = None,
) -> list[BlockHash]:
    """Chained hashes of every full block of a request; a partial last block is not hashed.

    ``extra_keys`` apply to every block, so element ``i`` equals
    ``hash_block_tokens(element[i-1] or None, token_ids[i*B:(i+1)*B], extra_keys)``.
    The hashes of a prefix of ``token_ids`` are a prefix of these hashes.
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int):
        raise TypeError(f"block_size must be an int, got {type(block_size).__name__} {block_size!r}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    ids = _wire_token_array(token_ids)
    extra = _encode_extra_keys(extra_keys)
    view = memoryview(ids)
    hashes: list[BlockHash] = []
    parent = _NO_PARENT
    for start in range(0, len(ids) - block_size + 1, block_size):
        block_hash = _digest(parent, view[start : start + block_size], block_size, extra)
        hashes.append(block_hash)
        parent = _HAS_PARENT + block_hash.digest
    return hashes

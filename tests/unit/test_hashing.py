"""Stable chained block hashes: known answers, cross-process stability, chaining laws, bad input."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ncclkv.hashing import (
    DIGEST_SIZE,
    BlockHash,
    as_token_ids,
    hash_block_tokens,
    hash_request_tokens,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
VECTORS = Path(__file__).resolve().parent / "data" / "hash_vectors.json"


# An independent, deliberately plain re-implementation written from the module
# docstring alone: the vectors file was produced with it, and the property test
# below checks the library against it on random inputs.
def _ref_key(key: object) -> bytes:
    if key is None:
        return b"N"
    if isinstance(key, int):
        return b"I" + struct.pack("<q", key)
    if isinstance(key, str):
        data = key.encode("utf-8")
        return b"S" + struct.pack("<Q", len(data)) + data
    assert isinstance(key, bytes)
    return b"B" + struct.pack("<Q", len(key)) + key


def _ref_chain(block_size: int, tokens: list[int], extra: tuple | None) -> list[str]:
    out: list[str] = []
    parent: bytes | None = None
    for start in range(0, len(tokens) - block_size + 1, block_size):
        block = tokens[start : start + block_size]
        msg = b"ncclkv-block-v1" + (b"\x00" if parent is None else b"\x01" + parent)
        msg += struct.pack("<Q", len(block)) + b"".join(struct.pack("<Q", t) for t in block)
        keys = extra or ()
        msg += struct.pack("<Q", len(keys)) + b"".join(_ref_key(k) for k in keys)
        parent = hashlib.sha256(msg).digest()
        out.append(parent.hex())
    return out


def _decode_extra(data: list | None) -> tuple | None:
    if data is None:
        return None
    out: list = []
    for item in data:
        if item is None:
            out.append(None)
        elif "int" in item:
            out.append(item["int"])
        elif "str" in item:
            out.append(item["str"])
        else:
            out.append(bytes.fromhex(item["bytes_hex"]))
    return tuple(out)


tokens_st = st.lists(st.integers(0, 2**64 - 1), max_size=40)
extra_st = st.none() | st.tuples() | st.lists(
    st.none() | st.integers(-(2**63), 2**63 - 1) | st.text(max_size=5) | st.binary(max_size=5), max_size=3
).map(tuple)


def test_known_answer_vectors() -> None:
    vectors = json.loads(VECTORS.read_text())["vectors"]
    assert len(vectors) >= 5
    for case in vectors:
        extra = _decode_extra(case["extra_keys"])
        got = [h.hex() for h in hash_request_tokens(case["block_size"], case["token_ids"], extra)]
        assert got == case["hashes"], case["name"]
        assert _ref_chain(case["block_size"], case["token_ids"], extra) == case["hashes"], case["name"]


@settings(max_examples=60, deadline=None)
@given(block_size=st.integers(1, 6), tokens=tokens_st, extra=extra_st)
def test_matches_the_documented_encoding(block_size: int, tokens: list[int], extra: tuple | None) -> None:
    got = [h.hex() for h in hash_request_tokens(block_size, tokens, extra)]
    assert got == _ref_chain(block_size, tokens, extra)


def test_same_values_in_other_processes_with_other_hash_seeds() -> None:
    script = (
        "from ncclkv.hashing import hash_request_tokens\n"
        "print(hash(('salt', 1)))\n"
        "for h in hash_request_tokens(3, list(range(10)), ('salt', 1, b'x')): print(h.hex())\n"
    )
    outputs = []
    for seed in ("1", "4242"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        proc = subprocess.run(
            [sys.executable, "-c", script], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=60, check=True
        )
        outputs.append(proc.stdout.split())
    assert outputs[0][0] != outputs[1][0], "the two processes should salt Python's hash() differently"
    here = [h.hex() for h in hash_request_tokens(3, list(range(10)), ("salt", 1, b"x"))]
    assert outputs[0][1:] == here and outputs[1][1:] == here and len(here) == 3


def test_partial_last_block_is_not_hashed() -> None:
    assert len(hash_request_tokens(4, list(range(11)))) == 2
    assert hash_request_tokens(4, [1, 2, 3]) == []
    assert hash_request_tokens(4, []) == []
    assert hash_request_tokens(4, list(range(11))) == hash_request_tokens(4, list(range(8)))


@settings(max_examples=60, deadline=None)
@given(block_size=st.integers(1, 5), tokens=tokens_st, cut=st.integers(0, 40), extra=extra_st)
def test_prefix_stability(block_size: int, tokens: list[int], cut: int, extra: tuple | None) -> None:
    full = hash_request_tokens(block_size, tokens, extra)
    prefix = hash_request_tokens(block_size, tokens[:cut], extra)
    assert full[: len(prefix)] == prefix
    assert len(prefix) == min(cut, len(tokens)) // block_size


def test_chain_equals_block_by_block() -> None:
    tokens = list(range(100, 117))
    chain = hash_request_tokens(5, tokens, ("s",))
    parent = None
    for index, got in enumerate(chain):
        parent = hash_block_tokens(parent, tokens[index * 5 : index * 5 + 5], ("s",))
        assert got == parent
    assert len(chain) == 3


@pytest.mark.parametrize("block", [0, 1, 2, 3])
def test_changed_token_changes_that_block_and_later_only(block: int) -> None:
    tokens = list(range(16))
    changed = list(tokens)
    changed[block * 4 + 2] += 1000
    before, after = hash_request_tokens(4, tokens), hash_request_tokens(4, changed)
    assert before[:block] == after[:block]
    assert all(b != a for b, a in zip(before[block:], after[block:], strict=True))


def _chain(blocks: list[list[int]], extras: list[tuple | None]) -> list[BlockHash]:
    out: list[BlockHash] = []
    parent = None
    for block, extra in zip(blocks, extras, strict=True):
        parent = hash_block_tokens(parent, block, extra)
        out.append(parent)
    return out


def test_moved_block_boundary_changes_that_block_and_later_only() -> None:
    tokens = list(range(12))
    base = _chain([tokens[0:4], tokens[4:8], tokens[8:12]], [None] * 3)
    moved = _chain([tokens[0:4], tokens[4:9], tokens[9:12]], [None] * 3)
    assert base[0] == moved[0]
    assert base[1] != moved[1] and base[2] != moved[2]
    # The same tokens in one block of 8 and in two blocks of 4 differ too.
    assert hash_request_tokens(8, tokens[:8])[0] != hash_request_tokens(4, tokens[:8])[1]


@pytest.mark.parametrize("block", [0, 1, 2])
def test_changed_extra_key_changes_that_block_and_later_only(block: int) -> None:
    blocks = [[1, 2], [3, 4], [5, 6]]
    extras: list[tuple | None] = [("salt", 1)] * 3
    changed = list(extras)
    changed[block] = ("salt", 2)
    before, after = _chain(blocks, extras), _chain(blocks, changed)
    assert before[:block] == after[:block]
    assert all(b != a for b, a in zip(before[block:], after[block:], strict=True))


def test_extra_keys_are_typed_and_ordered() -> None:
    tokens = [1, 2, 3]
    variants = [None, ("1",), (1,), (b"1",), ("a", "b"), ("b", "a"), ("ab",), ("a", None), (None,)]
    digests = {hash_block_tokens(None, tokens, v) for v in variants}
    assert len(digests) == len(variants)  # all distinct
    assert hash_block_tokens(None, tokens, ()) == hash_block_tokens(None, tokens, None)


def test_accepts_numpy_and_torch_token_arrays() -> None:
    want = hash_request_tokens(4, list(range(9)))
    assert hash_request_tokens(4, np.arange(9, dtype=np.int64)) == want
    assert hash_request_tokens(4, torch.arange(9)) == want
    assert hash_request_tokens(4, tuple(range(9))) == want
    assert hash_request_tokens(4, range(9)) == want
    assert as_token_ids(torch.tensor([5, 6])) == (5, 6)


def test_block_hash_value() -> None:
    value = hash_block_tokens(None, [1])
    assert len(value.digest) == DIGEST_SIZE == 32
    assert BlockHash.from_hex(value.hex()) == value
    assert bytes(value) == value.digest
    assert {value: 1}[BlockHash(value.digest)] == 1
    assert value.hex()[:16] in repr(value)
    with pytest.raises(ValueError, match="32 bytes, got 3"):
        BlockHash(b"abc")
    with pytest.raises(TypeError, match="must be bytes, got str"):
        BlockHash("ab" * 32)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="'zz'"):
        BlockHash.from_hex("zz")


@pytest.mark.parametrize(
    ("block_size", "tokens", "extra", "error", "match"),
    [
        (0, [1], None, ValueError, "block_size must be >= 1, got 0"),
        (-3, [1], None, ValueError, "got -3"),
        (1.5, [1], None, TypeError, "block_size must be an int, got float 1.5"),
        (True, [1], None, TypeError, "got bool True"),
        (2, [1, -7], None, ValueError, r"token_ids\[1\]=-7"),
        (2, [1, 2**64], None, ValueError, r"token_ids\[1\]=18446744073709551616"),
        (2, [1, 2.0], None, TypeError, r"token_ids\[1\] must be an int, got float 2.0"),
        (2, [True, 1], None, TypeError, r"token_ids\[0\] must be an int, got bool True"),
        (2, [1, torch.tensor(True)], None, TypeError, r"token_ids\[1\] must be an int, got Tensor"),
        # __index__ present but refusing (a float or multi-element tensor): named like any other non-int
        (2, [1, torch.tensor(1.5)], None, TypeError, r"token_ids\[1\] must be an int, got Tensor"),
        (2, [torch.tensor([1, 2]), 1], None, TypeError, r"token_ids\[0\] must be an int, got Tensor"),
        (2, [np.bool_(True), 1], None, TypeError, r"token_ids\[0\] must be an int, got bool"),
        (2, [1, None], None, TypeError, r"token_ids\[1\] must be an int, got NoneType"),
        (2, "abc", None, TypeError, "got str"),
        (2, b"\x01" * 16, None, TypeError, "got bytes"),
        (2, [[1, 2]], None, TypeError, r"token_ids\[0\] must be an int, got list"),
        (2, np.array([1.0, 2.0]), None, TypeError, "got float 1.0"),
        (2, 5, None, TypeError, "must be a sequence of ints, got int"),
        (2, [1, 2], ["salt"], TypeError, "extra_keys must be a tuple or None, got list"),
        (2, [1, 2], (True,), TypeError, r"extra_keys\[0\]=True"),
        (2, [1, 2], ("a", 1.5), TypeError, r"extra_keys\[1\] must be int, str, bytes or None, got float 1.5"),
        (2, [1, 2], (2**63,), ValueError, r"extra_keys\[0\]=9223372036854775808"),
    ],
)
def test_bad_input_is_named(block_size, tokens, extra, error, match) -> None:  # noqa: ANN001
    with pytest.raises(error, match=match):
        hash_request_tokens(block_size, tokens, extra)


def test_bad_block_input_is_named() -> None:
    with pytest.raises(ValueError, match="must not be empty"):
        hash_block_tokens(None, [])
    with pytest.raises(TypeError, match="parent must be a BlockHash or None, got bytes"):
        hash_block_tokens(b"\x00" * 32, [1])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"input_tokens\[2\]=-1"):
        as_token_ids([0, 1, -1], "input_tokens")


def test_a_lone_surrogate_in_extra_keys_hashes_as_its_three_bytes() -> None:
    """vLLM accepts a cache_salt with a lone surrogate (its own hashing pickles it); ours must not raise."""
    salted = hash_block_tokens(None, [1, 2], ("\ud800",))
    assert salted == hash_block_tokens(None, [1, 2], ("\ud800",)) != hash_block_tokens(None, [1, 2], ("\ud801",))
    assert hash_block_tokens(None, [1, 2], ("\u00e9",)) != salted  # valid strings keep their UTF-8

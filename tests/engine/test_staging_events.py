"""Staging events of the transfer engine: pushed KV that waits in a consumer's staging store.

Real engines (ZMQ channels, gloo links), every rank in this process, as in
test_engine_local.py. Each test checks what ``take_staging_events`` reports
against what the staging store really did: the hashes are recomputed here
with ncclkv.hashing, and the KV taken from staging is compared byte for byte.
"""

from __future__ import annotations

import threading
import time

import pytest

from ncclkv.engine import BlockTokens, EngineRef, StagingEvent
from ncclkv.errors import CapacityError, TransferError
from ncclkv.hashing import hash_request_tokens
from ncclkv.layout import KVGeometry, ParallelLayout, Span
from ncclkv.paged import CacheLayout

from .kvsim import RankSide, build_sides, close_sides, engine_ref, wait_sent

GQA = KVGeometry(num_layers=4, num_kv_heads=4, head_size=32, dtype="float32")
BLOCK = 16
KEYS = ("adapter-a", None)  # (LoRA name, cache salt), as the connector hashes them


def _engines(engine_id: str, layout: ParallelLayout, role: str, **config: object) -> list[RankSide]:
    return build_sides(engine_id, layout, GQA, CacheLayout.CPU, BLOCK, role, **config)


def _prompt(num_tokens: int, seed: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 50000 for i in range(num_tokens)]


def _push(prefill: list[RankSide], decode_ref: EngineRef, transfer_id: str, blocks: list[int], num_tokens: int,
          seed: int, named: BlockTokens | None, layers: int = GQA.num_layers) -> None:
    for side in prefill:
        side.fill(seed=seed, block_ids=blocks, num_tokens=num_tokens)
        side.engine.start_push(transfer_id, decode_ref, blocks, num_tokens, named)
        for layer in side.shard.layers:
            if layer < layers:
                side.engine.save_layer(transfer_id, layer)
        side.engine.finish(transfer_id)


def _wait_sent(prefill: list[RankSide], *transfer_ids: str, timeout_s: float = 20) -> list[BaseException | None]:
    """Every producer rank's outcome of each of ``transfer_ids``, rank by rank."""
    outcomes = []
    for side in prefill:
        finished = wait_sent(side, *transfer_ids, timeout_s=timeout_s)
        outcomes += [finished[t] for t in transfer_ids]
    return outcomes


def _events(side: RankSide, count: int, timeout_s: float = 20) -> list[StagingEvent]:
    """Poll until ``count`` events came (landing is asynchronous), then check that no more follow."""
    got: list[StagingEvent] = []
    deadline = time.monotonic() + timeout_s
    while len(got) < count:
        assert time.monotonic() < deadline, f"only {got} of {count} events within {timeout_s}s"
        side.engine.take_finished_receiving()  # expires staged pushes after hold_s
        got += side.engine.take_staging_events()
        threading.Event().wait(0.005)
    assert side.engine.take_staging_events() == []
    return got


def _check_stored(event: StagingEvent, transfer_id: str, prompt: list[int]) -> None:
    full = len(prompt) // BLOCK * BLOCK
    assert (event.kind, event.transfer_id, event.reason) == ("stored", transfer_id, None)
    assert event.token_ids == tuple(prompt[:full]) and event.block_size == BLOCK and event.extra_keys == KEYS
    assert list(event.block_hashes) == hash_request_tokens(BLOCK, prompt, KEYS)
    assert len(event.block_hashes) == len(prompt) // BLOCK


@pytest.mark.parametrize("piece_bytes", [0, 5000], ids=["whole", "pieces"])  # 5000 B: 4-9 tokens per piece
@pytest.mark.parametrize(("src", "dst"), [((1, 1), (1, 1)), ((2, 1), (2, 1)), ((1, 2), (2, 1))], ids=str)
def test_staged_push_is_stored_then_removed_when_taken(src: tuple[int, int], dst: tuple[int, int],
                                                       piece_bytes: int) -> None:
    """"stored" comes once every piece of every slice landed: one event, with the pieces counted per slice."""
    src_layout, dst_layout = ParallelLayout(*src), ParallelLayout(*dst)
    prefill = _engines("prefill", src_layout, "producer", piece_bytes=piece_bytes)
    decode = _engines("decode", dst_layout, "consumer")
    try:
        prompt, blocks, dst_blocks = _prompt(45, seed=1), [3, 1, 4], [0, 5, 9]  # two full blocks and a partial one
        _push(prefill, engine_ref("decode", dst_layout, decode), "x1", blocks, len(prompt), 5,
              BlockTokens.of_prompt(prompt, BLOCK, KEYS))
        assert _wait_sent(prefill, "x1") == [None] * len(prefill)  # all of it in staging: no blocks expected yet
        for side in decode:  # every consumer rank reports its own staging
            (stored,) = _events(side, 1)
            _check_stored(stored, "x1", prompt)
        for side in decode:
            side.engine.expect("x1", engine_ref("prefill", src_layout, prefill), dst_blocks, len(prompt), push=True)
            side.engine.wait("x1", timeout_s=20)
            assert side.mismatches(5, dst_blocks, len(prompt), Span(0, len(prompt))) == []
            (removed,) = _events(side, 1)
            assert (removed.kind, removed.reason) == ("removed", "taken")
            assert removed.block_hashes == stored.block_hashes and removed.transfer_id == "x1"
    finally:
        close_sides(prefill, decode)


def test_unexpected_push_expires_after_hold_s() -> None:
    layout = ParallelLayout(1, 1)
    prefill, decode = _engines("prefill", layout, "producer"), _engines("decode", layout, "consumer", hold_s=0.5)
    try:
        prompt = _prompt(64, seed=2)
        _push(prefill, engine_ref("decode", layout, decode), "x2", [0, 1, 2, 3], 64, 6,
              BlockTokens.of_prompt(prompt, BLOCK, KEYS))
        stored, removed = _events(decode[0], 2)
        _check_stored(stored, "x2", prompt)
        assert (removed.kind, removed.reason, removed.block_hashes) == ("removed", "expired", stored.block_hashes)
        # Gone from staging for real: a late decode request finds nothing to take.
        decode[0].engine.expect("x2", engine_ref("prefill", layout, prefill), [0, 1, 2, 3], 64, push=True)
        # Refused at once, naming the expiry: not left to wait hold_s for tensors that never come.
        with pytest.raises(TransferError, match=r"request 'x2': its push failed before it was expected: "
                                                r"push of 'x2' expired in staging after 0\.5s, not expected here"):
            decode[0].engine.wait("x2", timeout_s=5)
    finally:
        close_sides(prefill, decode)


def test_incomplete_or_refused_push_is_never_reported() -> None:
    layout = ParallelLayout(1, 1)
    prefill = _engines("prefill", layout, "producer")
    # 4 KiB of KV per token (4 layers): a 32-token push reserves 128 KiB, a 16-token one 64 KiB.
    decode = _engines("decode", layout, "consumer", hold_s=0.5, staging_bytes=200 * 1024)
    try:
        ref = engine_ref("decode", layout, decode)
        prompt = _prompt(64, seed=3)
        # Two of four layers, then finish: half the KV lands in staging, which never holds the whole push.
        _push(prefill, ref, "half", [0, 1], 32, 7, BlockTokens.of_prompt(prompt[:32], BLOCK), layers=2)
        # More than the staging left (256 KiB): refused before any tensor is sent.
        _push(prefill, ref, "big", [2, 3, 4, 5], 64, 8, BlockTokens.of_prompt(prompt, BLOCK))
        outcomes = _wait_sent(prefill, "half", "big")
        assert isinstance(outcomes[0], TransferError) and "finish() before layers [2, 3]" in str(outcomes[0])
        assert isinstance(outcomes[1], CapacityError)
        # A complete push after them is reported: the consumer did see what came before it.
        _push(prefill, ref, "whole", [6], 16, 9, BlockTokens.of_prompt(prompt[:16], BLOCK))
        # Wait past hold_s: "half" is dropped from staging unreported, "whole" stored then expired.
        events = _events(decode[0], 2)
        assert [(e.kind, e.transfer_id, e.reason) for e in events] == [("stored", "whole", None),
                                                                        ("removed", "whole", "expired")]
    finally:
        close_sides(prefill, decode)


def test_push_without_blocks_or_straight_into_expected_blocks_is_not_reported() -> None:
    layout = ParallelLayout(1, 1)
    prefill, decode = _engines("prefill", layout, "producer"), _engines("decode", layout, "consumer")
    try:
        ref, prefill_ref = engine_ref("decode", layout, decode), engine_ref("prefill", layout, prefill)
        prompt = _prompt(40, seed=4)
        _push(prefill, ref, "anon", [0, 1, 2], 40, 10, None)  # staged, but its blocks are not named
        decode[0].engine.expect("direct", prefill_ref, [3, 4, 5], 40, push=True)  # expected before the push
        _push(prefill, ref, "direct", [9, 10, 11], 40, 11, BlockTokens.of_prompt(prompt, BLOCK))
        decode[0].engine.wait("direct", timeout_s=20)
        assert decode[0].mismatches(11, [3, 4, 5], 40, Span(0, 40)) == []
        decode[0].engine.expect("anon", prefill_ref, [6, 7, 8], 40, push=True)
        decode[0].engine.wait("anon", timeout_s=20)
        assert decode[0].mismatches(10, [6, 7, 8], 40, Span(0, 40)) == []
        assert decode[0].engine.take_staging_events() == []
    finally:
        close_sides(prefill, decode)


def test_block_tokens_checks_its_values() -> None:
    assert BlockTokens.of_prompt([5] * 40, 16).token_ids == (5,) * 32
    assert BlockTokens.of_prompt([5] * 15, 16).num_blocks == 0
    with pytest.raises(ValueError, match="whole blocks"):
        BlockTokens((1, 2, 3), 2)
    with pytest.raises(ValueError, match="block_size"):
        BlockTokens((1, 2), 0)
    with pytest.raises(ValueError, match="extra_keys"):
        BlockTokens((1, 2), 2, (b"salt",))  # type: ignore[arg-type]

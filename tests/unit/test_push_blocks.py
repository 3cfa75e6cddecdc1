"""``PushOffer.blocks``: the pushed prompt's full blocks on the wire, bounded like every other field."""

from __future__ import annotations

import msgspec
import pytest

from ncclkv.engine import BlockTokens
from ncclkv.engine._push import _blocks_msg
from ncclkv.errors import ProtocolError
from ncclkv.protocol import MAX_EXTRA_KEYS, MAX_PUSH_TOKENS, Envelope, PushBlocks, PushOffer, decode, encode


def _offer(blocks: PushBlocks | None) -> Envelope:
    return Envelope("prefill.r0", 1, None, PushOffer("xfer-1", 0, "prefill", (), 64, 0, blocks))


def _frame(blocks: dict[str, object]) -> bytes:
    body = {"type": "push", "request_id": "x", "src_rank": 0, "producer_engine_id": "p", "routes": [],
            "num_tokens": 64, "nbytes": 0, "blocks": blocks}
    return msgspec.msgpack.encode({"sender": "p.r0", "msg_id": 1, "reply_to": None, "body": body})


def test_offer_round_trips_with_and_without_blocks() -> None:
    for blocks in (None, PushBlocks(tuple(range(64)), 32, ("lora", None, 7))):
        assert decode(encode(_offer(blocks))) == _offer(blocks)


@pytest.mark.parametrize(("blocks", "needle"), [
    ({"token_ids": [1] * (MAX_PUSH_TOKENS + 1), "block_size": 1, "extra_keys": []}, "length"),
    ({"token_ids": [-1], "block_size": 1, "extra_keys": []}, ">= 0"),
    ({"token_ids": [1], "block_size": 0, "extra_keys": []}, ">= 1"),
    ({"token_ids": [1], "block_size": 1, "extra_keys": [None] * (MAX_EXTRA_KEYS + 1)}, "length"),
    ({"token_ids": [1], "block_size": 1, "extra_keys": [b"salt"]}, "Expected"),
    ({"token_ids": [1], "block_size": 1, "extra_keys": [1.5]}, "Expected"),
    ({"token_ids": [1], "block_size": 1}, "missing required field `extra_keys`"),
])
def test_malformed_blocks_are_refused(blocks: dict[str, object], needle: str) -> None:
    with pytest.raises(ProtocolError, match=needle):
        decode(_frame(blocks), max_frame_bytes=1 << 22)


def test_blocks_too_large_for_a_frame_are_left_out() -> None:
    small = BlockTokens.of_prompt(list(range(100)), 32, ("lora", None))
    assert _blocks_msg("r", small, 1 << 20) == PushBlocks(tuple(range(96)), 32, ("lora", None))
    assert _blocks_msg("r", small, 1024) is None  # more than half a frame
    assert _blocks_msg("r", BlockTokens.of_prompt([1] * (MAX_PUSH_TOKENS + 1), 1), 1 << 30) is None
    assert _blocks_msg("r", BlockTokens.of_prompt([1] * 31, 32), 1 << 20) is None  # no full block
    assert _blocks_msg("r", None, 1 << 20) is None

"""Fixtures shared by the unit tests that open channels (opt in with ``pytest.mark.usefixtures``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from _channel_helpers import channel_threads
from ncclkv.channel import Channel


@pytest.fixture
def no_channel_thread_left() -> Iterator[None]:
    """The test starts with no channel thread alive and leaves none behind."""
    assert channel_threads() == [], "a channel thread was alive before the test"
    yield
    left = channel_threads()
    assert left == [], f"a channel thread (I/O, dispatcher or ZAP) outlived its test: {left}"


@pytest.fixture
def make_channel() -> Iterator[Callable[..., Channel]]:
    """Makes channels (``make(peer_id, **kwargs)``) and closes every one it made when the test ends."""
    made: list[Channel] = []

    def make(peer_id: str, **kwargs: object) -> Channel:
        made.append(Channel(peer_id, **kwargs))  # type: ignore[arg-type]
        return made[-1]

    yield make
    for channel in made:
        channel.close()

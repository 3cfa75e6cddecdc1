"""Fixtures shared by the unit tests that open channels (opt in with ``pytest.mark.usefixtures``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from _channel_helpers import channel_threads


@pytest.fixture
def no_channel_thread_left() -> Iterator[None]:
    """The test starts with no channel thread alive and leaves none behind."""
    assert channel_threads() == [], "a channel thread was alive before the test"
    yield
    left = channel_threads()
    assert left == [], f"a channel thread (I/O, dispatcher or ZAP) outlived its test: {left}"

"""The helpers of tests/launchers themselves: a free port wherever the kernel's ephemeral range starts."""

from __future__ import annotations

import socket

import pytest
from _launch import unused_port


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


@pytest.mark.parametrize(("port_range", "where"), [
    ((32768, 60999), range(20000, 32768)),  # Linux's default: below the range
    ((20010, 60999), range(20000, 20010)),  # fewer than 64 ports below it: one of them
    ((1024, 60000), range(60001, 65536)),  # a container's range from 1024: above it
    ((10000, 40000), range(40001, 65536)),  # a range that starts below 20000
])
def test_a_free_port_lies_outside_the_ephemeral_range(port_range: tuple[int, int], where: range) -> None:
    """The sample of 64 ports from 20000 up to the range's start raised ValueError ('Sample larger than population')
    where the range starts below 20064, as in many containers: every launcher test errored before it ran."""
    for _ in range(5):
        port = unused_port(port_range)
        assert port in where and _bindable(port), (port_range, port)


def test_a_range_that_leaves_no_port_outside_it_still_gives_a_free_one() -> None:
    """1024-65535: nothing above it, nothing from 20000 below it: a port bind(0) gives."""
    port = unused_port((1024, 65535))
    assert 0 < port < 65536 and _bindable(port)

"""Spawned engine processes shared by the multi-process engine tests (see _engine_pool.py)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from _engine_pool import Pool

POOL_SIZE = 8  # 4x1 -> 2x2 needs one process per rank


@pytest.fixture(scope="session")
def engine_pool() -> Iterator[Pool]:
    started = time.monotonic()
    pool = Pool(POOL_SIZE)
    print(f"\n[engine pool] {POOL_SIZE} processes ready in {time.monotonic() - started:.1f}s")
    try:
        yield pool
    finally:
        pool.close()


@pytest.fixture
def procs(engine_pool: Pool) -> Iterator[Pool]:
    """The pool, with every engine closed after the test and no ncclkv thread left in any child."""
    yield engine_pool
    left = engine_pool.reset()
    assert not left, f"ncclkv threads left after closing every engine: {left}"

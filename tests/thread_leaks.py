"""pytest plugin: a link thread that outlives the test which started it fails that test.

Without it, a leaked poster fails some later test's own thread checks (a CI
run once failed five transport tests for a thread an engine test had left
asleep), and that later test is the wrong place to look. The error names the
threads and shows where each one is blocked.
"""

from __future__ import annotations

import sys
import threading
import time
import traceback

import pytest

__all__ = ["GRACE_S", "THREAD_PREFIX"]

THREAD_PREFIX = "ncclkv-link-"  # a link's poster and reaper threads (ncclkv.transport)
GRACE_S = 5.0  # Link.close joins its threads, so a closed link's are gone long before this

_BEFORE = pytest.StashKey[set[int]]()


def _link_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(THREAD_PREFIX)]


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    item.stash[_BEFORE] = {t.ident for t in _link_threads() if t.ident is not None}


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item) -> None:
    """Runs after the test's fixtures are torn down (trylast); a module-scoped fixture's links still count as
    its first test's, so such a fixture must not keep links open across tests."""
    before = item.stash.get(_BEFORE, set())
    deadline = time.monotonic() + GRACE_S
    while True:
        left = [t for t in _link_threads() if t.ident not in before]
        if not left or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    if left:
        frames = sys._current_frames()  # noqa: SLF001 - the stacks are the point of the report
        where = "\n".join(f"{t.name}:\n{''.join(traceback.format_stack(frames[t.ident])) if t.ident in frames else '?'}"
                          for t in left)
        raise AssertionError(f"{len(left)} link thread(s) outlived this test by {GRACE_S:.0f} s:\n{where}")

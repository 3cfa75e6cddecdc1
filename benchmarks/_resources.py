"""Resource readings shared by the soak test and the memory benchmark: process RSS, staging, growth.

RSS is read from ``/proc/self/statm`` (the resident set now); where there is no
``/proc`` the peak from ``getrusage`` stands in, which can only grow, so growth
measured with it is an upper bound.
"""

from __future__ import annotations

import os
import resource
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

from ncclkv.engine import TransferEngine

__all__ = ["growth", "peak_rss_bytes", "rss_bytes", "staging_usage"]

_STATM = Path("/proc/self/statm")


def rss_bytes() -> int:
    """This process's resident set size now, in bytes."""
    try:
        resident_pages = int(_STATM.read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return peak_rss_bytes()
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    """The highest RSS this process has had (``getrusage``: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024


def staging_usage(engine: TransferEngine) -> tuple[int, int]:
    """(bytes held in ``engine``'s staging store, bytes promised to accepted push offers).

    The engine has no public accessor for these yet; its consumer side owns
    them (``_store``: a KVStoreBuffer, ``_reserved``: an int). Read here alone,
    so a rename breaks one function.
    """
    consumer = engine._consumer  # noqa: SLF001 - see the docstring
    return consumer._store.used_bytes, consumer._reserved  # noqa: SLF001


def growth(values: Sequence[float], warmup: float = 0.2, window: int = 3) -> float:
    """Relative growth of ``values`` (samples in time order) after the first ``warmup`` fraction of them.

    The median of the last ``window`` samples over the median of the first
    ``window`` samples after the warm-up, minus 1: medians, so one sample
    caught mid-allocation does not decide it; 0.05 is 5 % growth.
    """
    if not 0 <= warmup < 1 or window < 1:
        raise ValueError(f"need 0 <= warmup < 1 and window >= 1, got warmup={warmup}, window={window}")
    rest = list(values)[int(len(values) * warmup):]
    if len(rest) < 2:
        raise ValueError(f"growth needs >= 2 samples after the first {warmup:.0%}, got {len(rest)} of {len(values)}")
    width = min(window, len(rest) // 2)
    start, end = statistics.median(rest[:width]), statistics.median(rest[-width:])
    if start <= 0:
        raise ValueError(f"growth from a start of {start}: the samples must be positive")
    return end / start - 1.0

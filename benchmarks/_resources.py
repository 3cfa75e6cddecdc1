"""Resource readings shared by the soak test and the memory benchmark: process RSS, staging, growth, slope.

RSS is read from ``/proc/self/statm`` (the resident set now); where there is no
``/proc`` the peak from ``getrusage`` stands in, which can only grow, so growth
measured with it is an upper bound.
"""

from __future__ import annotations

import math
import os
import resource
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

from ncclkv.engine import TransferEngine

__all__ = ["fit", "growth", "peak_rss_bytes", "rss_bytes", "slope", "staging_peak", "staging_usage",
           "wire_pool"]

_STATM = Path("/proc/self/statm")
_STATUS = Path("/proc/self/status")


def rss_bytes() -> int:
    """This process's resident set size now, in bytes."""
    try:
        resident_pages = int(_STATM.read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return peak_rss_bytes()
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    """The highest RSS this process has had: ``VmHWM`` of ``/proc/self/status`` where there is one, else
    ``getrusage`` (KiB on Linux, bytes on macOS). On Linux ``getrusage`` keeps the high-water mark of the
    process it was forked from across ``exec``: a soak started by a large benchmark process would report its
    parent's peak."""
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # kB
    except (OSError, IndexError, ValueError):
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024


def staging_usage(engine: TransferEngine) -> tuple[int, int]:
    """(bytes held in ``engine``'s staging store, bytes promised to accepted push offers).

    The engine has no public accessor for these yet; its consumer side owns
    them (``_stage.store``: a KVStoreBuffer, ``_stage.reserved_bytes``: an int). Read here alone,
    so a rename breaks one function.
    """
    consumer = engine._consumer  # noqa: SLF001 - see the docstring
    return consumer._stage.store.used_bytes, consumer._stage.reserved_bytes  # noqa: SLF001


def staging_peak(engine: TransferEngine, reset: bool = False) -> int:
    """The most bytes ``engine``'s staging store held at once (its high-water mark, whatever moment it was).

    ``reset``: also start a new mark from what it holds now (read and reset at once: nothing is lost between).
    """
    store = engine._consumer._stage.store  # noqa: SLF001 - see staging_usage
    return store.reset_peak_used() if reset else store.peak_used_bytes


def wire_pool(engine: TransferEngine) -> tuple[int, int]:
    """(bytes of free wire buffers ``engine`` keeps for reuse, the bound its pool trims them to now).

    The bound (ncclkv/engine/_buffers.py): ``KEEP_PEAKS`` times the most bytes of
    buffers the rank had out at once in the last 5-10 s, and never more than
    the engine's ``wire_cache_bytes``. Read here alone (a private attribute), so a rename breaks one function.
    """
    buffers = engine._caches._buffers  # noqa: SLF001 - see the docstring
    if buffers is None:  # nothing registered yet: nothing kept
        return 0, 0
    return buffers.cached_bytes, buffers.keep_bytes


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


def slope(xs: Sequence[float], ys: Sequence[float], warmup: float = 0.2) -> float:
    """The least-squares slope of ``ys`` against ``xs`` after the first ``warmup`` fraction of the samples.

    For RSS against requests done: bytes per request that stay behind. Every
    sample after the warm-up counts, so a leak of a few KiB per request shows
    however noisy the end points are, and a step early in the window weighs
    less than a steady climb across it.
    """
    return fit(xs, ys, warmup)[0]


def fit(xs: Sequence[float], ys: Sequence[float], warmup: float = 0.2) -> tuple[float, float]:
    """:func:`slope` and its standard error from the residuals of the fit (samples taken as independent: RSS
    moves in steps, so the real uncertainty is somewhat larger; 0.0 with fewer than 3 samples)."""
    if len(xs) != len(ys):
        raise ValueError(f"slope needs as many xs as ys, got {len(xs)} and {len(ys)}")
    if not 0 <= warmup < 1:
        raise ValueError(f"need 0 <= warmup < 1, got warmup={warmup}")
    first = int(len(xs) * warmup)
    x, y = [float(v) for v in xs[first:]], [float(v) for v in ys[first:]]
    if len(x) < 2:
        raise ValueError(f"slope needs >= 2 samples after the first {warmup:.0%}, got {len(x)} of {len(xs)}")
    mean_x, mean_y = statistics.fmean(x), statistics.fmean(y)
    spread = sum((v - mean_x) ** 2 for v in x)
    if spread == 0:
        raise ValueError("slope needs at least two distinct xs")
    fitted = sum((a - mean_x) * (b - mean_y) for a, b in zip(x, y)) / spread
    if len(x) < 3:
        return fitted, 0.0
    residual = sum((b - mean_y - fitted * (a - mean_x)) ** 2 for a, b in zip(x, y)) / (len(x) - 2)
    return fitted, math.sqrt(residual / spread)

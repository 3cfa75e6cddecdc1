"""The one rule for a timeout or deadline ncclkv takes (control channel, links, configs, environment).

Pure (no torch, no zmq): the control channel, the transport and both configs import it.
"""

from __future__ import annotations

import math
import numbers

__all__ = ["MAX_TIMEOUT_S", "check_timeout"]

# The longest timeout ncclkv takes (about 31 years). Python's waits stop at
# threading.TIMEOUT_MAX (9.2e9 s, OverflowError past it), but gloo's do
# earlier: a link whose ops had 8e9 s timed out at once (a nanosecond deadline
# that overflows), at 4e9 s it worked.
MAX_TIMEOUT_S = 1e9


def check_timeout(name: str, timeout_s: object) -> float:
    """``timeout_s`` as a float if it is a number of seconds > 0, finite and at most :data:`MAX_TIMEOUT_S`.

    ``TypeError`` for a non-number (a bool included), ``ValueError`` for any
    other value, both naming ``name``. Checked where the value is given
    because the waits fail only when they run, often on another thread: nan
    never expires, inf is no deadline, and past the bound a wait raises
    OverflowError or (gloo) times out at once.
    """
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, numbers.Real):
        raise TypeError(f"{name} must be a number of seconds, got {type(timeout_s).__name__} {timeout_s!r}")
    if not (math.isfinite(timeout_s) and 0 < timeout_s <= MAX_TIMEOUT_S):
        raise ValueError(f"{name} must be a finite number of seconds > 0 (at most {MAX_TIMEOUT_S:g}), got {timeout_s!r}")
    return float(timeout_s)

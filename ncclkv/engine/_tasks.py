"""Tasks on the engine's executors: one that raises is logged and handed to its owner, never lost.

``Executor.submit`` keeps a task's exception in a future; the engine starts its
tasks (offers, pulls, declines, link opens) and keeps no future, so an
exception that escaped a task's own handling would vanish with it: no log,
and the request it served never reported.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any

__all__ = ["submit_task"]

log = logging.getLogger("ncclkv.engine")


def submit_task(executor: Executor, what: str, on_error: Callable[[BaseException], None] | None,
                fn: Callable[..., None], *args: Any) -> Future[None]:
    """Run ``fn(*args)`` on ``executor``; if it raises, log the error naming ``what`` and call ``on_error(error)``
    (the owner fails or records its request, once), on the thread that ran it.

    A task cancelled by the executor's shutdown (the engine closing) is neither logged nor reported.
    """
    future: Future[None] = executor.submit(fn, *args)
    future.add_done_callback(lambda done: _report(done, what, on_error))
    return future


def _report(future: Future[None], what: str, on_error: Callable[[BaseException], None] | None) -> None:
    if future.cancelled():
        return
    error = future.exception()
    if error is None:
        return
    log.error("%s failed: %s: %s", what, type(error).__name__, error, exc_info=error)
    if on_error is None:
        return
    try:
        on_error(error)
    except Exception as err:  # noqa: BLE001 - a done-callback's exception would only be logged by concurrent.futures
        log.error("%s: reporting its failure failed too: %s: %s", what, type(err).__name__, err, exc_info=err)

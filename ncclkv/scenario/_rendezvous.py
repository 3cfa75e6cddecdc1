"""A job-wide rendezvous through the TCPStore at MASTER_ADDR:MASTER_PORT.

Rank 0 hosts the store (unless the launcher already serves one there, as
torchrun does); every other rank connects as a client. Keys live under the
caller's prefix, the Slurm job and step and the launch attempt
(``LaunchInfo.attempt``): torchrun's store outlives an attempt's workers, and a
restart must not read its values. The hosting rank publishes the job's identity
(launcher, Slurm job and step, world size) before anything else; every other
rank reads it first and refuses a store of another job or step at once
(:class:`ForeignStoreError`): ports derived from Slurm job ids collide now and then,
and pyxis/enroot give every step of a job one MASTER_PORT.
Each wait has the deadline given at construction. Failures are typed: the store vanishing is a
:class:`PeerLostError`, a deadline a :class:`TransferTimeout`, and a failure
one rank reports reaches the others through :meth:`finish`.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import torch.distributed as dist

from .._timeout import check_timeout
from ..errors import HandshakeError, PeerLostError, TransferTimeout
from ..launch import LaunchInfo

__all__ = ["ForeignStoreError", "StoreRendezvous", "job_identity"]

_OK = "ok"
# How torch's TCPStore server says its port is taken (its error text names the errno).
_ADDRESS_IN_USE = re.compile(r"EADDRINUSE|address already in use", re.IGNORECASE)
_FAILURE_GRACE_S = 5.0  # how long the hosting rank keeps the store up for ranks reading a failure
_POLL_MIN_S, _POLL_MAX_S = 0.001, 0.05  # store polling: quick for the common case, at most 20 round trips/s
# Outside every prefix: whoever meets the store reads whose it is before anything else.
_IDENTITY_KEY = "ncclkv/job_identity"


class ForeignStoreError(HandshakeError):
    """The store at MASTER_ADDR:MASTER_PORT is not this job's: another job or step hosts it (or holds its port).
    A set-up error, not a peer's failure: ``python -m ncclkv.scenario`` exits 2."""


def job_identity(info: LaunchInfo) -> str:
    """What every rank of one job (one Slurm step, one attempt's world) agrees on without talking."""
    job = f"job {info.job_id} step {info.step_id}" if info.job_id is not None else "no job id"
    return f"{info.launcher} {job} world_size {info.world_size}"


class StoreRendezvous:
    """Publish values, gather everyone's, and agree that all ranks finished (or one failed)."""

    def __init__(self, info: LaunchInfo, *, prefix: str, deadline_s: float) -> None:
        check_timeout("deadline_s", deadline_s)
        self._info = info
        self._deadline_s = deadline_s
        self._hosting = info.is_master and not info.store_hosted
        self._where = f"rank {info.rank}: rendezvous store {info.master_addr}:{info.master_port}"
        deadline = time.monotonic() + deadline_s
        with self._typed("connect", deadline):
            store = dist.TCPStore(
                info.master_addr, info.master_port, is_master=self._hosting,
                timeout=timedelta(seconds=deadline_s), wait_for_workers=False,
            )
        # The attempt in every key: torchrun's agent store outlives its workers, so an elastic restart
        # would read the previous attempt's values (stale addresses, a finished outcome) under the same name.
        # The Slurm step too: two steps of one job given one MASTER_PORT must not read each other's keys (the
        # second step's ranks would join the first one's links). And the job: ports derived from job ids collide.
        job = f"/job{info.job_id}" if info.job_id is not None else ""
        self._prefix = f"{prefix}{job}/step{info.step_id}/attempt{info.attempt}"
        if not info.store_hosted:  # torchrun's agent store is its own run's alone
            with self._typed("check the store's job", deadline):
                self._check_identity(store, deadline)
        self._store: dist.Store = dist.PrefixStore(self._prefix, store)
        self._raw_store = store  # the server lives as long as this object on rank 0
        self._left = False

    def _check_identity(self, store: dist.Store, deadline: float) -> None:
        """The hosting rank publishes this job's identity; every other rank reads it first and refuses another's."""
        mine = job_identity(self._info)
        if self._hosting:
            store.set(_IDENTITY_KEY, mine)
            return
        if not self._poll_store(store, [_IDENTITY_KEY], deadline):
            raise TransferTimeout(
                f"{self._where}: the hosting rank did not publish its job identity within {self._deadline_s:g} s")
        theirs = store.get(_IDENTITY_KEY).decode()
        if theirs != mine:
            raise ForeignStoreError(
                f"{self._where}: this store belongs to another job or step ({theirs}), not to this one ({mine}): "
                f"two jobs or steps were given one MASTER_PORT (derived ports collide, pyxis/enroot give every step "
                f"of a job the same one); export a MASTER_PORT of its own for every rank of this job")

    @property
    def prefix(self) -> str:
        """Where this rendezvous keeps its keys in the store: the caller's prefix, the Slurm step and the launch
        attempt."""
        return self._prefix

    @property
    def hosting(self) -> bool:
        """True on the rank whose process serves the store."""
        return self._hosting

    def exchange(self, value: str, name: str = "value", *, start_line: bool = False) -> list[str]:
        """Publish this rank's ``value`` under ``name``; return every rank's, by rank (one call per name).

        ``start_line``: every rank leaves within about a millisecond of the last one's arrival (what a
        timed window starts from), at the cost of polling the store that often meanwhile."""
        deadline = time.monotonic() + self._deadline_s
        keys = [f"{name}/{rank}" for rank in range(self._info.world_size)]
        with self._typed("exchange", deadline):
            self._store.set(keys[self._info.rank], value)
            self._wait(keys, deadline, "publish their value", _POLL_MIN_S if start_line else _POLL_MAX_S)
            return [raw.decode() for raw in self._store.multi_get(keys)]

    def report_failure(self, message: str) -> None:
        """Tell every rank waiting in :meth:`finish` that this one failed; never raises."""
        try:
            self._store.compare_set("outcome", "", f"rank {self._info.rank} failed: {message}")
            self._leave(strict=False)
        except Exception:  # noqa: BLE001 - the store may be gone too; the caller raises the real error
            pass

    def finish(self) -> None:
        """Return once every rank called finish; raise PeerLostError if one reported a failure.

        The hosting rank then waits for every rank to have read the outcome, so
        that closing the store fails no one (after a failure, for a short grace
        only: a rank that died never reads it).
        """
        deadline = time.monotonic() + self._deadline_s
        size = self._info.world_size
        with self._typed("finish", deadline):
            # One key per rank beside the count: a deadline names the ranks that never came, not the outcome's key.
            self._store.set(f"finished/{self._info.rank}", _OK)
            if self._store.add("done", 1) == size:
                self._store.compare_set("outcome", "", _OK)
            self._wait(["outcome"], deadline, "finish", ranks_key="finished")
            outcome = self._store.get("outcome").decode()
            self._leave(strict=outcome == _OK)
            if outcome != _OK:
                raise PeerLostError(f"{self._where}: peer failure: {outcome}")

    def _leave(self, *, strict: bool) -> None:
        """Count this rank out of the store (once); the hosting rank waits until every rank is out."""
        if self._left:
            return
        self._left = True
        self._store.set(f"left/{self._info.rank}", _OK)  # as finished/<rank>: a deadline names who never left
        if self._store.add("left", 1) == self._info.world_size:
            self._store.set("all_left", _OK)
        if not self._hosting:
            return
        if strict:
            self._wait(["all_left"], time.monotonic() + self._deadline_s, "read the outcome", ranks_key="left")
            return
        # A rank that died never leaves; the failure is raised by the caller either way.
        self._poll(["all_left"], time.monotonic() + min(_FAILURE_GRACE_S, self._deadline_s))

    def _wait(self, keys: list[str], deadline: float, what: str, poll_max_s: float = _POLL_MAX_S, *,
              ranks_key: str | None = None) -> None:
        """Return once every key is set; raise PeerLostError as soon as a rank reports a failure.

        ``ranks_key``: the keys wait for a count; the deadline's error names the ranks that set no
        ``ranks_key/<rank>``."""
        if self._poll(keys, deadline, watch_failure=True, poll_max_s=poll_max_s):
            return
        if failure := self._failure():
            raise PeerLostError(f"{self._where}: waiting for every rank to {what}: {failure}")
        if ranks_key is not None:
            keys = [f"{ranks_key}/{rank}" for rank in range(self._info.world_size)]
        missing = [key for key in keys if not self._store.check([key])]
        raise TransferTimeout(
            f"{self._where}: not every rank did {what} within {self._deadline_s:g} s (missing {missing})")

    def _failure(self) -> str | None:
        """The failure a rank reported, if any."""
        if not self._store.check(["outcome"]):
            return None
        outcome = self._store.get("outcome").decode()
        return None if outcome == _OK else outcome

    def _poll(self, keys: list[str], deadline: float, *, watch_failure: bool = False,
              poll_max_s: float = _POLL_MAX_S) -> bool:
        """True once every key is set; False at the deadline, or (``watch_failure``) once a rank reported a failure.

        Polls, one round trip per ``check``: ``TCPStore.wait`` waits for all of its keys, so it
        could not also watch ``outcome``, and a rank's failure would go unseen until the deadline.
        """
        return self._poll_store(self._store, keys, deadline, watch_failure=watch_failure, poll_max_s=poll_max_s)

    def _poll_store(self, store: dist.Store, keys: list[str], deadline: float, *, watch_failure: bool = False,
                    poll_max_s: float = _POLL_MAX_S) -> bool:
        pause = _POLL_MIN_S
        while not store.check(keys):
            left = deadline - time.monotonic()
            if left <= 0 or (watch_failure and self._failure()):
                return False
            time.sleep(min(pause, left))
            pause = min(pause * 2, poll_max_s)
        return True

    @contextmanager
    def _typed(self, step: str, deadline: float) -> Iterator[None]:
        """Turn torch's store errors into PeerLostError / TransferTimeout naming this rank and step."""
        try:
            yield
        except (PeerLostError, TransferTimeout, HandshakeError):
            raise
        except dist.DistError as exc:
            text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            if self._hosting and _ADDRESS_IN_USE.search(str(exc)):  # not a peer's failure: say which port
                raise ForeignStoreError(
                    f"{self._where}: this rank hosts the store, but port {self._info.master_port} is in use on "
                    f"{self._info.master_addr} (another job or step?); export MASTER_PORT with a free port for "
                    f"every rank: {text}") from exc
            if time.monotonic() >= deadline - 0.01:
                raise TransferTimeout(f"{self._where}: {step} not done within {self._deadline_s:g} s: {text}") from exc
            raise PeerLostError(f"{self._where}: {step}: lost the store: {text}") from exc


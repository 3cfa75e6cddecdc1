"""One dead or hung peer must not delay an engine rank's transfers with its other peers (real processes).

A consumer's pulls and a producer's push offers each wait on their peer (a
handshake, then the request's answer) for up to ``deadline_s`` when that peer
is killed, stopped (SIGSTOP) or never there. They used to share one executor
of 4 workers: with 4 requests in flight to a dead peer, every other transfer
of the engine rank, with healthy peers, waited behind them (seen with real
vLLM servers: 4 healthy transfers through a live prefill server took 8.7-9.4 s
instead of 0.13 s with ``deadline_s=10``, and the same for pushes). Now each
peer's tasks run in a lane of their own (``ncclkv.engine._tasks.PeerTasks``):
started in order, at most 4 at once, on threads shared by all lanes, so a dead
peer holds its lane's threads and the healthy peers' transfers go on; and
once a task finds its peer lost, the ones queued behind it fail at once,
typed, instead of each waiting another ``deadline_s``.

Here a consumer expects ``N_STALE`` requests from a producer that was killed
or stopped (or whose address never answered), then pulls from a healthy
producer: the healthy pulls land byte-exact in well under ``deadline_s``, and
every stale request fails typed within about one ``deadline_s`` of the fault
(not one per request); a stopped producer that comes back is pulled from
again. The same for pushes from one producer to a killed and a healthy
consumer. Below those, ``PeerTasks`` itself in this process (per-peer order,
threads bounded by the peers with work, fail-fast of what is queued, close),
and an engine whose pull waits in its producer's lane (loopback links).
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from ncclkv.engine import EngineRef
from ncclkv.errors import ClosedError, PeerLostError, PeerResetError, TransferError, TransferTimeout
from ncclkv.launch import free_port
from ncclkv.layout import KVGeometry, ParallelLayout, Span
from ncclkv.paged import CacheLayout

from _engine_pool import Pool, Proc, blocks, build_engine
from _engine_workers import Outcome, Req

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]

GQA = KVGeometry(num_layers=4, num_kv_heads=4, head_size=32, dtype="float32")
ONE = ParallelLayout(1, 1)
DEADLINE_S = 8.0
HEALTHY_S = 3.0  # a healthy transfer of 40 tokens over an open link takes well under a second here
LATE_S = 4.0  # a loss is noticed a heartbeat tick after deadline_s, on 2 busy cores
N_STALE = 6  # more than the 4 workers every peer's tasks used to share
N_FINE = 4
TYPED_FAILURES = {"TransferError", "TransferTimeout", "PeerLostError"}
TASK_THREADS = "ncclkv-engine["  # the engine rank's task threads (pulls, push offers)
TASKS_PER_PEER = 4  # TransferEngine's lanes: a peer's tasks running at once, at most (ncclkv.engine._engine)


def _build(proc: Proc, engine_id: str, role: str, cache: CacheLayout = CacheLayout.CPU) -> EngineRef:
    return build_engine([proc], engine_id, ONE, GQA, cache, 16, role, deadline_s=DEADLINE_S, num_blocks=64)


def _req(rid: str, seed: int, slot: int, num_tokens: int = 40) -> Req:
    """A request of ``num_tokens`` in 16-token blocks; ``slot`` keeps requests' blocks apart on both sides."""
    return Req(rid, seed, num_tokens, blocks(num_tokens, 16, 4 * slot), blocks(num_tokens, 16, 4 * slot))


def _stale_and_fine() -> tuple[list[Req], list[Req]]:
    stale = [_req(f"stale{i}", 10 + i, 1 + i) for i in range(N_STALE)]
    fine = [_req(f"fine{i}", 30 + i, 1 + N_STALE + i) for i in range(N_FINE)]
    return stale, fine


def _assert_ok(outcomes: dict[str, Outcome], where: str) -> None:
    bad = {rid: o for rid, o in outcomes.items() if not o.ok}
    assert not bad, f"{where}: {bad}"


def _warm_pull(producer: Proc, key_p: str, ref_p: EngineRef, consumer: Proc, key_d: str, rid: str) -> None:
    """A first pull between a pair, off the clock: its handshake and link are made before anything is timed."""
    warm = _req(rid, 1, 0 if rid == "warm" else 11)
    producer.call("hold", key=key_p, reqs=[warm])
    consumer.call("expect", key=key_d, producer=ref_p, reqs=[warm])
    _assert_ok(consumer.call("wait", key=key_d, reqs=[warm]), f"warm-up pull {rid}")


def _healthy_landed(outcomes: dict[str, Outcome], started: float, what: str) -> None:
    """Every healthy request landed byte-exact within HEALTHY_S of ``started``."""
    _assert_ok(outcomes, f"{what}: healthy requests")
    took = max(o.at for o in outcomes.values()) - started  # time.monotonic(): one clock for every process here
    print(f"\n[dead peer] {what}: {len(outcomes)} healthy requests landed {took:.3f}s after they started "
          f"(deadline_s={DEADLINE_S})")
    assert took < HEALTHY_S, f"{what}: the healthy requests took {took:.2f}s (deadline_s={DEADLINE_S})"


def _stale_failed(outcomes: dict[str, Outcome], since: float, what: str) -> None:
    """Every stale request failed, typed and reported, within about one deadline_s of ``since`` (the fault)."""
    bad = {rid: o for rid, o in outcomes.items() if o.error_type not in TYPED_FAILURES or o.reported != o.error_type}
    assert not bad, f"{what}: stale requests not failed typed: {bad}"
    late = sorted(round(o.at - since, 2) for o in outcomes.values())
    print(f"\n[dead peer] {what}: {len(outcomes)} stale requests failed {late}s after the fault "
          f"({sorted({o.error_type for o in outcomes.values()})})")
    assert late[-1] < DEADLINE_S + LATE_S, f"{what}: stale requests failed {late}s after the fault (one deadline_s " \
                                           f"each, not one for all): {outcomes}"


def _task_threads(proc: Proc, what: str, peers: int) -> None:
    """The engine rank's task threads are bounded by the peers it has work for (a dead peer holds a lane's worth),
    not by its requests."""
    names = proc.call("threads", contains=TASK_THREADS)
    print(f"\n[dead peer] {what}: task threads {names}")
    assert len(names) <= TASKS_PER_PEER * peers, f"{what}: {len(names)} task threads for {peers} peers: {names}"


@pytest.mark.parametrize("fault", ["killed", "stopped"])
def test_pulls_stuck_on_a_dead_producer_delay_no_pull_from_a_live_one(procs: Pool, fault: str) -> None:
    consumer, victim, healthy = procs[0], procs[1], procs[2]
    tag = f"dpull{fault[0]}"
    key_d, key_v, key_h = f"{tag}-d", f"{tag}-v", f"{tag}-h"
    ref_v = _build(victim, key_v, "producer")
    ref_h = _build(healthy, key_h, "producer", CacheLayout.FLASH_NHD)
    _build(consumer, key_d, "consumer")
    _warm_pull(victim, key_v, ref_v, consumer, key_d, "warm")  # the victim was in use: handshake and link
    _warm_pull(healthy, key_h, ref_h, consumer, key_d, "warm-h")
    stale, fine = _stale_and_fine()
    victim.call("hold", key=key_v, reqs=stale)  # it never serves them
    healthy.call("hold", key=key_h, reqs=fine)
    faulted_at = victim.kill() if fault == "killed" else victim.signal(signal.SIGSTOP)
    consumer.call("expect", key=key_d, producer=ref_v, reqs=stale)  # N_STALE pulls wait on the victim
    started = time.monotonic()
    consumer.call("expect", key=key_d, producer=ref_h, reqs=fine)
    _healthy_landed(consumer.call("wait", key=key_d, reqs=fine), started, f"consumer, producer {fault}")
    _task_threads(consumer, f"consumer, producer {fault}", peers=2)
    _stale_failed(consumer.call("wait", key=key_d, reqs=stale, timeout_s=3 * DEADLINE_S + 30), faulted_at,
                  f"consumer, producer {fault}")
    if fault == "stopped":  # back again: its peer lane was not left failing, a new pull lands
        victim.signal(signal.SIGCONT)
        again = _req("again", 50, 1 + N_STALE + N_FINE)
        victim.call("hold", key=key_v, reqs=[again])
        consumer.call("expect", key=key_d, producer=ref_v, reqs=[again])
        _assert_ok(consumer.call("wait", key=key_d, reqs=[again], timeout_s=2 * DEADLINE_S + 30),
                   "a pull from the producer once it runs again")
    _assert_ok(healthy.call("take_sent", key=key_h, rids=["warm-h", *(r.rid for r in fine)]), "healthy producer")


def test_pulls_to_a_producer_that_never_answers_fail_within_one_deadline(procs: Pool) -> None:
    """A producer gone before this consumer ever reached it (its address answers nothing): each handshake
    waits deadline_s. Before, 4 at a time (the healthy pulls behind them), and the 5th and 6th another
    deadline_s after the first 4."""
    consumer, healthy = procs[0], procs[1]
    ref_h = _build(healthy, "dnever-h", "producer", CacheLayout.FLASH_NHD)
    _build(consumer, "dnever-d", "consumer")
    _warm_pull(healthy, "dnever-h", ref_h, consumer, "dnever-d", "warm-h")
    gone = EngineRef("dnever-gone", ONE, (f"tcp://127.0.0.1:{free_port()}",))
    stale, fine = _stale_and_fine()
    healthy.call("hold", key="dnever-h", reqs=fine)
    started = time.monotonic()
    consumer.call("expect", key="dnever-d", producer=gone, reqs=stale)
    consumer.call("expect", key="dnever-d", producer=ref_h, reqs=fine)
    _healthy_landed(consumer.call("wait", key="dnever-d", reqs=fine), started, "consumer, producer never there")
    _task_threads(consumer, "consumer, producer never there", peers=2)
    _stale_failed(consumer.call("wait", key="dnever-d", reqs=stale, timeout_s=3 * DEADLINE_S + 30), started,
                  "consumer, producer never there")
    _assert_ok(healthy.call("take_sent", key="dnever-h", rids=["warm-h", *(r.rid for r in fine)]), "healthy producer")


def test_pushes_stuck_on_a_dead_consumer_delay_no_push_to_a_live_one(procs: Pool) -> None:
    producer, victim, healthy = procs[0], procs[1], procs[2]
    ref_p = _build(producer, "dpush-p", "producer")
    ref_v = _build(victim, "dpush-v", "consumer")
    ref_h = _build(healthy, "dpush-h", "consumer", CacheLayout.FLASH_NHD)
    for consumer, ref_c, rid in ((victim, ref_v, "warm"), (healthy, ref_h, "warm-h")):  # handshakes and links
        warm = _req(rid, 1, 0 if rid == "warm" else 11)
        consumer.call("expect", key=ref_c.engine_id, producer=ref_p, reqs=[warm], push=True)
        assert producer.call("push", key="dpush-p", req=warm, consumer=ref_c).ok
        _assert_ok(consumer.call("wait", key=ref_c.engine_id, reqs=[warm]), f"warm-up push {rid}")
    stale, fine = _stale_and_fine()
    killed_at = victim.kill()
    for req in stale:  # N_STALE push offers wait on the killed consumer
        producer.call("start_push", key="dpush-p", req=req, consumer=ref_v)
    healthy.call("expect", key="dpush-h", producer=ref_p, reqs=fine, push=True)
    started = time.monotonic()
    for req in fine:
        producer.call("start_push", key="dpush-p", req=req, consumer=ref_h)
    _healthy_landed(healthy.call("wait", key="dpush-h", reqs=fine), started, "producer, consumer killed")
    _task_threads(producer, "producer, consumer killed", peers=2)
    sent = producer.call("take_sent", key="dpush-p", rids=[r.rid for r in stale], timeout_s=3 * DEADLINE_S + 30)
    _stale_failed(sent, killed_at, "producer, consumer killed")
    _assert_ok(producer.call("take_sent", key="dpush-p", rids=[r.rid for r in fine]), "pushes to the healthy consumer")


# -- PeerTasks, and the engine's lanes, in this process ----------------------------------------------------------

WAIT_S = 10.0


def _until(poll: Callable[[], Any], what: str, timeout_s: float = WAIT_S) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (got := poll()):
        assert time.monotonic() < deadline, f"{what} not within {timeout_s}s"
        threading.Event().wait(0.005)
    return got


class _Reports:
    """What ``submit_task`` handed each task's owner (``on_error``), by task name."""

    def __init__(self) -> None:
        self.errors: dict[str, list[BaseException]] = {}
        self.lock = threading.Lock()

    def on_error(self, what: str) -> Callable[[BaseException], None]:
        def record(error: BaseException) -> None:
            with self.lock:
                self.errors.setdefault(what, []).append(error)
        return record

    def of(self, *names: str) -> dict[str, list[BaseException]]:
        with self.lock:
            return {name: list(self.errors.get(name, ())) for name in names}


@pytest.fixture
def tasks() -> Iterator[Any]:
    from ncclkv.engine._tasks import PeerTasks

    pool = PeerTasks(8, "test-peer-tasks", idle_s=0.5)
    try:
        yield pool
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def test_each_peers_tasks_run_in_order_one_at_a_time_while_other_peers_go_on(tasks: Any) -> None:
    gate, lock = threading.Event(), threading.Lock()
    ran: list[tuple[str, int]] = []
    running: dict[str, int] = {"a": 0, "b": 0}
    most = dict(running)

    def task(peer: str, index: int, wait: threading.Event | None = None) -> None:
        with lock:
            running[peer] += 1
            most[peer] = max(most[peer], running[peer])
        if wait is not None:
            assert wait.wait(WAIT_S)
        with lock:
            running[peer] -= 1
            ran.append((peer, index))

    stuck = [tasks.submit_to("a", task, "a", 0, gate)] + [tasks.submit_to("a", task, "a", i) for i in range(1, 6)]
    for future in [tasks.submit_to("b", task, "b", i) for i in range(6)]:
        future.result(WAIT_S)  # b's go on while a's first is stuck
    assert not any(future.done() for future in stuck)
    gate.set()
    for future in stuck:
        future.result(WAIT_S)
    for peer in "ab":
        assert [i for p, i in ran if p == peer] == list(range(6)), ran
    assert most == {"a": 1, "b": 1}, f"a peer's tasks ran {most} at once"


def test_a_lane_of_several_runs_that_many_of_its_peers_tasks_at_once_started_in_order() -> None:
    from ncclkv.engine._tasks import PeerTasks

    pool = PeerTasks(64, "test-lane-of-2", per_peer=2)
    gate, lock, started = threading.Event(), threading.Lock(), []

    def task(index: int) -> None:
        with lock:
            started.append(index)
        assert gate.wait(WAIT_S)

    try:
        futures = [pool.submit_to("a", task, i) for i in range(5)]
        assert pool.submit_to("b", lambda: "b").result(WAIT_S) == "b"  # another peer's goes on
        _until(lambda: len(started) == 2, "two of a's tasks started")
        assert not gate.wait(0.3) and started == [0, 1], started  # no third while two run
        gate.set()
        for future in futures:
            future.result(WAIT_S)
        assert sorted(started) == [0, 1, 2, 3, 4], started  # the rest once the first two ended
    finally:
        gate.set()
        pool.shutdown()


def test_a_stuck_peer_holds_one_thread_and_no_more_than_max_workers_run() -> None:
    from ncclkv.engine._tasks import PeerTasks

    gate, started, lock = threading.Event(), [], threading.Lock()

    def stuck(peer: str) -> None:
        with lock:
            started.append(peer)
        assert gate.wait(WAIT_S)

    wide = PeerTasks(64, "test-wide", idle_s=0.2)
    narrow = PeerTasks(2, "test-narrow", idle_s=0.2)
    pairs = PeerTasks(64, "test-pairs", idle_s=0.2, per_peer=2)
    try:
        for pool, want, first in ((wide, 3, "abc"), (narrow, 2, "ab"), (pairs, 6, "aabbcc")):
            futures = [pool.submit_to(peer, stuck, peer) for peer in "abc" for _ in range(4)]
            _until(lambda: len(started) == want, f"{want} tasks started")
            assert not gate.wait(0.3)  # nothing else starts meanwhile: each stuck peer holds its lane's threads
            assert pool.num_threads == want and "".join(sorted(started)) == first, (pool.num_threads, started)
            gate.set()  # the narrow pool's third peer gets a thread once one is free
            for future in futures:
                future.result(WAIT_S)
            assert sorted(started) == sorted("abc" * 4) and pool.num_threads <= want
            _until(lambda: pool.num_threads == 0, "idle threads ended")  # idle_s without work
            gate.clear()
            started.clear()
        assert wide.submit_to("a", lambda: "again").result(WAIT_S) == "again"  # a thread starts again
    finally:
        gate.set()
        for pool in (wide, narrow, pairs):
            pool.shutdown()


def test_fail_fast_fails_what_is_queued_behind_a_lost_peer_at_once_typed_and_only_that(tasks: Any) -> None:
    from ncclkv.engine._tasks import fail_fast, submit_task

    reports, ran = _Reports(), []
    first_runs, lose = threading.Event(), threading.Event()
    failed: list[int] = []

    def first() -> None:  # a pull whose producer is lost while it waits
        first_runs.set()
        assert lose.wait(WAIT_S)
        lost = PeerLostError("peer 'a' lost while waiting for a reply: nothing heard (test)")
        lost.loss_seq = 7  # reported by the channel while the task waited
        failed.append(fail_fast(tasks, "a", lost, alive=lambda peer: False))

    submit_task(tasks, "a0", reports.on_error("a0"), first, peer="a")
    queued = [submit_task(tasks, f"a{i}", reports.on_error(f"a{i}"), ran.append, f"a{i}", peer="a")
              for i in range(1, 4)]
    assert first_runs.wait(WAIT_S)
    submit_task(tasks, "b0", reports.on_error("b0"), ran.append, "b0", peer="b").result(WAIT_S)
    lose.set()
    _until(lambda: all(f.done() for f in queued), "the queued tasks failed")
    assert failed == [3] and all(f.cancelled() for f in queued)
    for name, errors in reports.of("a1", "a2", "a3").items():  # each owner told once, typed, naming why
        assert len(errors) == 1 and type(errors[0]) is PeerLostError, (name, errors)
        assert f"{name} not started" in str(errors[0]) and "did not answer an earlier request" in str(errors[0])
    submit_task(tasks, "a4", reports.on_error("a4"), ran.append, "a4", peer="a").result(WAIT_S)  # later: it runs
    assert ran == ["b0", "a4"] and reports.of("a0", "b0", "a4") == {"a0": [], "b0": [], "a4": []}

    # Not for an error the peer replied with, a reset (a new handshake cures it), or a peer the channel still hears.
    hold = threading.Event()
    tasks.submit_to("c", hold.wait, WAIT_S)
    behind = submit_task(tasks, "c1", reports.on_error("c1"), ran.append, "c1", peer="c")
    reset = PeerResetError("peer 'c' restarted (test)")
    reset.loss_seq = 8
    for error, alive in ((TransferError("peer 'c' replied error 'transfer' (test)"), False),
                         (TransferTimeout("peer 'c' replied error 'timeout' (test)"), True),
                         (reset, False),
                         (PeerLostError("'c' names a life since replaced (test): refused at once"), False),
                         (ClosedError("channel closed (test)"), False)):
        assert fail_fast(tasks, "c", error, alive=lambda peer, alive=alive: alive) == 0, error
    hold.set()
    behind.result(WAIT_S)
    assert ran[-1] == "c1" and reports.of("c1") == {"c1": []}


def test_fail_fast_leaves_the_tasks_queued_for_another_address_of_the_peer_id(tasks: Any) -> None:
    """A peer restarted at another address: the tasks for its new life are not the lost life's; they stay
    queued, in order, and run. Those queued for the dead address fail."""
    from ncclkv.engine._tasks import fail_fast, submit_task

    reports, ran = _Reports(), []
    first_runs, lose = threading.Event(), threading.Event()
    failed: list[int] = []

    def first() -> None:  # a pull to the dead life, lost while it waits
        first_runs.set()
        assert lose.wait(WAIT_S)
        lost = PeerLostError("peer 'a' lost while waiting for a reply: nothing heard (test)")
        lost.loss_seq, lost.address = 7, "tcp://h:1"
        failed.append(fail_fast(tasks, "a", lost, alive=lambda peer: False, at="tcp://h:1"))

    submit_task(tasks, "a0", reports.on_error("a0"), first, peer="a", at="tcp://h:1")
    queued = [submit_task(tasks, name, reports.on_error(name), ran.append, name, peer="a", at=at)
              for name, at in (("old1", "tcp://h:1"), ("new1", "tcp://h:2"), ("new2", "tcp://h:2"))]
    assert first_runs.wait(WAIT_S)
    lose.set()
    for future in queued:
        _until(future.done, "each queued task failed or ran")
    assert failed == [1] and ran == ["new1", "new2"]
    assert [f.cancelled() for f in queued] == [True, False, False]
    for name, errors in reports.of("old1").items():
        assert len(errors) == 1 and type(errors[0]) is PeerLostError, (name, errors)
    assert reports.of("new1", "new2") == {"new1": [], "new2": []}


def test_a_task_for_another_address_of_the_peer_id_is_not_queued_behind_those_running_at_the_first(
        tasks: Any) -> None:
    """Each address of a peer id (another life of it: restarted there) has a lane of its own: with the lane's
    places all taken by tasks waiting on the dead address (each up to deadline_s), the new life's task runs at
    once, and the dead address's next one still waits its turn. Before, it was queued behind them."""
    hold, started = threading.Event(), threading.Event()
    stuck = tasks.submit_to("a", lambda: (started.set(), hold.wait(3 * WAIT_S)), at="tcp://h:1")  # per_peer: 1
    try:
        assert started.wait(WAIT_S)
        behind = tasks.submit_to("a", lambda: "old", at="tcp://h:1")
        assert tasks.submit_to("a", lambda: "new", at="tcp://h:2").result(WAIT_S) == "new"  # before: TimeoutError
        assert not behind.done() and not stuck.done()
    finally:
        hold.set()
    assert behind.result(WAIT_S) == "old" and stuck.result(WAIT_S)[1]


def test_shutdown_fails_what_is_queued_with_closed_error_once_and_joins_every_thread() -> None:
    from ncclkv.engine._tasks import PeerTasks, submit_task

    pool = PeerTasks(8, "test-shutdown")
    reports, ran, gate, started = _Reports(), [], threading.Event(), threading.Event()

    def running() -> None:  # ends once the engine's close ends its wait (here: a timer)
        started.set()
        assert gate.wait(WAIT_S)

    first = submit_task(pool, "a0", reports.on_error("a0"), running, peer="a")
    queued = [submit_task(pool, f"{p}{i}", reports.on_error(f"{p}{i}"), ran.append, f"{p}{i}", peer=p)
              for p in "ab" for i in range(1, 3)]
    assert started.wait(WAIT_S)
    _until(lambda: ran == ["b1", "b2"], "the other peer's tasks ran")
    queued = queued[:2]
    threading.Timer(0.2, gate.set).start()
    pool.shutdown(wait=True, cancel_futures=True)
    assert first.result(0) is None and all(f.cancelled() for f in queued)
    errors = reports.of("a0", "a1", "a2")
    assert errors["a0"] == [] and all(len(errors[n]) == 1 and type(errors[n][0]) is ClosedError for n in ("a1", "a2"))
    late = submit_task(pool, "a3", reports.on_error("a3"), ran.append, "a3", peer="a")  # after: failed at once
    assert late.cancelled() and [type(e) for e in reports.of("a3")["a3"]] == [ClosedError]
    assert ran == ["b1", "b2"] and pool.num_threads == 0
    assert not [t.name for t in threading.enumerate() if t.name.startswith("test-shutdown")]


# The engine: a pull waits only behind its own producer rank's earlier tasks (loopback links, one process).

_NOTHING_LANDED_S = 1.5


@contextmanager
def _engines(**consumer: Any) -> Iterator[tuple[list[Any], list[Any], list[Any]]]:
    """Two one-rank producers and a one-rank consumer on one loopback hub, closed after."""
    from engine.kvsim import build_sides, close_sides

    from ncclkv.transport import LoopbackHub, LoopbackTransport

    hub = LoopbackHub()

    def sides(engine_id: str, role: str, **config: Any) -> list[Any]:
        return build_sides(engine_id, ONE, GQA, CacheLayout.CPU, 16, role, transports=[LoopbackTransport(hub)],
                           **config)
    made: list[list[Any]] = []
    try:
        made.append(sides("prefill", "producer", hold_s=600.0))
        made.append(sides("prefill2", "producer"))
        made.append(sides("decode", "consumer", **consumer))
        yield made[0], made[1], made[2]
    finally:
        close_sides(*made)


class _HeldLane:
    """Holds the consumer's lane for one producer rank at ``at`` (as pulls stuck in handshakes with it for
    deadline_s would): a task in each of its places."""

    def __init__(self, side: Any, peer: str, at: str) -> None:
        self._started, self._release = threading.Semaphore(0), threading.Event()
        executor = side.engine._executor  # noqa: SLF001
        for _ in range(executor._per_peer):  # noqa: SLF001
            executor.submit_to(peer, self._hold, at=at)
        for _ in range(executor._per_peer):  # noqa: SLF001
            assert self._started.acquire(timeout=WAIT_S), f"{peer}'s lane never ran"

    def _hold(self) -> None:
        self._started.release()
        assert self._release.wait(3 * WAIT_S)

    def release(self) -> None:
        self._release.set()


def test_a_pull_queued_in_its_producers_lane_counts_its_deadline_from_when_it_is_sent() -> None:
    from engine.kvsim import engine_ref

    deadline_s = 1.0
    with _engines(deadline_s=deadline_s) as (prefill, prefill2, decode):
        for side, blocks_ in ((prefill[0], [1, 2]), (prefill2[0], [5, 6])):
            side.fill(seed=5, block_ids=blocks_, num_tokens=20)
            side.engine.finish("ok" if side is prefill[0] else "other", blocks_, 20)
        held = _HeldLane(decode[0], "prefill.r0", prefill[0].engine.address)
        try:
            decode[0].engine.expect("ok", engine_ref("prefill", ONE, prefill), [3, 4], 20)
            # Another producer's pull goes on meanwhile (before: it shared 4 workers with every peer's).
            decode[0].engine.expect("other", engine_ref("prefill2", ONE, prefill2), [7, 8], 20)
            decode[0].engine.wait("other", timeout_s=WAIT_S)
            with pytest.raises(TransferTimeout, match="not landed within"):  # the wait's own limit, not a stall
                decode[0].engine.wait("ok", timeout_s=_NOTHING_LANDED_S * deadline_s)
            assert "ok" not in decode[0].engine.take_finished_receiving()
        finally:
            held.release()
        decode[0].engine.wait("ok", timeout_s=WAIT_S)
        assert decode[0].mismatches(5, [3, 4], 20, Span(0, 20)) == []
        assert decode[0].mismatches(5, [7, 8], 20, Span(0, 20)) == []


def test_a_pull_aborted_while_queued_in_its_producers_lane_is_declined_not_sent() -> None:
    from engine.kvsim import engine_ref, wait_sent

    with _engines() as (prefill, _, decode):
        prefill[0].fill(seed=6, block_ids=[1, 2], num_tokens=20)
        prefill[0].engine.finish("a", [1, 2], 20)
        held = _HeldLane(decode[0], "prefill.r0", prefill[0].engine.address)
        try:
            decode[0].engine.expect("a", engine_ref("prefill", ONE, prefill), [3, 4], 20)
            decode[0].engine.abort("a")
        finally:
            held.release()
        assert wait_sent(prefill[0], "a", timeout_s=WAIT_S)["a"] is None  # a pull of nothing: freed at once
        assert prefill[0].engine.stats().tensors_sent == 0


def test_close_with_pulls_queued_for_a_dead_producer_returns_at_once_and_fails_them_closed() -> None:
    deadline_s = 8.0
    with _engines(deadline_s=deadline_s) as (_, _, decode):
        engine = decode[0].engine
        dead = EngineRef("deadprefill", ONE, (f"tcp://127.0.0.1:{free_port()}",))
        rids = [f"dead{i}" for i in range(N_STALE)]
        for i, rid in enumerate(rids):
            engine.expect(rid, dead, [i], 10)
        _until(lambda: "deadprefill.r0" in engine._peers._connecting, "the first pull's handshake")  # noqa: SLF001
        started = time.monotonic()
        engine.close()
        took = time.monotonic() - started
        assert took < 3.0, f"close() took {took:.2f}s with pulls queued for a dead producer (deadline_s={deadline_s})"
        for rid in rids:
            with pytest.raises(ClosedError):
                engine.wait(rid, timeout_s=0)
        assert not [t.name for t in threading.enumerate() if t.name.startswith("ncclkv-engine[decode.r0]")]


# The link opener: a responder's rendezvous with a peer dropped after its handshake ends at the drop (real data
# planes, one process).


def test_peers_dropped_between_their_handshake_and_the_rendezvous_hold_no_link_opener() -> None:
    """As many consumers as the producer rank has link openers pull from it and close right after the handshake,
    before joining their links' rendezvous; the producer drops them (their Bye), and a new consumer's pull, whose
    link needs an opener, lands at once. Before, each opener waited out deadline_s at the rendezvous of its dropped
    peer: every other peer's new link waited behind them (the healthy pull took most of deadline_s)."""
    from engine.kvsim import build_sides, close_sides, engine_ref

    from ncclkv.engine._engine import _LINK_OPENERS

    deadline_s = 8.0
    made: list[list[Any]] = []
    joined, reached = threading.Event(), [threading.Event() for _ in range(_LINK_OPENERS)]

    def sides(engine_id: str, role: str) -> list[Any]:
        made.append(build_sides(engine_id, ONE, GQA, CacheLayout.CPU, 16, role, deadline_s=deadline_s))
        return made[-1]

    def stops_before_the_rendezvous(answered: threading.Event) -> Callable[[str, str, str], Any]:
        def open_link(peer_id: str, store_addr: str, session: str) -> Any:
            answered.set()  # the handshake is answered: the producer's opener waits for us at the rendezvous
            assert joined.wait(WAIT_S)
            raise TransferError("stopped before joining the rendezvous")
        return open_link

    try:
        prefill = sides("prefill", "producer")
        producer = prefill[0].engine
        ref = engine_ref("prefill", ONE, prefill)
        for i in range(_LINK_OPENERS + 1):
            prefill[0].fill(seed=20 + i, block_ids=[i], num_tokens=16)
            producer.finish(f"r{i}", [i], 16)
        victims = [sides(f"victim{i}", "consumer")[0].engine for i in range(_LINK_OPENERS)]
        for i, victim in enumerate(victims):
            victim._peers._open_link = stops_before_the_rendezvous(reached[i])  # noqa: SLF001
            victim.expect(f"r{i}", ref, [0], 16)
        for answered in reached:
            assert answered.wait(WAIT_S)
        plane = producer._data_plane  # noqa: SLF001 - the links it is opening (None until open)
        _until(lambda: sum(link is None for link in plane._links.values()) == _LINK_OPENERS,  # noqa: SLF001
               "every link opener of the producer rank at a victim's rendezvous")
        joined.set()
        for victim in victims:
            victim.close()
        lost = [victim.config.peer_id for victim in victims]
        _until(lambda: not any(producer._channel.peer_alive(p) or producer._peers.get(p) for p in lost),  # noqa: SLF001
               "the victims dropped by the producer rank")
        healthy = sides("healthy", "consumer")[0]
        started = time.monotonic()
        healthy.engine.expect(f"r{_LINK_OPENERS}", ref, [1], 16)
        error: BaseException | None = None
        try:
            healthy.engine.wait(f"r{_LINK_OPENERS}", timeout_s=2 * deadline_s)
        except Exception as err:  # noqa: BLE001 - reported below, with the time it took
            error = err
        took = time.monotonic() - started
        print(f"\n[dead peer] a new consumer's pull beside {_LINK_OPENERS} peers dropped before their rendezvous: "
              f"{type(error).__name__ if error else 'landed'} after {took:.3f}s (deadline_s={deadline_s})")
        assert error is None and took < HEALTHY_S, f"the healthy pull took {took:.2f}s: {error!r}"
        assert healthy.mismatches(20 + _LINK_OPENERS, [1], 16, Span(0, 16)) == []
        assert not any(link is None for link in plane._links.values())  # noqa: SLF001 - no open left waiting
    finally:
        joined.set()
        close_sides(*made)

"""Params from a producer's earlier life, after it restarted under a fixed engine id at a new address.

vLLM's ``kv_transfer_params`` carry the producer's ``EngineRef``: every rank's
control address and, now, its channel incarnation. A prefill server with a
fixed engine id is killed and restarted elsewhere; the decode side moves to the
new address with the first fresh request. A request still carrying the old
params (a client's retry) used to move it back: ``PeerLinks.ensure`` took the
request's address as the truth, ``Channel.connect`` declared the live producer
moved and reset it, failing every load in flight from it, and the stale
request waited ``deadline_s`` on the dead address. Now a reference to a life of
the peer id that another replaced fails at once, naming both, and the live
producer is left alone.

Real processes, sockets and gloo links; order comes from the engines' own state
(a pull acknowledged, a request reported), never sleeps.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator

import pytest

from ncclkv.engine import EngineRef
from ncclkv.launch import free_port
from ncclkv.layout import KVGeometry, ParallelLayout
from ncclkv.paged import CacheLayout

from _engine_pool import Pool, Proc, blocks, build_engine
from _engine_workers import Outcome, Req

pytestmark = pytest.mark.multiprocess

GQA = KVGeometry(num_layers=4, num_kv_heads=4, head_size=32, dtype="float32")
ONE = ParallelLayout(1, 1)
DEADLINE_S = 8.0
FAST_S = 2.5  # "at once": a control round trip on two busy cores, far below deadline_s
POOL_SIZE = 3


@pytest.fixture(scope="module")
def engine_pool() -> Iterator[Pool]:
    """Three children are enough here (the session's pool has eight, for the layout matrix)."""
    with Pool(POOL_SIZE) as pool:
        yield pool


def _build(proc: Proc, engine_id: str, role: str, **config: object) -> EngineRef:
    """One engine rank in ``proc``; its EngineRef as a worker makes it, with the rank's incarnation."""
    ref = build_engine([proc], engine_id, ONE, GQA, CacheLayout.CPU, 16, role, deadline_s=DEADLINE_S, num_blocks=64,
                       **config)
    return dataclasses.replace(ref, incarnations=(proc.call("incarnation", key=engine_id),))


def _req(rid: str, seed: int, slot: int, num_tokens: int = 40) -> Req:
    return Req(rid, seed, num_tokens, blocks(num_tokens, 16, 4 * slot), blocks(num_tokens, 16, 4 * slot))


def _pull(producer: Proc, consumer: Proc, ref: EngineRef, req: Req) -> Outcome:
    producer.call("hold", key="fx-p", reqs=[req])
    consumer.call("expect", key="fx-d", producer=ref, reqs=[req])
    return consumer.call("wait", key="fx-d", reqs=[req])[req.rid]


def _stale_fails_fast(consumer: Proc, ref: EngineRef, req: Req) -> Outcome:
    started = time.monotonic()
    consumer.call("expect", key="fx-d", producer=ref, reqs=[req])
    outcome = consumer.call("wait", key="fx-d", reqs=[req])[req.rid]
    assert outcome.error_type == "PeerLostError" and "stale reference to 'fx-p.r0'" in outcome.message, outcome
    assert outcome.at - started < FAST_S, (outcome.at - started, outcome)  # not deadline_s on the dead address
    return outcome


def test_params_of_a_producers_earlier_life_fail_at_once_and_leave_the_restarted_one_alone(procs: Pool) -> None:
    old, consumer, new = procs[0], procs[1], procs[2]
    ref_old = _build(old, "fx-p", "producer")
    _build(consumer, "fx-d", "consumer")
    assert _pull(old, consumer, ref_old, _req("warm", 1, 0)).ok
    old.kill()
    ref_new = _build(new, "fx-p", "producer")  # the same engine id, restarted at another address
    (dead,), (live,) = ref_old.control_addrs, ref_new.control_addrs
    assert dead != live and ref_old.incarnations != ref_new.incarnations

    assert _pull(new, consumer, ref_new, _req("f1", 2, 1)).ok  # the consumer moves to the live address
    # A load in flight from the live producer: its pull acknowledged (parked there: not held yet).
    f2 = _req("f2", 3, 2)
    consumer.call("expect", key="fx-d", producer=ref_new, reqs=[f2])
    consumer.call("wait_acked", key="fx-d", rid="f2")
    # The stale params, with the old life's incarnation and as an older build wrote them (none): fail at once.
    for i, ref in enumerate((ref_old, dataclasses.replace(ref_old, incarnations=()))):
        outcome = _stale_fails_fast(consumer, ref, _req(f"stale{i}", 4 + i, 3 + i))
        assert repr(dead) in outcome.message and repr(live) in outcome.message, outcome
    # The live producer was left alone: the load in flight completes, and so do the fresh ones after.
    new.call("hold", key="fx-p", reqs=[f2])
    assert consumer.call("wait", key="fx-d", reqs=[f2])["f2"].ok
    for i in range(2):
        outcome = _pull(new, consumer, ref_new, _req(f"f{3 + i}", 6 + i, 5 + i))
        assert outcome.ok, outcome
    assert all(o.ok for o in new.call("take_sent", key="fx-p", rids=["f1", "f2", "f3", "f4"]).values())
    # Never moved back to the dead address (the stale requests' declines included), never reset the live one.
    logs = consumer.call("logs")
    assert [line for line in logs if f"is at {dead!r} now" in line] == [], logs
    assert [line for line in logs if f"is at {live!r} now" in line], logs  # f1's move, the only one
    assert consumer.call("stats", key="fx-d")["peers"] == ["fx-p.r0"]

    # A handshake naming the old life's incarnation is refused at once, both lives named; the live one's is not.
    (inc_old,), (inc_new,) = ref_old.incarnations, ref_new.incarnations
    kind, message, took = consumer.call("ensure", key="fx-d", peer_id="fx-p.r0", control_addr=dead,
                                        incarnation=inc_old)
    assert kind == "PeerLostError" and f"{inc_old:#x}" in message and f"{inc_new:#x}" in message, message
    assert took < FAST_S
    assert consumer.call("ensure", key="fx-d", peer_id="fx-p.r0", control_addr=live, incarnation=inc_new)[0] == "ok"


def test_a_handshake_naming_a_replaced_life_at_the_same_address_is_refused_at_once(procs: Pool) -> None:
    """Restarted at the same control port: only the incarnation tells the params of the old life from the new
    one's (a pull naming the old life would go to the new process and wait deadline_s for a request it never
    held). A pull passes its EngineRef's incarnation to ``PeerLinks.ensure`` as this does."""
    old, consumer, new = procs[0], procs[1], procs[2]
    port = free_port()
    ref_old = _build(old, "fx-p", "producer", control_port=port)
    _build(consumer, "fx-d", "consumer")
    assert _pull(old, consumer, ref_old, _req("warm", 1, 0)).ok
    old.kill()
    ref_new = _build(new, "fx-p", "producer", control_port=port)
    assert ref_new.control_addrs == ref_old.control_addrs and ref_new.incarnations != ref_old.incarnations
    assert _pull(new, consumer, ref_new, _req("f1", 2, 1)).ok
    (addr,), (inc_old,), (inc_new,) = ref_new.control_addrs, ref_old.incarnations, ref_new.incarnations
    kind, message, took = consumer.call("ensure", key="fx-d", peer_id="fx-p.r0", control_addr=addr,
                                        incarnation=inc_old)
    assert kind == "PeerLostError" and f"{inc_old:#x}" in message and f"{inc_new:#x}" in message, message
    assert took < FAST_S
    for incarnation in (inc_new, 0):  # the current life, and a reference that names none: as before
        assert consumer.call("ensure", key="fx-d", peer_id="fx-p.r0", control_addr=addr,
                             incarnation=incarnation)[0] == "ok"
    assert _pull(new, consumer, ref_new, _req("f2", 3, 2)).ok  # the live one left alone


def test_params_of_an_earlier_life_the_consumer_never_met_fail_at_once(procs: Pool) -> None:
    """The consumer met only the restarted producer; then a request carries params of the life before it (a
    client's retry, a slow proxy). Never heard of, that incarnation looked like a restart to come: the consumer
    moved to the dead address, reset the live producer (its load in flight failed at once) and waited deadline_s
    there. Incarnations grow with their channel's start time (protocol 7): one below the live life's is an
    earlier life, refused at once, naming both, and the live producer is left alone."""
    old, consumer, new = procs[0], procs[1], procs[2]
    ref_old = _build(old, "fx-p", "producer")
    old.kill()  # never pulled from: the consumer knows nothing of this life
    ref_new = _build(new, "fx-p", "producer")
    _build(consumer, "fx-d", "consumer")
    (dead,), (live,) = ref_old.control_addrs, ref_new.control_addrs
    (inc_old,), (inc_new,) = ref_old.incarnations, ref_new.incarnations
    assert inc_old < inc_new
    assert _pull(new, consumer, ref_new, _req("f1", 2, 1)).ok
    f2 = _req("f2", 3, 2)  # a load in flight from the live producer: its pull acknowledged, not held yet
    consumer.call("expect", key="fx-d", producer=ref_new, reqs=[f2])
    consumer.call("wait_acked", key="fx-d", rid="f2")
    outcome = _stale_fails_fast(consumer, ref_old, _req("stale", 4, 3))
    assert f"{inc_old:#x}" in outcome.message and f"{inc_new:#x}" in outcome.message, outcome
    assert repr(dead) in outcome.message and repr(live) in outcome.message and "earlier than" in outcome.message
    new.call("hold", key="fx-p", reqs=[f2])
    assert consumer.call("wait", key="fx-d", reqs=[f2])["f2"].ok
    assert _pull(new, consumer, ref_new, _req("f3", 5, 4)).ok
    logs = consumer.call("logs")
    assert [line for line in logs if f"is at {dead!r} now" in line] == [], logs  # never moved to the dead one
    # A later life than the live one (a restart the consumer has yet to meet) is still followed: not refused.
    kind, message, _ = consumer.call("ensure", key="fx-d", peer_id="fx-p.r0", control_addr=live,
                                     incarnation=inc_new + 1)
    assert kind == "ok", message


def test_params_naming_the_live_producer_at_a_wrong_address_fail_at_once_and_leave_it_alone(procs: Pool) -> None:
    """Params of the producer's current life (its incarnation) with another address (edited, or another name of
    its host): before, the consumer took the producer as moved, dropped the live peer, and failed the loads in
    flight from it (found by review: two good requests stalled 10 s). A life has one address: the request fails
    at once, naming both, and nothing of the live peer is touched."""
    producer, consumer = procs[0], procs[1]
    ref = _build(producer, "fx-p", "producer")
    _build(consumer, "fx-d", "consumer")
    assert _pull(producer, consumer, ref, _req("warm", 1, 0)).ok
    in_flight = _req("f1", 2, 1)
    consumer.call("expect", key="fx-d", producer=ref, reqs=[in_flight])
    consumer.call("wait_acked", key="fx-d", rid="f1")
    (live,), wrong = ref.control_addrs, f"tcp://127.0.0.1:{free_port()}"
    started = time.monotonic()
    bad = _req("bad", 3, 2)
    consumer.call("expect", key="fx-d", producer=dataclasses.replace(ref, control_addrs=(wrong,)), reqs=[bad])
    outcome = consumer.call("wait", key="fx-d", reqs=[bad])["bad"]
    assert outcome.error_type == "PeerLostError" and "the reference's address is wrong" in outcome.message, outcome
    assert repr(wrong) in outcome.message and repr(live) in outcome.message, outcome
    assert outcome.at - started < FAST_S, (outcome.at - started, outcome)
    producer.call("hold", key="fx-p", reqs=[in_flight])
    assert consumer.call("wait", key="fx-d", reqs=[in_flight])["f1"].ok  # the load in flight was left alone
    assert _pull(producer, consumer, ref, _req("after", 4, 3)).ok
    logs = consumer.call("logs")
    assert [line for line in logs if "now, no longer at" in line] == [], logs  # never taken as moved


def _restarted_elsewhere(procs: Pool) -> tuple[Proc, Proc, Proc, EngineRef, EngineRef]:
    """Producer fx-p on procs[0], the same engine id restarted at another address on procs[2] (a later life),
    consumer fx-d on procs[1]; the old producer never answers a handshake: (old, consumer, new, old's reference,
    new's)."""
    old, consumer, new = procs[0], procs[1], procs[2]
    ref_old = _build(old, "fx-p", "producer")
    ref_new = _build(new, "fx-p", "producer")
    _build(consumer, "fx-d", "consumer")
    assert ref_old.control_addrs != ref_new.control_addrs and ref_old.incarnations < ref_new.incarnations
    old.call("stall", key="fx-p", phase="handshake")
    return old, consumer, new, ref_old, ref_new


def _pull_from_the_new_life(old: Proc, consumer: Proc, new: Proc, ref_new: EngineRef, fresh: Req) -> float:
    """Kill the old producer, then pull ``fresh`` naming the new life: it completes within FAST_S (not after the
    dead address's deadline_s). Returns when the pull started."""
    old.kill()
    new.call("hold", key="fx-p", reqs=[fresh])
    started = time.monotonic()
    consumer.call("expect", key="fx-d", producer=ref_new, reqs=[fresh])
    outcome = consumer.call("wait", key="fx-d", reqs=[fresh])[fresh.rid]
    assert outcome.ok and outcome.at - started < FAST_S, (outcome.at - started, outcome)
    return started


def test_a_pull_from_the_restarted_producer_does_not_wait_for_a_handshake_at_the_dead_address(procs: Pool) -> None:
    """A pull to the producer's old address is shaking hands there (the old process never answers: it is stalled,
    then killed) when a pull naming the producer restarted at another address starts. Both wait on the consumer's
    gate for that peer id: the new pull waited for the old attempt, deadline_s, and often failed with 'handshake
    with ... still in progress'. A handshake naming a later life (its incarnation) at another address than the one
    the gate is held for takes over: the old attempt is abandoned (the channel moves, its request fails as reset,
    and sent again it is refused as stale once the new life is met), and the new pull goes at once."""
    old, consumer, new, ref_old, ref_new = _restarted_elsewhere(procs)
    (dead,) = ref_old.control_addrs
    stale = _req("stale", 1, 0)
    consumer.call("expect", key="fx-d", producer=ref_old, reqs=[stale])
    assert old.note() == ("stalled", "handshake")  # the consumer's handshake with the dead address holds its gate
    started = _pull_from_the_new_life(old, consumer, new, ref_new, _req("fresh", 2, 1))
    failed = consumer.call("wait", key="fx-d", reqs=[stale])["stale"]
    # The pull naming the dead life: its handshake was abandoned, and sent again it is refused as stale, at once.
    assert failed.error_type == "PeerLostError" and "stale reference to 'fx-p.r0'" in failed.message, failed
    assert failed.at - started < FAST_S, (failed.at - started, failed)
    # The live producer was left alone: the next pull goes to it, and the consumer never moved back.
    assert _pull(new, consumer, ref_new, _req("after", 3, 2)).ok
    assert all(o.ok for o in new.call("take_sent", key="fx-p", rids=["fresh", "after"]).values())
    logs = consumer.call("logs")
    assert [line for line in logs if f"is at {dead!r} now" in line] == [], logs


def test_a_pull_from_the_restarted_producer_does_not_queue_behind_pulls_running_to_the_dead_address(
        procs: Pool) -> None:
    """As above, with every task of the producer rank's lane (4 at once) a pull naming the dead address: one shakes
    hands there, three wait at the gate. The pull naming the restarted producer was queued in that lane behind
    them: it never reached the gate to take it over, and started only once the first of them failed, after
    deadline_s (fail-fast drops only the tasks queued for the dead address)."""
    old, consumer, new, ref_old, ref_new = _restarted_elsewhere(procs)
    (dead,) = ref_old.control_addrs
    stale = [_req(f"stale{i}", 1 + i, i) for i in range(4)]  # the lane's 4 tasks, all at the dead address
    consumer.call("expect", key="fx-d", producer=ref_old, reqs=stale)
    assert old.note() == ("stalled", "handshake")
    consumer.call("gate_users", key="fx-d", peer_id="fx-p.r0", count=len(stale))  # all 4 running, none queued
    started = _pull_from_the_new_life(old, consumer, new, ref_new, _req("fresh", 9, 8))
    for failed in consumer.call("wait", key="fx-d", reqs=stale).values():  # refused as stale, at once
        assert failed.error_type == "PeerLostError" and "stale reference to 'fx-p.r0'" in failed.message, failed
        assert failed.at - started < FAST_S, (failed.at - started, failed)
    assert _pull(new, consumer, ref_new, _req("after", 10, 9)).ok
    logs = consumer.call("logs")
    assert [line for line in logs if f"is at {dead!r} now" in line] == [], logs

"""Peers that are there again after their state about each other went: real processes, real sockets, gloo.

A process stopped (SIGSTOP) longer than its peer's deadline is declared lost by
the peer, which drops its handshake and link; the stopped one leaves its stop
out of its own deadlines and loses no one. Once it runs, the peer tells it so
(``Reset``) and the next request shakes hands again, instead of being refused
"before any handshake" forever. A process restarted under the same engine id,
at the same control address or another, is told from its earlier life by its
channel's incarnation: the earlier one is lost at once (its requests fail, its
link is closed, what the producer held for it is released) and the new one is
served. A pull that failed on the consumer is declined, so its producer frees
the blocks instead of holding them ``hold_s``. The ``Reset`` a peer owes a
life it lost names that life's incarnation: sent on a path opened to the peer
id again, it may reach a process restarted under that id, which ignores it.

Order comes from the engines' own state (a peer seen lost, a request reported),
never from sleeps; the stop itself lasts until the peer declared the stopped
process lost, which is the fault under test.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator

import pytest

from ncclkv.engine import EngineRef
from ncclkv.launch import free_port
from ncclkv.layout import KVGeometry, ParallelLayout, Route, Span
from ncclkv.paged import CacheLayout
from ncclkv.protocol import RouteMsg

from _engine_pool import Pool, Proc, blocks, build_engine
from _engine_workers import Outcome, Req

pytestmark = pytest.mark.multiprocess

GQA = KVGeometry(num_layers=4, num_kv_heads=4, head_size=32, dtype="float32")
ONE = ParallelLayout(1, 1)
DEADLINE_S = 3.0
LATE_S = 2.5  # a heartbeat tick and a busy core on top of the deadline
POOL_SIZE = 4


@pytest.fixture(scope="module")
def engine_pool() -> Iterator[Pool]:
    """Four children are enough here (the session's pool has eight, for the layout matrix)."""
    with Pool(POOL_SIZE) as pool:
        yield pool


def _build(proc: Proc, engine_id: str, role: str, **config: object) -> EngineRef:
    config = {"deadline_s": DEADLINE_S, "num_blocks": 64, **config}
    return build_engine([proc], engine_id, ONE, GQA, CacheLayout.CPU, 16, role, **config)


def _req(rid: str, seed: int, slot: int, num_tokens: int = 40) -> Req:
    return Req(rid, seed, num_tokens, blocks(num_tokens, 16, 4 * slot), blocks(num_tokens, 16, 4 * slot))


def _pull(producer: Proc, key_p: str, consumer: Proc, key_d: str, ref_p: EngineRef, req: Req) -> Outcome:
    producer.call("hold", key=key_p, reqs=[req])
    consumer.call("expect", key=key_d, producer=ref_p, reqs=[req])
    return consumer.call("wait", key=key_d, reqs=[req])[req.rid]


def _push(producer: Proc, ref_p: EngineRef, consumer: Proc, ref_c: EngineRef, req: Req) -> tuple[Outcome, Outcome]:
    consumer.call("expect", key=ref_c.engine_id, producer=ref_p, reqs=[req], push=True)
    sent = producer.call("push", key=ref_p.engine_id, req=req, consumer=ref_c)
    return sent, consumer.call("wait", key=ref_c.engine_id, reqs=[req])[req.rid]


# -- D1: a process stopped longer than its peer's deadline, while idle ---------------------------------


def test_a_consumer_stopped_longer_than_the_deadline_pulls_again_once_it_runs(procs: Pool) -> None:
    producer, consumer = procs[0], procs[1]
    ref_p = _build(producer, "idle-p", "producer")
    _build(consumer, "idle-d", "consumer")
    assert _pull(producer, "idle-p", consumer, "idle-d", ref_p, _req("warm", 1, 0)).ok
    consumer.signal(signal.SIGSTOP)
    producer.call("peer_gone", key="idle-p", peer_id="idle-d.r0")  # lost there: handshake and link dropped
    consumer.signal(signal.SIGCONT)
    # The consumer lost no one (its stop is left out of its deadlines) and still had the producer's handshake
    # and a link whose far end is closed: every pull was refused "before any handshake", for ever.
    for i in range(2):
        outcome = _pull(producer, "idle-p", consumer, "idle-d", ref_p, _req(f"after{i}", 2 + i, 1 + i))
        assert outcome.ok, outcome
    told = consumer.call("logs", contains="reset: it had declared us lost")
    assert len(told) == 1 and "peer 'idle-p.r0'" in told[0], consumer.call("logs")


def test_a_producer_stopped_longer_than_the_deadline_pushes_again_once_it_runs(procs: Pool) -> None:
    producer, consumer = procs[0], procs[1]
    ref_p = _build(producer, "pidle-p", "producer")
    ref_c = _build(consumer, "pidle-d", "consumer")
    sent, got = _push(producer, ref_p, consumer, ref_c, _req("warm", 1, 0))
    assert sent.ok and got.ok, (sent, got)
    producer.signal(signal.SIGSTOP)
    consumer.call("peer_gone", key="pidle-d", peer_id="pidle-p.r0")
    producer.signal(signal.SIGCONT)
    for i in range(2):  # before: every offer refused "push offer ... before any handshake"
        sent, got = _push(producer, ref_p, consumer, ref_c, _req(f"after{i}", 2 + i, 1 + i))
        assert sent.ok and got.ok, (sent, got)
    told = producer.call("logs", contains="reset: it had declared us lost")
    assert len(told) == 1 and "peer 'pidle-d.r0'" in told[0], producer.call("logs")


# -- D2: a producer restarted at the same address --------------------------------------------------


def test_a_producer_restarted_at_the_same_address_is_told_apart_and_serves_the_next_pull(procs: Pool) -> None:
    """Same engine id, same control port: the consumer's DEALER reconnects to the new process and its
    heartbeats are echoed, so it never lost the old one, and its pulls went to the old one's handshake and
    link ('before any handshake' for ever). The new one's first frame names another incarnation."""
    old, consumer, new = procs[0], procs[1], procs[2]
    port = free_port()
    ref_old = _build(old, "same-p", "producer", control_port=port)
    _build(consumer, "same-d", "consumer", deadline_s=30.0)  # it never loses the old one by silence
    assert _pull(old, "same-p", consumer, "same-d", ref_old, _req("warm", 1, 0)).ok
    killed_at = old.kill()
    ref_new = _build(new, "same-p", "producer", control_port=port)
    assert ref_new == ref_old
    for i in range(2):
        outcome = _pull(new, "same-p", consumer, "same-d", ref_new, _req(f"after{i}", 2 + i, 1 + i))
        assert outcome.ok, outcome
    assert outcome.at - killed_at < DEADLINE_S + LATE_S  # well before the consumer's 30 s deadline
    lost = consumer.call("logs", contains="channel 'same-d.r0': peer 'same-p.r0' lost: it restarted: incarnation")
    assert len(lost) == 1, consumer.call("logs")
    assert list(consumer.call("links", key="same-d")["kept"].values()) == ["same-p.r0"]  # the new one's only


# -- D3: a consumer restarted under the same engine id -------------------------------------------------


def test_a_consumer_restarted_under_its_engine_id_retires_the_old_ones_link(procs: Pool) -> None:
    """The old consumer is stopped (it keeps its connections: the producer would lose it only after its
    deadline) and a new process under its engine id pulls: the producer kept the old one's link, its threads
    and gloo pair, for as long as the new one talked to it ('a replaced link stays open while healthy')."""
    producer, old, new = procs[0], procs[1], procs[2]
    ref_p = _build(producer, "crst-p", "producer")
    _build(old, "crst-d", "consumer")
    assert _pull(producer, "crst-p", old, "crst-d", ref_p, _req("warm", 1, 0)).ok
    (old_link,) = producer.call("links", key="crst-p")["kept"]
    old.signal(signal.SIGSTOP)
    _build(new, "crst-d", "consumer")
    assert _pull(producer, "crst-p", new, "crst-d", ref_p, _req("b", 2, 1)).ok
    links = producer.call("links", key="crst-p")
    assert list(links["kept"].values()) == ["crst-d.r0"] and old_link not in links["kept"], links
    assert old_link not in links["threads"], links  # closed: its threads ended
    assert producer.call("logs", contains="peer 'crst-d.r0' lost: it restarted"), producer.call("logs")
    old.kill()


def test_a_held_request_whose_consumer_rank_is_lost_before_it_pulled_is_released(procs: Pool) -> None:
    """Consumer rank 0 of two pulled, rank 1 is killed before it did: the producer released the blocks only
    after hold_s; now at the loss, with an error naming the rank."""
    producer, rank0, rank1 = procs[0], procs[1], procs[2]
    ref_p = _build(producer, "rel-p", "producer", hold_s=120.0)
    build_engine([rank0, rank1], "rel-d", ParallelLayout(2, 1), GQA, CacheLayout.CPU, 16, "consumer",
                 deadline_s=DEADLINE_S, num_blocks=64)
    warm, x = _req("warm", 1, 0), _req("x", 2, 1)
    producer.call("hold", key="rel-p", reqs=[warm, x])
    for rank in (rank0, rank1):  # both ranks shake hands with the producer
        rank.call("expect", key="rel-d", producer=ref_p, reqs=[warm])
    for rank in (rank0, rank1):
        assert rank.call("wait", key="rel-d", reqs=[warm])["warm"].ok
    rank0.call("expect", key="rel-d", producer=ref_p, reqs=[x])
    assert rank0.call("wait", key="rel-d", reqs=[x])["x"].ok  # x is held now for rank 1 alone
    killed_at = rank1.kill()
    outcome = producer.call("take_sent", key="rel-p", rids=["x"], timeout_s=DEADLINE_S + 3 * LATE_S)["x"]
    assert outcome.error_type == "TransferError" and "consumer rank 'rel-d.r1' was lost" in outcome.message, outcome
    assert outcome.at - killed_at < DEADLINE_S + LATE_S, outcome


# -- D4: a producer restarted at another address; a pull that failed on the consumer ----------------------


def test_a_producer_restarted_at_a_new_address_serves_the_next_pull(procs: Pool) -> None:
    """The consumer is given the new process's EngineRef right after the old one died: its cached handshake
    and DEALER led to the dead address (Channel.connect did nothing for a peer alive), and the pull failed."""
    old, consumer, new = procs[0], procs[1], procs[2]
    ref_old = _build(old, "mv-p", "producer")
    _build(consumer, "mv-d", "consumer")
    assert _pull(old, "mv-p", consumer, "mv-d", ref_old, _req("warm", 1, 0)).ok
    ref_new = _build(new, "mv-p", "producer")  # the restarted process, up before the old one is gone
    assert ref_new.control_addrs != ref_old.control_addrs
    killed_at = old.kill()
    outcome = _pull(new, "mv-p", consumer, "mv-d", ref_new, _req("b", 2, 1))
    assert outcome.ok and outcome.at - killed_at < DEADLINE_S, outcome
    assert new.call("take_sent", key="mv-p", rids=["b"])["b"].ok


def _restarted_after_pushing(procs: Pool, name: str, *, name_life: bool = False
                             ) -> tuple[Proc, Proc, Proc, EngineRef, EngineRef, EngineRef]:
    """Producer ``name``-p on procs[0] pushed to consumer ``name``-d on procs[1] (which reached it only on its
    ROUTER); procs[2] is a new process under the producer's engine id, at another address: (old, consumer, new,
    the old producer's reference, the consumer's, the new producer's: naming its life if ``name_life``)."""
    old, consumer, new = procs[0], procs[1], procs[2]
    ref_old = _build(old, f"{name}-p", "producer")
    ref_c = _build(consumer, f"{name}-d", "consumer")
    sent, got = _push(old, ref_old, consumer, ref_c, _req("warm", 1, 0))
    assert sent.ok and got.ok, (sent, got)
    built = _build(new, f"{name}-p", "producer")
    assert built.control_addrs != ref_old.control_addrs
    ref_new = EngineRef(built.engine_id, built.layout, built.control_addrs,
                        (new.call("incarnation", key=f"{name}-p"),)) if name_life else built
    return old, consumer, new, ref_old, ref_c, ref_new


def test_a_producer_that_only_reached_the_consumer_serves_the_next_pull_at_its_new_address(procs: Pool) -> None:
    """The producer pushed: its channel connected to the consumer's, which reached it only on its ROUTER. It
    restarted at another address while the old process is stopped (its connection stays). Given the new one's
    EngineRef, the consumer kept its handshake with the old life (connect() did nothing for a peer alive), and
    the pull went to the stopped one on its inbound path and failed at deadline_s ('nothing heard'). That
    life's handshake named its address: the consumer now moves to the new one at once."""
    old, consumer, new, ref_old, _, ref_new = _restarted_after_pushing(procs, "imv")
    stopped_at = old.signal(signal.SIGSTOP)
    try:
        outcome = _pull(new, "imv-p", consumer, "imv-d", ref_new, _req("b", 2, 1))
        assert outcome.ok and outcome.at - stopped_at < DEADLINE_S, outcome
        assert new.call("take_sent", key="imv-p", rids=["b"])["b"].ok
    finally:
        old.kill()


def test_a_consumer_that_only_reached_the_producer_takes_the_next_push_at_its_new_address(procs: Pool) -> None:
    """The same the other way: the consumer pulled (the producer reached it only on its ROUTER) and restarted
    at another address while the old process is stopped. The producer's push to the new one went to the
    stopped one's inbound path and failed at deadline_s; now it goes to the new address at once."""
    producer, old, new = procs[0], procs[1], procs[2]
    ref_p = _build(producer, "imc-p", "producer")
    ref_old = _build(old, "imc-d", "consumer")
    assert _pull(producer, "imc-p", old, "imc-d", ref_p, _req("warm", 1, 0)).ok
    ref_new = _build(new, "imc-d", "consumer")
    assert ref_new.control_addrs != ref_old.control_addrs
    stopped_at = old.signal(signal.SIGSTOP)
    try:
        sent, got = _push(producer, ref_p, new, ref_new, _req("b", 2, 1))
        assert sent.ok and got.ok, (sent, got)
        assert sent.at - stopped_at < DEADLINE_S, sent
    finally:
        old.kill()


def test_the_loss_of_a_producer_that_only_reached_the_consumer_spares_a_pull_from_its_new_address(
        procs: Pool) -> None:
    """The producer pushed (the consumer reached it only on its ROUTER), then hung (stopped) with pulls of the
    consumer's waiting on it, and was restarted at another address; the next request names the new one and waits
    in the rank's lane behind those pulls. The old process is killed: the consumer's send to it fails, and that
    loss carried no address (None: 'everything of that peer id'), so it failed the request expected from the new
    life as well ('send failed'), where a loss of a life our DEALER reached spares it. The loss now carries the
    address that life's handshake named."""
    old, consumer, new, ref_old, _, ref_new = _restarted_after_pushing(procs, "ilost")
    hung = [_req(f"hung{i}", 2 + i, 1 + i) for i in range(4)]  # as many as the rank's lane runs at once
    old.call("hold", key="ilost-p", reqs=hung)
    old.signal(signal.SIGSTOP)
    try:
        consumer.call("expect", key="ilost-d", producer=ref_old, reqs=hung)  # their pulls wait on the stopped one
        again = _req("again", 9, 8)
        new.call("hold", key="ilost-p", reqs=[again])
        consumer.call("expect", key="ilost-d", producer=ref_new, reqs=[again])  # queued behind them
    finally:
        old.kill()
    outcome = consumer.call("wait", key="ilost-d", reqs=[again])["again"]
    assert outcome.ok, outcome  # before: PeerLostError "... send failed: Host unreachable"
    assert new.call("take_sent", key="ilost-p", rids=["again"])["again"].ok
    failed = consumer.call("wait", key="ilost-d", reqs=hung)
    assert all(o.error_type is not None for o in failed.values()), failed


def test_a_pull_that_failed_on_the_consumer_is_declined_so_the_producer_frees_it(procs: Pool) -> None:
    producer, consumer = procs[0], procs[1]
    ref_p = _build(producer, "dcl-p", "producer", hold_s=120.0)
    _build(consumer, "dcl-d", "consumer")
    lie = _req("lie", 1, 0)
    beyond = RouteMsg.from_route(Route(0, 0, Span(0, 9), Span(0, 4), Span(0, 40)))  # refused by the producer
    consumer.call("tamper", key="dcl-d", tag="pull", rid="lie", routes=(beyond,))
    failed = _pull(producer, "dcl-p", consumer, "dcl-d", ref_p, lie)
    assert failed.error_type == "ProtocolError" and "our plan gives" in failed.message, failed
    # Declined (a pull of nothing, untampered): freed now, not after hold_s=120.
    outcome = producer.call("take_sent", key="dcl-p", rids=["lie"], timeout_s=DEADLINE_S + LATE_S)["lie"]
    assert outcome.at - failed.at < DEADLINE_S + LATE_S, outcome


# -- D5: a Reset owed to a lost life, sent to the next life under its engine id --------------------------


def test_a_consumer_restarted_after_its_producer_lost_it_takes_the_next_push(procs: Pool) -> None:
    """The consumer pulled (its channel connected to the producer's) and was killed; the producer declared it
    lost and owed that life a Reset. A new process under the consumer's engine id, at another address, expects
    a push: the producer connects to it and the owed Reset went first on that path. The new consumer took it
    as its own, dropped the producer's handshake and failed the push with PeerResetError; now the Reset names
    the dead life's incarnation, and the new one ignores it."""
    producer, old, new = procs[0], procs[1], procs[2]
    ref_p = _build(producer, "rnl-p", "producer")
    ref_old = _build(old, "rnl-d", "consumer")
    assert _pull(producer, "rnl-p", old, "rnl-d", ref_p, _req("warm", 1, 0)).ok
    old.kill()
    producer.call("peer_gone", key="rnl-p", peer_id="rnl-d.r0")  # lost there: a Reset is owed to that life
    ref_new = _build(new, "rnl-d", "consumer")
    assert ref_new.control_addrs != ref_old.control_addrs
    for i in range(2):
        sent, got = _push(producer, ref_p, new, ref_new, _req(f"after{i}", 2 + i, 1 + i))
        assert sent.ok and got.ok, (sent, got)  # ok: landed byte for byte, and reported
    assert new.call("logs", contains="reset: it had declared us lost") == [], new.call("logs")
    assert new.call("stats", key="rnl-d")["channel"]["stale_resets"] == 1


def test_a_producer_restarted_at_the_same_address_after_its_consumer_lost_it_is_not_reset(procs: Pool) -> None:
    """The consumer declared the killed producer lost (its DEALER to it closed) and owed that life a Reset; a
    new producer binds the same port and the consumer's next pull opens a DEALER to it: the owed Reset went
    first, and the new producer took it as its own (a peer lost, logged as a reset, for a life it never was).
    Now it ignores it, and serves the pull."""
    old, consumer, new = procs[0], procs[1], procs[2]
    port = free_port()
    ref_old = _build(old, "rsa-p", "producer", control_port=port)
    _build(consumer, "rsa-d", "consumer")
    assert _pull(old, "rsa-p", consumer, "rsa-d", ref_old, _req("warm", 1, 0)).ok
    old.kill()
    consumer.call("peer_gone", key="rsa-d", peer_id="rsa-p.r0")  # lost there, by its deadline
    ref_new = _build(new, "rsa-p", "producer", control_port=port)
    assert ref_new == ref_old
    for i in range(2):
        outcome = _pull(new, "rsa-p", consumer, "rsa-d", ref_new, _req(f"after{i}", 2 + i, 1 + i))
        assert outcome.ok, outcome
    assert new.call("logs", contains="reset: it had declared us lost") == [], new.call("logs")
    assert new.call("stats", key="rsa-p")["channel"]["stale_resets"] == 1



def test_a_push_expected_from_a_restarted_producer_is_not_failed_by_the_loss_of_its_old_life(procs: Pool) -> None:
    """The producer pushed to the consumer, then hung (stopped) and was restarted at another address. The consumer
    expects the next push from the new life (its EngineRef names that life's incarnation, as the connector's
    do), before the new one's first frame: that frame makes the old life lost (it restarted), and the loss failed
    every push expected from the engine, this one included (PeerResetError 'it restarted'); the new producer's
    offer was then refused ('it already failed here'). A push whose reference names the life alive now is not
    the lost one's: it is left to that life."""
    old, consumer, new, _, ref_c, ref_new = _restarted_after_pushing(procs, "rpush", name_life=True)
    old.signal(signal.SIGSTOP)
    try:
        sent, got = _push(new, ref_new, consumer, ref_c, _req("b", 2, 1))
        assert sent.ok and got.ok, (sent, got)  # before: PeerResetError "... it restarted: incarnation ..."
        assert consumer.call("logs", contains="lost: it restarted"), consumer.call("logs")  # the old life's loss
    finally:
        old.kill()


def test_a_push_expected_from_a_producer_at_its_new_address_is_not_failed_when_a_pull_moves_the_consumer_there(
        procs: Pool) -> None:
    """The producer pushed to the consumer, then hung (stopped) and was restarted at another address. The consumer
    expects the next push from the new life, then pulls another request from it before the new one pushed (a
    deployment where some requests are pushed, others pulled): the pull moves the consumer's channel to the new
    address, which loses the old life (PeerResetError, its address the old one, no incarnation: no new one was
    heard), and that loss failed every push expected from the engine, the one naming the new address included;
    the new producer's offer was then refused ('it already failed here'). A push from the rank at another address
    than the life lost is not that life's, as for a pull."""
    old, consumer, new = procs[0], procs[1], procs[2]
    ref_old = _build(old, "mpush-p", "producer")
    ref_c = _build(consumer, "mpush-d", "consumer")
    sent, got = _push(old, ref_old, consumer, ref_c, _req("warm", 1, 0))
    assert sent.ok and got.ok, (sent, got)
    built = _build(new, "mpush-p", "producer")
    ref_new = EngineRef(built.engine_id, built.layout, built.control_addrs,
                        (new.call("incarnation", key="mpush-p"),))
    assert ref_new.control_addrs != ref_old.control_addrs
    old.signal(signal.SIGSTOP)
    try:
        pushed = _req("b", 2, 1)
        consumer.call("expect", key="mpush-d", producer=ref_new, reqs=[pushed], push=True)
        assert _pull(new, "mpush-p", consumer, "mpush-d", ref_new, _req("c", 3, 2)).ok  # moves the channel
        assert consumer.call("logs", contains="no longer at"), consumer.call("logs")  # it moved the channel
        sent = new.call("push", key="mpush-p", req=pushed, consumer=ref_c)
        got = consumer.call("wait", key="mpush-d", reqs=[pushed])["b"]
        assert sent.ok and got.ok, (sent, got)  # before: PeerResetError "... connect() to it at ...: it moved"
    finally:
        old.kill()

"""One peer whose link is slow to open must not delay the engine rank's other peers (real processes).

Every engine rank handles its control messages on one dispatcher thread.
A message that needs a link still opening (a pull to serve on it, an
announcement to post a receive for) must not wait there for it: the other
peers' pulls, announcements, Done and push offers would queue behind it, and
their own no-progress deadlines are as long as that wait (``deadline_s``).

Here one pair's link is held in a child process (``hold_link``: its opening
thread waits on an event of that process, never a sleep) while a third,
healthy process pulls through the same engine rank; the healthy request must
land byte-exact in well under ``deadline_s`` (before the fix it waited the
whole deadline_s, or failed). Each phase is reached through a note a child
posts (the link held; the message reached the dispatcher). Then the held link
goes on, and what waited for it runs, in order, and lands byte-exact; or its
peer is stopped with SIGSTOP, and what waited for its link fails, typed, once
the peer is lost. Below those, ``PeerLinks.when_open`` and ``known()`` in this
process with a stand-in channel and data plane: the order of what waits for
a link, its typed failure when the link is dropped, closed or fails to open,
and ``known()`` returning at the handshake's reply while its link still opens.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pytest
from msgspec.structs import replace

from ncclkv.auth import ChannelAuth
from ncclkv.engine import EngineRef
from ncclkv.engine._links import OnOpen, Peer, PeerLinks
from ncclkv.errors import ClosedError, PeerLostError, TransferTimeout
from ncclkv.layout import KVGeometry, ParallelLayout
from ncclkv.paged import CacheLayout
from ncclkv.protocol import Handshake

from _engine_pool import Pool, Proc, blocks, build_engine
from _engine_workers import Outcome, Req

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]

GQA = KVGeometry(num_layers=4, num_kv_heads=4, head_size=32, dtype="float32")
DEADLINE_S = 8.0
HEALTHY_S = 3.0  # a healthy pull of 40 tokens over an open link takes well under a second here
LATE_S = 4.0  # a loss is noticed a heartbeat tick after deadline_s, on 2 busy cores
TYPED_FAILURES = {"TransferError", "TransferTimeout", "PeerLostError"}


def _build(proc: Proc, engine_id: str, role: str, cache: CacheLayout = CacheLayout.CPU) -> EngineRef:
    return build_engine([proc], engine_id, ParallelLayout(1, 1), GQA, cache, 16, role, deadline_s=DEADLINE_S,
                        num_blocks=64)


def _req(rid: str, seed: int, slot: int, num_tokens: int = 40) -> Req:
    """A request of ``num_tokens`` in 16-token blocks; ``slot`` keeps requests' blocks apart on both sides."""
    return Req(rid, seed, num_tokens, blocks(num_tokens, 16, 4 * slot), blocks(num_tokens, 16, 4 * slot))


def _assert_ok(outcomes: dict[str, Outcome], where: str) -> None:
    bad = {rid: o for rid, o in outcomes.items() if not o.ok}
    assert not bad, f"{where}: {bad}"


def _warm_pull(producer: Proc, key_p: str, ref_p: EngineRef, consumer: Proc, key_d: str) -> None:
    """A first pull between the healthy pair, off the clock: its handshake and link (a store connect may take 5 s
    here) are made before anything is held."""
    warm = _req("warm", 1, 0)
    producer.call("hold", key=key_p, reqs=[warm])
    consumer.call("expect", key=key_d, producer=ref_p, reqs=[warm])
    _assert_ok(consumer.call("wait", key=key_d, reqs=[warm]), "warm-up pull")


def _healthy_pull(ref_p: EngineRef, consumer: Proc, key_d: str, req: Req, what: str) -> None:
    """``consumer`` pulls ``req``, already held by producer ``ref_p`` (a pair whose link is open): it lands
    byte-exact within HEALTHY_S of expect()."""
    started = time.monotonic()
    consumer.call("expect", key=key_d, producer=ref_p, reqs=[req])
    outcome = consumer.call("wait", key=key_d, reqs=[req])[req.rid]
    took = outcome.at - started  # time.monotonic() is one clock for every process of the machine
    print(f"\n[slow peer] {what}: healthy pull {outcome.error_type or 'landed'} {took:.3f}s after expect() "
          f"(deadline_s={DEADLINE_S})")
    assert outcome.error_type is None and not outcome.mismatches, f"{what}: healthy pull {outcome}"
    assert took < HEALTHY_S, f"{what}: the healthy pull took {took:.2f}s (deadline_s={DEADLINE_S}): {outcome}"


def _victim_pulls_while_its_link_opens(procs: Pool, tag: str) -> tuple[EngineRef, Req]:
    """Producer ``{tag}-p`` (procs[0]) starts a push of ``pushed`` to consumer ``{tag}-v`` (procs[1]), which
    answers the handshake and holds its end of the new link before the rendezvous; under that handshake the
    victim then pulls ``pulled``, which reaches the producer's dispatcher while their link is still opening.
    The healthy consumer ``{tag}-h`` (procs[2]) has a link to the producer already. Returns (producer ref, fine:
    a request the producer holds for the healthy consumer)."""
    producer, victim, healthy = procs[0], procs[1], procs[2]
    ref_p = _build(producer, f"{tag}-p", "producer")
    ref_v = _build(victim, f"{tag}-v", "consumer")
    _build(healthy, f"{tag}-h", "consumer", CacheLayout.FLASH_NHD)
    _warm_pull(producer, f"{tag}-p", ref_p, healthy, f"{tag}-h")
    pulled, pushed, fine = _req("pulled", 2, 1), _req("pushed", 3, 2), _req("fine", 4, 3)
    producer.call("hold", key=f"{tag}-p", reqs=[pulled, fine])
    producer.call("note_handling", key=f"{tag}-p", what="pull", sender=f"{tag}-v.r0")
    victim.call("hold_link", key=f"{tag}-v")
    victim.call("expect", key=f"{tag}-v", producer=ref_p, reqs=[pushed], push=True)
    producer.call("start_push", key=f"{tag}-p", req=pushed, consumer=ref_v)  # the producer starts the handshake
    assert victim.note() == ("link held", f"{tag}-p.r0")  # answered; the rendezvous not joined
    victim.call("expect", key=f"{tag}-v", producer=ref_p, reqs=[pulled])  # a pull under the producer's handshake
    assert producer.note() == ("handling", "pull", f"{tag}-v.r0")  # on the producer's dispatcher now
    return ref_p, fine


def test_a_pull_waiting_for_its_link_delays_no_other_consumers_pull(procs: Pool) -> None:
    producer, victim, healthy = procs[0], procs[1], procs[2]
    ref_p, fine = _victim_pulls_while_its_link_opens(procs, "slowp")
    _healthy_pull(ref_p, healthy, "slowp-h", fine, "producer, the victim's link held")
    # Once the link opens, the pull that waited for it is served on it, and the push goes: both byte-exact.
    victim.call("release_link")
    _assert_ok(victim.call("wait", key="slowp-v", reqs=[_req("pulled", 2, 1), _req("pushed", 3, 2)]),
               "the victim's pull and push, once their link opened")
    _assert_ok(producer.call("take_sent", key="slowp-p", rids=["warm", "pulled", "fine", "pushed"]), "producer")


def test_a_pull_waiting_for_the_link_of_a_stopped_peer_fails_typed_and_alone(procs: Pool) -> None:
    producer, victim, healthy = procs[0], procs[1], procs[2]
    ref_p, fine = _victim_pulls_while_its_link_opens(procs, "stopp")
    stopped_at = victim.signal(signal.SIGSTOP)  # stalled for good between the handshake and the rendezvous
    _healthy_pull(ref_p, healthy, "stopp-h", fine, "producer, the victim stopped")
    # The link never opens; once the victim is lost, the pull that waited for its link fails, typed.
    failed = producer.call("take_sent", key="stopp-p", rids=["pulled"], timeout_s=DEADLINE_S + 30)["pulled"]
    print(f"\n[slow peer] a pull waiting for a stopped peer's link: {failed.error_type} "
          f"{failed.at - stopped_at:.2f}s after the stop ({failed.message})")
    assert failed.error_type in TYPED_FAILURES, f"the stopped victim's pull: {failed}"
    assert failed.at - stopped_at < DEADLINE_S + LATE_S, f"reported {failed.at - stopped_at:.2f}s after the stop"
    victim.kill()  # its store goes with it: the producer's own open of the link fails now, and so does the push
    push = producer.call("take_sent", key="stopp-p", rids=["pushed"], timeout_s=DEADLINE_S + 30)["pushed"]
    assert push.error_type in TYPED_FAILURES, f"the push to the stopped victim: {push}"
    _assert_ok(producer.call("take_sent", key="stopp-p", rids=["warm", "fine"]), "the healthy consumer's")


def test_announcements_waiting_for_their_link_delay_no_other_producers_transfer(procs: Pool) -> None:
    consumer, victim, healthy = procs[0], procs[1], procs[2]
    ref_v = _build(victim, "slowa-v", "producer")
    ref_h = _build(healthy, "slowa-h", "producer", CacheLayout.FLASH_NHD)
    ref_d = _build(consumer, "slowa-d", "consumer")
    _warm_pull(healthy, "slowa-h", ref_h, consumer, "slowa-d")
    # The victim pushes: the consumer answers its handshake, and its end of the new link opens but is held before
    # it is settled, so the victim's end is open and announces every layer while the consumer's is not usable.
    pushed, fine = _req("pushed", 2, 1), _req("fine", 3, 2)
    healthy.call("hold", key="slowa-h", reqs=[fine])
    consumer.call("hold_link", key="slowa-d", after_open=True)
    consumer.call("note_handling", key="slowa-d", what="announce", sender="slowa-v.r0")
    consumer.call("expect", key="slowa-d", producer=ref_v, reqs=[pushed], push=True)
    victim.call("start_push", key="slowa-v", req=pushed, consumer=ref_d)
    assert consumer.note() == ("link held", "slowa-v.r0")
    assert consumer.note() == ("handling", "announce", "slowa-v.r0")  # on the consumer's dispatcher now
    _healthy_pull(ref_h, consumer, "slowa-d", fine, "consumer, the victim's link held")
    # Released, the announcements that waited post their receives in order: every layer lands where it belongs
    # (all four have one shape: a receive posted out of order would land another layer's bytes).
    consumer.call("release_link")
    _assert_ok(consumer.call("wait", key="slowa-d", reqs=[pushed]), "the victim's push, once its link opened")
    _assert_ok(victim.call("take_sent", key="slowa-v", rids=["pushed"]), "the victim's push")
    _assert_ok(healthy.call("take_sent", key="slowa-h", rids=["warm", "fine"]), "healthy producer")


# -- PeerLinks.when_open and known() in this process, with a stand-in channel and data plane ----------------------


ME, PEER, WAIT_S = "local.r0", "remote.r0", 10.0


def _hello(engine_id: str) -> Handshake:
    return Handshake.create(engine_id, "both", 0, ParallelLayout(1, 1), KVGeometry(2, 2, 64), "tcp://h:1", "h:2")


class _Clock:
    def wait(self, attempt: Callable[[float], bool], timeout_s: float) -> bool:
        return attempt(timeout_s)


class _Channel:
    """Answers a handshake with the peer's (echoing the session) once ``answer`` is set."""

    peer_id, auth, clock, loss_seq = ME, ChannelAuth(), _Clock(), 0

    def __init__(self) -> None:
        self.answer = threading.Event()
        self.answer.set()

    def connect(self, peer_id: str, address: str) -> None:
        pass

    def connected_address(self, peer_id: str) -> str | None:
        return None

    def peer_alive(self, peer_id: str) -> bool:
        return True

    def peer_incarnation(self, peer_id: str) -> int:
        return 0

    def request(self, peer_id: str, hello: Handshake, timeout_s: float, *, at: str | None = None) -> Handshake:
        assert self.answer.wait(WAIT_S)
        return replace(_hello("remote"), session=hello.session)


class _Link:
    def __init__(self, link_id: str) -> None:
        self.link_id, self.broken, self.closed = link_id, None, False

    def close(self) -> None:
        self.closed = True


class _DataPlane:
    """``open_link`` blocks until ``release`` is set (``opening`` says it started), then raises ``fail`` if set."""

    address = "h:2"

    def __init__(self) -> None:
        self.opening, self.release = threading.Event(), threading.Event()
        self.fail: BaseException | None = None

    def open_link(self, link_id: str, link_rank: int, store_addr: str, device: str, timeout_s: float, *,
                  cancel: threading.Event | None = None) -> _Link:
        self.opening.set()
        assert self.release.wait(WAIT_S)
        if self.fail is not None:
            raise self.fail
        return _Link(link_id)


@pytest.fixture
def parts() -> Iterator[tuple[PeerLinks, _Channel, _DataPlane, ThreadPoolExecutor]]:
    channel, plane = _Channel(), _DataPlane()
    with ThreadPoolExecutor(2) as pool:
        peers = PeerLinks(_hello("local"), channel, plane, pool, "cpu", WAIT_S)  # type: ignore[arg-type]
        try:
            yield peers, channel, plane, pool
        finally:
            channel.answer.set()
            plane.release.set()
            peers.close()


def _opening(peers: PeerLinks, plane: _DataPlane, pool: ThreadPoolExecutor) -> tuple[Future[Peer], Peer]:
    """Our handshake with PEER answered and its link opening (held): the ensure() and the handshake."""
    ensured = pool.submit(peers.ensure, PEER, "tcp://remote:1", True)
    assert plane.opening.wait(WAIT_S)
    peer = peers.get(PEER)
    assert peer is not None and peer.link is not None and not peer.link.done()
    return ensured, peer


def _recorder() -> tuple[list[tuple[int, object, str | None, str]], Callable[[int], OnOpen]]:
    """What ran: (index, link, error type, thread name), and a continuation that records its index."""
    ran: list[tuple[int, object, str | None, str]] = []

    def then(index: int) -> OnOpen:
        return lambda link, error: ran.append(
            (index, link, None if error is None else type(error).__name__, threading.current_thread().name))
    return ran, then


def test_what_waits_for_a_link_runs_in_call_order_once_it_opens_never_on_the_caller(parts: Any) -> None:
    peers, _, plane, pool = parts
    ensured, peer = _opening(peers, plane, pool)
    ran, then = _recorder()
    first_runs, more_queued = threading.Event(), threading.Event()

    def first(link: object, error: BaseException | None) -> None:
        first_runs.set()
        assert more_queued.wait(WAIT_S)  # the calls below come while this one runs: they must wait their turn
        then(0)(link, error)

    peers.when_open(peer, first)
    for index in (1, 2):
        peers.when_open(peer, then(index))
    assert ran == [] and not first_runs.is_set()  # nothing ran, and the caller was never held
    plane.release.set()  # the link opens: what waited runs, on the thread that opened it
    assert first_runs.wait(WAIT_S)
    for index in (3, 4):  # the link is open, but earlier work is still running: these go behind it
        peers.when_open(peer, then(index))
    more_queued.set()
    link = ensured.result(WAIT_S).link.result(WAIT_S)
    assert [entry[:3] for entry in ran] == [(i, link, None) for i in range(5)]
    assert threading.current_thread().name not in {entry[3] for entry in ran}
    peers.when_open(peer, then(5))  # open, nothing waiting: at once, here
    assert ran[-1] == (5, link, None, threading.current_thread().name)


@pytest.mark.parametrize(("how", "error"), [("drop", "PeerLostError"), ("close", "ClosedError"),
                                            ("open fails", "TransferTimeout")])
def test_what_waits_for_a_link_fails_typed_when_it_never_opens(parts: Any, how: str, error: str) -> None:
    peers, _, plane, pool = parts
    ensured, peer = _opening(peers, plane, pool)
    ran, then = _recorder()
    for index in range(3):
        peers.when_open(peer, then(index))
    if how == "drop":
        peers.drop(PEER, "peer lost (heartbeat)")  # failed at once, not once the open ends
        assert [entry[:3] for entry in ran] == [(i, None, error) for i in range(3)]
    elif how == "close":
        peers.close()
        assert [entry[:3] for entry in ran] == [(i, None, error) for i in range(3)]
    else:
        plane.fail = TransferTimeout("link not open after 10s (test)")
    plane.release.set()
    with pytest.raises((PeerLostError, ClosedError, TransferTimeout)):
        ensured.result(WAIT_S)
    assert [entry[:3] for entry in ran] == [(i, None, error) for i in range(3)]  # each once, in order
    peers.when_open(peer, then(3))  # later calls fail at once too
    assert ran[-1][:3] == (3, None, error)


def test_known_waits_for_the_handshake_reply_only_never_for_its_link(parts: Any) -> None:
    """The crossed handshake: the peer's message comes before our own handshake's reply; known() returns the
    handshake as soon as that reply is in, while its link is still opening (before: once the link had opened)."""
    peers, channel, plane, pool = parts
    channel.answer.clear()
    ensured = pool.submit(peers.ensure, PEER, "tcp://remote:1", True)
    deadline = time.monotonic() + WAIT_S
    while PEER not in peers._connecting:  # noqa: SLF001 - our handshake is in flight, unanswered
        assert time.monotonic() < deadline, "no handshake under way"
        threading.Event().wait(0.005)
    assert peers.get(PEER) is None
    with ThreadPoolExecutor(1) as caller:
        known = caller.submit(peers.known, PEER)
        channel.answer.set()  # the reply comes; the link then opens, held
        peer = known.result(WAIT_S)
        assert peer is not None and peer is peers.get(PEER)
        assert not plane.release.is_set() and not peer.link.done()  # returned with the link still opening
    plane.release.set()
    assert ensured.result(WAIT_S) is peer

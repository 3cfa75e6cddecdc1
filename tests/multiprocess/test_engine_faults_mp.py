"""The transfer engine across real processes when things go wrong (issue 4 failures, issue 9 part 3).

A peer process is SIGKILLed or SIGSTOPped at a chosen phase of a request:
before it answers a handshake, after it announced a tensor but before
posting it, after it sent Done, while its consumer stops reading or dies.
Each time the affected request ends in a typed error within the deadline
(``deadline_s=3`` here), other requests finish byte-exact, the dead link is
torn down, and a fresh peer process works afterwards. The phase is reached
through a hook in the victim process (it posts a note and holds that
thread), never by sleeping. Also: garbage on a consumer's ROUTER during a
transfer, mismatched handshakes, and a push larger than the staging.
"""

from __future__ import annotations

import signal

import msgspec
import pytest
import zmq

from ncclkv._env import EnvSettings
from ncclkv.engine import EngineRef
from ncclkv.layout import KVGeometry, ParallelLayout, Route, Span
from ncclkv.paged import CacheLayout
from ncclkv.protocol import PROTOCOL_VERSION, Announce, Done, Envelope, ErrorCode, ErrorMsg, RouteMsg, decode, encode

from _engine_pool import WAIT_S, Pool, Proc, blocks, build_engine
from _engine_workers import Outcome, Req

pytestmark = pytest.mark.multiprocess

GQA = KVGeometry(num_layers=4, num_kv_heads=4, head_size=32, dtype="float32")
ONE = ParallelLayout(1, 1)
DEADLINE_S = 3.0  # small here, so failures show quickly (the shipped default is checked below)
LATE_S = 2.5  # detection may take one heartbeat tick and a busy core on top of the deadline
PEER_FAILURES = {"TransferError", "TransferTimeout", "PeerLostError", "ClosedError"}


def _build(proc: Proc, engine_id: str, role: str, cache: CacheLayout = CacheLayout.CPU, block: int = 16,
           **config: object) -> EngineRef:
    return build_engine([proc], engine_id, ONE, GQA, cache, block, role, deadline_s=DEADLINE_S, num_blocks=64,
                        **config)


def _req(rid: str, seed: int, slot: int, num_tokens: int = 40) -> Req:
    """A request of ``num_tokens`` in 16-token blocks; ``slot`` keeps requests' blocks apart on both sides."""
    return Req(rid, seed, num_tokens, blocks(num_tokens, 16, 4 * slot), blocks(num_tokens, 16, 4 * slot))


def _failed_in_time(outcome: Outcome, since: float, what: str) -> float:
    assert outcome.error_type in PEER_FAILURES, f"{what}: {outcome}"
    assert outcome.reported == outcome.error_type, f"{what}: take_finished_* said {outcome.reported}: {outcome}"
    elapsed = outcome.at - since
    assert 0 < elapsed < DEADLINE_S + LATE_S, f"{what}: failed {elapsed:.2f}s after the fault: {outcome}"
    print(f"\n[engine faults] {what}: {outcome.error_type} {elapsed:.2f}s after the fault")
    return elapsed


def _assert_ok(outcomes: dict[str, Outcome], where: str) -> None:
    bad = {rid: o for rid, o in outcomes.items() if not o.ok}
    assert not bad, f"{where}: {bad}"


def _pull(producer: Proc, key_p: str, consumer: Proc, key_d: str, ref_p: EngineRef,
          reqs: list[Req]) -> dict[str, Outcome]:
    """The producer holds ``reqs``, the consumer expects them from ``ref_p`` and waits: their outcomes by rid."""
    producer.call("hold", key=key_p, reqs=reqs)
    consumer.call("expect", key=key_d, producer=ref_p, reqs=reqs)
    return consumer.call("wait", key=key_d, reqs=reqs)


def _push_lands(producer: Proc, ref_p: EngineRef, consumer: Proc, ref_c: EngineRef, req: Req, where: str) -> None:
    """The consumer expects a push of ``req``; the producer pushes it; it lands byte-exact."""
    consumer.call("expect", key=ref_c.engine_id, producer=ref_p, reqs=[req], push=True)
    assert producer.call("push", key=ref_p.engine_id, req=req, consumer=ref_c).ok
    _assert_ok(consumer.call("wait", key=ref_c.engine_id, reqs=[req]), where)


def _nothing_landed(consumer: Proc, key: str) -> None:
    """The consumer received no tensor and holds no staging, used or reserved."""
    stats = consumer.call("stats", key=key)
    assert (stats["tensors_received"], stats["staging_used"], stats["staging_reserved"]) == (0, 0, 0), stats


def _park_push(producer: Proc, ref_p: EngineRef, consumer: Proc, ref_c: EngineRef, req: Req, layer: int,
               resume: str = "gate") -> None:
    """Push ``req`` and park the producer mid-request: layers up to ``layer`` are in the consumer's blocks,
    the last layer is not. The producer goes on when its gate opens (``resume="gate"``) or it lost the consumer."""
    producer.submit("push", key=ref_p.engine_id, req=req, consumer=ref_c, gate_after=layer, resume=resume)
    assert producer.note() == ("parked", req.rid, layer)
    consumer.call("expect", key=ref_c.engine_id, producer=ref_p, reqs=[req], push=True)  # layers <= layer staged
    last = GQA.num_layers - 1
    assert consumer.call("wait_layer", key=ref_c.engine_id, req=req, layer=layer, probe_layer=last) == "empty"


def _two_producers_one_consumer(procs: Pool, tag: str,
                                cache: CacheLayout = CacheLayout.CPU) -> tuple[EngineRef, EngineRef]:
    """Producers ``{tag}-p`` (the victim, procs[0]) and ``{tag}-h`` (healthy, procs[1]), consumer ``{tag}-d``
    (procs[2]); returns the producers' refs. The victim sends a tensor per layer (its faults are staged at a
    layer's announcement or send)."""
    ref_v = _build(procs[0], f"{tag}-p", "producer", pull_batch_bytes=0)
    ref_h = _build(procs[1], f"{tag}-h", "producer")
    _build(procs[2], f"{tag}-d", "consumer", cache)
    return ref_v, ref_h


def _only_the_victims_request_fails(procs: Pool, tag: str, ref_h: EngineRef, lost: Req, killed_at: float,
                                    what: str, fine: Req, again: Req) -> None:
    """After producer ``{tag}-p`` was killed: ``lost`` fails in time, ``fine`` from ``{tag}-h`` arrives intact,
    the dead peer is torn down, and a new process with the victim's engine id serves ``again``."""
    healthy, consumer, consumer_key = procs[1], procs[2], f"{tag}-d"
    healthy.call("hold", key=f"{tag}-h", reqs=[fine])
    consumer.call("expect", key=consumer_key, producer=ref_h, reqs=[fine])
    outcomes = consumer.call("wait", key=consumer_key, reqs=[lost, fine])
    _failed_in_time(outcomes.pop(lost.rid), killed_at, what)
    _assert_ok(outcomes, "the other producer's request")
    consumer.call("peer_gone", key=consumer_key, peer_id=f"{tag}-p.r0")
    fresh = procs.replace(0)
    ref_f = _build(fresh, f"{tag}-p", "producer")
    _assert_ok(_pull(fresh, f"{tag}-p", consumer, consumer_key, ref_f, [again]), "after restart")
    _assert_ok(fresh.call("take_sent", key=f"{tag}-p", rids=[again.rid]), "restarted producer")


def _fresh_consumer_takes(procs: Pool, engine_id: str, producer: Proc, ref_p: EngineRef, req: Req) -> None:
    """A new process in place of the killed consumer (procs[1]) takes a push of ``req`` from the same producer."""
    fresh = procs.replace(1)
    ref_f = _build(fresh, engine_id, "consumer")
    _push_lands(producer, ref_p, fresh, ref_f, req, "fresh consumer")


def test_default_deadline_stays_at_most_ten_seconds() -> None:
    assert EnvSettings().deadline_s <= 10.0


# -- 3a: a producer killed mid-request ---------------------------------------------------------


def test_killed_producer_fails_its_request_only_and_the_consumer_closes_clean(procs: Pool) -> None:
    victim, healthy, consumer = procs[0], procs[1], procs[2]
    ref_v = _build(victim, "kill-v", "producer")
    ref_h = _build(healthy, "kill-h", "producer", CacheLayout.FLASH_NHD)
    ref_c = _build(consumer, "kill-d", "consumer", CacheLayout.FLASHINFER)
    doomed = _req("doomed", 7, 0, 48)
    others = [_req(f"h{i}", 20 + i, 1 + i, 17 + 3 * i) for i in range(8)]
    _park_push(victim, ref_v, consumer, ref_c, doomed, layer=1)  # mid-request: layers 0, 1 arrived, 3 did not
    consumer.call("expect", key="kill-d", producer=ref_h, reqs=others)
    killed_at = victim.kill()
    healthy.call("hold", key="kill-h", reqs=others)  # served after the kill, while the doomed one fails
    outcomes = consumer.call("wait", key="kill-d", reqs=[doomed, *others])
    _failed_in_time(outcomes.pop("doomed"), killed_at, "producer killed between layers")
    _assert_ok(outcomes, "requests from the other producer")
    _assert_ok(healthy.call("take_sent", key="kill-h", rids=[r.rid for r in others]), "other producer")
    assert consumer.call("close_all") == [], "engine threads left in the consumer process after close"


# -- 3b: garbage on the consumer's ROUTER during a transfer ----------------------------------


def _replies(sock: zmq.Socket, count: int) -> list[Envelope]:
    out = []
    while len(out) < count:
        assert sock.poll(int(WAIT_S * 1000)), f"got {len(out)} of {count} replies"
        out.append(decode(sock.recv()))
    return out


def _replies_until(sock: zmq.Socket, msg_id: int) -> list[Envelope]:
    """Everything received (heartbeats included) up to the reply to ``msg_id``."""
    out: list[Envelope] = []
    while not out or out[-1].reply_to != msg_id:
        assert sock.poll(int(WAIT_S * 1000)), f"no reply to msg_id {msg_id}; got {out}"
        out.append(decode(sock.recv()))
    return out


def test_garbage_on_the_consumer_router_is_rejected_and_the_transfer_completes(procs: Pool) -> None:
    producer, consumer = procs[0], procs[1]
    ref_p = _build(producer, "junk-p", "producer")
    ref_c = _build(consumer, "junk-d", "consumer", CacheLayout.FLASH_NHD)
    req = _req("j", 11, 0, 48)
    _park_push(producer, ref_p, consumer, ref_c, req, layer=1)
    address = ref_c.control_addrs[0]
    context = zmq.Context()
    try:
        junk = context.socket(zmq.DEALER)
        junk.setsockopt(zmq.LINGER, 0)
        junk.setsockopt(zmq.ROUTING_ID, b"junk")
        junk.connect(address)
        misnamed = encode(Envelope("junk-p.r0", 1, None, Done("j", 4, 1)))  # claims to be the producer
        junk.send(b"\x00\xffnot msgpack at all")
        junk.send(msgspec.msgpack.encode({"sender": "junk", "body": [1, 2, 3]}))
        junk.send_multipart([b"two", b"parts"])
        junk.send(misnamed)
        junk.send(b"\x91" * ((1 << 20) + 100))  # over max_frame_bytes (1 MiB)
        rejected = _replies(junk, 5)  # answered in order: every frame above was handled
        assert all(isinstance(e.body, ErrorMsg) and e.body.code == ErrorCode.PROTOCOL for e in rejected), rejected
        # Well-formed messages from a sender that never shook hands must not touch the request.
        intruder = context.socket(zmq.DEALER)
        intruder.setsockopt(zmq.LINGER, 0)
        intruder.setsockopt(zmq.ROUTING_ID, b"intruder.r0")
        intruder.connect(address)
        route = RouteMsg.from_route(Route(0, 0, Span(2, 3), Span(0, 4), Span(0, 48)))
        for msg_id, body in enumerate((Done("j", 1, 8), ErrorMsg("j", ErrorCode.TIMEOUT, "fake failure"),
                                       Announce("j", 2, route, (2, 48, 4, 32), "float32", 49152, 2, "kv-forged")), 1):
            intruder.send(encode(Envelope("intruder.r0", msg_id, None, body)))
        answers = _replies_until(intruder, 3)  # the announcement's refusal: all three were handled
        assert {e.reply_to: e.body.code for e in answers if isinstance(e.body, ErrorMsg)} == {
            1: ErrorCode.PROTOCOL, 3: ErrorCode.PROTOCOL}, answers  # an ErrorMsg is never answered
    finally:
        context.destroy(linger=0)
    # The request is intact and still waits for its last layers.
    assert consumer.call("wait_layer", key="junk-d", req=req, layer=1, probe_layer=3) == "empty"
    producer.gate.set()
    assert producer.result().ok
    _assert_ok(consumer.call("wait", key="junk-d", reqs=[req]), "consumer")
    stats = consumer.call("stats", key="junk-d")
    assert stats["channel"]["rejected"] >= 5 and stats["tensors_received"] == GQA.num_layers, stats


# -- 3c: mismatched handshakes -------------------------------------------------------------------


@pytest.mark.parametrize(("field", "consumer_config", "ours", "theirs"), [
    ("head_size", {"geometry": KVGeometry(4, 4, 64, "float32")}, "32", "64"),
    ("dtype", {"geometry": KVGeometry(4, 4, 32, "bfloat16")}, "'float32'", "'bfloat16'"),
    ("protocol_version", {"protocol_version": PROTOCOL_VERSION + 1}, str(PROTOCOL_VERSION), str(PROTOCOL_VERSION + 1)),
])
def test_mismatched_handshake_fails_on_both_sides_naming_both_values(
        procs: Pool, field: str, consumer_config: dict[str, object], ours: str, theirs: str) -> None:
    producer, consumer = procs[0], procs[1]
    ref_p = _build(producer, f"hs-p-{field}", "producer")
    config = {"geometry": GQA, **consumer_config}
    geometry = config.pop("geometry")
    build_engine([consumer], f"hs-d-{field}", ONE, geometry, CacheLayout.CPU, 16, "consumer", deadline_s=DEADLINE_S,
                 **config)
    req = _req("m", 1, 0, 16)
    outcome = _pull(producer, f"hs-p-{field}", consumer, f"hs-d-{field}", ref_p, [req])["m"]
    both = f"{field} mismatch: local {ours}, remote {theirs}"  # as the responder saw it
    assert outcome.error_type == "HandshakeError" and both in outcome.message, outcome
    assert outcome.reported == "HandshakeError"
    assert producer.call("stats", key=f"hs-p-{field}")["handshakes_refused"] == 1
    logged = producer.call("logs", contains="refused handshake")
    assert len(logged) == 1 and both in logged[0], logged


# -- 3d: a push larger than the staging -------------------------------------------------------


def test_push_larger_than_staging_is_refused_before_anything_moves(procs: Pool) -> None:
    producer, consumer = procs[0], procs[1]
    ref_p = _build(producer, "cap-p", "producer")
    ref_c = _build(consumer, "cap-d", "consumer", staging_bytes=4096)
    big = _req("big", 5, 0, 32)  # 32 tokens x 4 heads x 32 x (K, V) x 4 B x 4 layers = 131072 B
    outcome = producer.call("push", key="cap-p", req=big, consumer=ref_c)
    assert outcome.error_type == "CapacityError", outcome
    assert "4096" in outcome.message and "131072" in outcome.message, outcome
    assert producer.call("stats", key="cap-p")["tensors_sent"] == 0
    _nothing_landed(consumer, "cap-d")
    # The same pair goes on: a push the consumer expects lands in its blocks directly, no staging needed.
    fits = _req("fits", 6, 1, 32)
    _push_lands(producer, ref_p, consumer, ref_c, fits, "consumer")


# -- issue 9 part 5: a peer that lies after a valid handshake --------------------------------------
# Sizes are checked against the plan and the staging before anything is allocated; the liar's
# request fails typed, naming both values, and the same pair works afterwards.


def test_announcement_beyond_the_plan_fails_its_request_and_allocates_nothing(procs: Pool) -> None:
    producer, consumer = procs[0], procs[1]
    ref_p = _build(producer, "lie-ann-p", "producer", pull_batch_bytes=0)  # a tensor per layer: layer 1's is forged
    _build(consumer, "lie-ann-d", "consumer", staging_bytes=1 << 20)
    huge = (2, 10**9, 4, 32)  # a billion tokens: 1 TB of float32, were it allocated
    lie = _req("lie", 1, 0)
    producer.call("tamper", key="lie-ann-p", tag="ann", rid="lie", layer=1, shape=huge, nbytes=2 * 10**9 * 4 * 32 * 4)
    outcome = _pull(producer, "lie-ann-p", consumer, "lie-ann-d", ref_p, [lie])["lie"]
    assert outcome.error_type == "ShapeMismatchError", outcome
    assert "announced (2, 1000000000, 4, 32) float32, the plan says (2, 40, 4, 32) float32" in outcome.message, outcome
    # Beyond any slice planned here: not even drained into scratch; the link is closed instead.
    assert consumer.call("logs", contains="implausible announcement (2, 1000000000, 4, 32)"), consumer.call("logs")
    # The producer sees its link closed, after the consumer failed every request of the liar.
    assert producer.call("take_sent", key="lie-ann-p", rids=["lie"])["lie"].error_type in PEER_FAILURES
    again = _req("again", 2, 1)
    _assert_ok(_pull(producer, "lie-ann-p", consumer, "lie-ann-d", ref_p, [again]), "consumer after the lie")


def test_pull_outside_the_plan_is_refused_before_anything_is_sent(procs: Pool) -> None:
    producer, consumer = procs[0], procs[1]
    ref_p = _build(producer, "lie-pull-p", "producer")
    _build(consumer, "lie-pull-d", "consumer")
    lie = _req("lie", 3, 0)
    beyond = RouteMsg.from_route(Route(0, 0, Span(0, 9), Span(0, 4), Span(0, 40)))  # layers 4..8 do not exist
    consumer.call("tamper", key="lie-pull-d", tag="pull", rid="lie", routes=(beyond,))
    outcome = _pull(producer, "lie-pull-p", consumer, "lie-pull-d", ref_p, [lie])["lie"]
    assert outcome.error_type is not None and "our plan gives" in outcome.message, outcome
    assert "[0,9) heads [0,4) tokens [0,40))] but our plan gives" in outcome.message, outcome
    assert producer.call("stats", key="lie-pull-p")["tensors_sent"] == 0
    again = _req("again", 4, 1)
    _assert_ok(_pull(producer, "lie-pull-p", consumer, "lie-pull-d", ref_p, [again]), "consumer after the lie")


def test_push_offer_whose_bytes_disagree_with_its_routes_is_refused(procs: Pool) -> None:
    producer, consumer = procs[0], procs[1]
    ref_p = _build(producer, "lie-push-p", "producer")
    ref_c = _build(consumer, "lie-push-d", "consumer")
    lie = _req("lie", 5, 0, 32)
    producer.call("tamper", key="lie-push-p", tag="push", rid="lie", nbytes=1)
    outcome = producer.call("push", key="lie-push-p", req=lie, consumer=ref_c)
    assert outcome.error_type is not None and "says 1 B, routes hold 131072 B" in outcome.message, outcome
    assert producer.call("stats", key="lie-push-p")["tensors_sent"] == 0
    _nothing_landed(consumer, "lie-push-d")
    fits = _req("fits", 6, 1, 32)
    _push_lands(producer, ref_p, consumer, ref_c, fits, "consumer after the lie")


# -- 3e (issue 9): a peer killed at each phase ---------------------------------------------------


def test_producer_killed_during_handshake(procs: Pool) -> None:
    victim, consumer = procs[0], procs[2]
    ref_v, ref_h = _two_producers_one_consumer(procs, "hs-kill")
    doomed = _req("doomed", 1, 0)
    victim.call("hold", key="hs-kill-p", reqs=[doomed])
    victim.call("stall", key="hs-kill-p", phase="handshake")
    consumer.call("expect", key="hs-kill-d", producer=ref_v, reqs=[doomed])
    assert victim.note() == ("stalled", "handshake")  # it got the handshake and will never reply
    killed_at = victim.kill()
    _only_the_victims_request_fails(procs, "hs-kill", ref_h, doomed, killed_at,
                                    "producer killed before answering the handshake",
                                    fine=_req("fine", 2, 1), again=_req("again", 3, 2))


def test_producer_killed_after_announcing_a_tensor_it_never_sends(procs: Pool) -> None:
    victim, consumer = procs[0], procs[2]
    ref_v, ref_h = _two_producers_one_consumer(procs, "ann-kill", CacheLayout.FLASH_HND)
    doomed = _req("doomed", 1, 0)
    victim.call("stall", key="ann-kill-p", phase="announce", rid="doomed", layer=1)
    victim.call("hold", key="ann-kill-p", reqs=[doomed])
    consumer.call("expect", key="ann-kill-d", producer=ref_v, reqs=[doomed])
    assert victim.note() == ("stalled", "announce")
    # The consumer accepted the announcement of layer 1 and posted its receive: seq 0 (layer 0) and seq 1.
    assert consumer.call("recv_posted", key="ann-kill-d", peer_id="ann-kill-p.r0", count=2) == 2
    killed_at = victim.kill()
    _only_the_victims_request_fails(procs, "ann-kill", ref_h, doomed, killed_at,
                                    "producer killed between announcement and tensor",
                                    fine=_req("fine", 2, 1), again=_req("again", 3, 2))


def test_producer_killed_after_done(procs: Pool) -> None:
    victim, consumer = procs[0], procs[2]
    ref_v, ref_h = _two_producers_one_consumer(procs, "done-kill")
    served, late = _req("served", 1, 0), _req("late", 2, 1)
    _assert_ok(_pull(victim, "done-kill-p", consumer, "done-kill-d", ref_v, [served]), "served before the kill")
    _assert_ok(victim.call("take_sent", key="done-kill-p", rids=["served"]), "victim before the kill")
    killed_at = victim.kill()
    consumer.call("expect", key="done-kill-d", producer=ref_v, reqs=[late])  # the dead producer's next request
    _only_the_victims_request_fails(procs, "done-kill", ref_h, late, killed_at,
                                    "request to a producer killed after Done",
                                    fine=_req("fine", 3, 2), again=_req("again", 4, 3))


def test_consumer_that_stops_reading_fails_the_push_within_the_deadline(procs: Pool) -> None:
    producer, victim, healthy = procs[0], procs[1], procs[2]
    ref_p = _build(producer, "stop-p", "producer")
    ref_v = _build(victim, "stop-v", "consumer")
    _build(healthy, "stop-h", "consumer")
    doomed, fine = _req("doomed", 1, 0), _req("fine", 2, 1)
    producer.call("hold", key="stop-p", reqs=[fine])
    _park_push(producer, ref_p, victim, ref_v, doomed, layer=0)
    stopped_at = victim.signal(signal.SIGSTOP)
    producer.gate.set()  # layers 1..3 go to a consumer that reads nothing
    healthy.call("expect", key="stop-h", producer=ref_p, reqs=[fine])
    _assert_ok(healthy.call("wait", key="stop-h", reqs=[fine]), "the other consumer")
    _failed_in_time(producer.result(), stopped_at, "push to a SIGSTOPped consumer")
    producer.call("peer_gone", key="stop-p", peer_id="stop-v.r0")
    victim.signal(signal.SIGCONT)
    # Awake again, the consumer reports its request as failed rather than waiting forever.
    late = victim.call("wait", key="stop-v", reqs=[doomed])["doomed"]
    assert late.error_type in PEER_FAILURES | {"ProtocolError"}, late
    victim.kill()
    _fresh_consumer_takes(procs, "stop-v2", producer, ref_p, _req("again", 3, 2))


def test_consumer_killed_mid_push_while_the_producer_keeps_saving_layers(procs: Pool) -> None:
    producer, victim = procs[0], procs[1]
    ref_p = _build(producer, "ckill-p", "producer")
    ref_v = _build(victim, "ckill-v", "consumer")
    doomed = _req("doomed", 1, 0)
    _park_push(producer, ref_p, victim, ref_v, doomed, layer=0, resume="lost")
    killed_at = victim.kill()
    # The producer saves layers 1..3 after it lost the consumer: save_layer must not raise; the push fails.
    kind, rid, resumed_at = producer.note()
    assert (kind, rid) == ("resumed", "doomed") and resumed_at > killed_at
    _failed_in_time(producer.result(), killed_at, "push whose consumer died mid-request")
    _fresh_consumer_takes(procs, "ckill-v2", producer, ref_p, _req("again", 2, 1))

"""A peer that sends more (or fewer) bytes than it announced (issue 9, the last fault case), over real gloo.

gloo checks an arriving message against the posted receive on its device
thread and calls std::terminate in the *receiving* process when the message
is longer (see ncclkv/transport/_framing.py); the last test shows that
happening on a link without frame headers. With them, every case here ends
as a typed error on the affected receive or request only: the receiving
process lives, the link is torn down, other links keep carrying data byte
for byte, and a new link to the same peer works. Peers are spawned children
(``_oversized.ExtProc``); every wait has a deadline.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest

from ncclkv.layout import KVGeometry, ParallelLayout
from ncclkv.paged import CacheLayout

from _engine_pool import WAIT_S, WorkerError, blocks, build_engine
from _engine_workers import Req
from _oversized import ExtProc

pytestmark = pytest.mark.multiprocess

GQA = KVGeometry(num_layers=4, num_kv_heads=4, head_size=32, dtype="float32")
DEADLINE_S = 10.0  # nothing here waits for it; generous for busy cores
_ids = itertools.count()


class Trio:
    """Three children: ``r`` receives, ``s`` misbehaves, ``h`` is a healthy peer. A dead one is replaced."""

    def __init__(self) -> None:
        self.procs = [ExtProc(f"oversized-{next(_ids)}") for _ in range(3)]
        for proc in self.procs:
            assert proc.pid

    @property
    def r(self) -> ExtProc:
        return self.procs[0]

    @property
    def s(self) -> ExtProc:
        return self.procs[1]

    @property
    def h(self) -> ExtProc:
        return self.procs[2]

    def revive(self) -> None:
        """Replace children that died or were left mid-command by a failed test."""
        for index, proc in enumerate(self.procs):
            if not proc.proc.is_alive() or proc.busy is not None:
                proc.stop()
                self.procs[index] = ExtProc(f"oversized-{next(_ids)}")
        for proc in self.procs:
            assert proc.pid

    def reset(self) -> dict[str, list[str]]:
        """Close links and engines in every live, idle child; return the ncclkv threads left."""
        left: dict[str, list[str]] = {}
        for proc in self.procs:
            if not proc.proc.is_alive() or proc.busy is not None:
                continue  # replaced by the next test's revive()
            proc.call("honest")
            proc.call("close_links")
            names = proc.call("close_all")  # every ncclkv thread of the child, links and engines closed
            if names:
                left[proc.tag] = names
        return left

    def close(self) -> None:
        for proc in self.procs:
            proc.stop()


@pytest.fixture(scope="module")
def trio_once() -> Iterator[Trio]:
    trio = Trio()
    try:
        yield trio
    finally:
        trio.close()


@pytest.fixture
def trio(trio_once: Trio) -> Iterator[Trio]:
    trio_once.revive()
    yield trio_once
    left = trio_once.reset()
    assert not left, f"ncclkv threads left after closing every link and engine: {left}"


def _open(host: ExtProc, peer: ExtProc, link_id: str, op_timeout_s: float = WAIT_S, framed: bool = True) -> None:
    """Open ``link_id`` between ``host`` (link rank 0, its store) and ``peer``."""
    store = host.call("plane_address")
    for rank, proc in enumerate((host, peer)):
        proc.submit("open_link", link_id=link_id, rank=rank, store=store, timeout_s=WAIT_S, op_timeout_s=op_timeout_s,
                    framed=framed)
    host.result()
    peer.result()


def _healthy(trio: Trio, link_id: str, count: int) -> list[tuple[str, str, int, int]]:
    """Open ``link_id`` h -> r and start ``count`` sends on it; return r's matching receives."""
    _open(trio.h, trio.r, link_id)
    ops = [(link_id, 4096 + 512 * i, 100 + i) for i in range(count)]
    trio.h.submit("transfer", ops=[("send", *op) for op in ops], wait_s=WAIT_S)
    return [("recv", *op) for op in ops]


def _fresh_link_works(trio: Trio, link_id: str) -> None:
    _open(trio.s, trio.r, link_id)
    trio.s.submit("transfer", ops=[("send", link_id, 3000, 7), ("send", link_id, 0, 8)], wait_s=WAIT_S)
    got = trio.r.call("transfer", ops=[("recv", link_id, 3000, 7), ("recv", link_id, 0, 8)], wait_s=WAIT_S)
    assert got == ["ok", "ok"], got
    assert trio.s.result() == ["ok", "ok"]


@pytest.mark.parametrize(("sent", "posted"), [
    ([1000, 3000, 1500], [1000, 2000, 1500]),
    ([1000, 1000], [1000, 2000]),
    ([2000, 3000], [2000, 1000]),  # the second send meets the receive posted for the next announcement
], ids=["longer", "shorter", "two-sends-one-receive"])
def test_mismatched_send_fails_that_receive_only_and_the_receiver_lives(
        trio: Trio, sent: list[int], posted: list[int]) -> None:
    """The receiver posts what was announced (``posted``); the peer sends ``sent``, in order; the second differs."""
    case = next(_ids)
    link = f"bad-{case}"
    _open(trio.s, trio.r, link)
    healthy = _healthy(trio, f"ok-{case}", 8)
    trio.s.submit("transfer", ops=[("send", link, n, seed) for seed, n in enumerate(sent)], wait_s=WAIT_S)
    got = trio.r.call("transfer", ops=[("recv", link, n, seed) for seed, n in enumerate(posted)] + healthy,
                      wait_s=WAIT_S)
    assert trio.r.proc.is_alive()
    mine, theirs = got[:len(posted)], got[len(posted):]
    assert mine[0] == "ok", mine
    assert mine[1].startswith("ShapeMismatchError: "), mine
    assert f"the peer sends ({sent[1]},) torch.uint8 ({sent[1]} B)" in mine[1], mine[1]
    assert f"posted (as announced) for ({posted[1]},) torch.uint8 ({posted[1]} B)" in mine[1], mine[1]
    assert all(o.startswith("TransferError: ") for o in mine[2:]), mine  # the link broke under them
    assert theirs == ["ok"] * 8, theirs
    assert trio.h.result() == ["ok"] * 8
    closed, broken = trio.r.call("link_state", link_id=link)
    assert closed and broken is not None and broken.startswith("ShapeMismatchError"), broken
    sender = trio.s.result()
    assert sender[0] == "ok" and all(o != "ok" for o in sender[1:]), sender
    _fresh_link_works(trio, f"again-{case}")


def test_send_that_bypasses_the_frame_headers_times_out_and_the_receiver_lives(trio: Trio) -> None:
    """A peer writing straight to the gloo group (no header) never gets its receive posted."""
    link = f"raw-{next(_ids)}"
    _open(trio.s, trio.r, link, op_timeout_s=2.0)
    healthy = _healthy(trio, f"ok-{next(_ids)}", 4)
    trio.s.submit("transfer", ops=[("raw_send", link, 3000, 1)], wait_s=WAIT_S)
    got = trio.r.call("transfer", ops=[("recv", link, 2000, 1), *healthy], wait_s=WAIT_S)
    assert trio.r.proc.is_alive()
    assert got[0].startswith("TransferTimeout: ") and "no frame header" in got[0], got[0]
    assert got[1:] == ["ok"] * 4, got
    assert trio.h.result() == ["ok"] * 4
    assert trio.s.result() != ["ok"]  # its bytes never went out: the receiver's timeout closed the pair
    _fresh_link_works(trio, f"again-{next(_ids)}")


def test_producer_engine_that_sends_more_than_it_announced(trio: Trio) -> None:
    """Engine level: only that request fails, with both sizes named; the next pull opens a new link.

    The consumer's header check catches it: the producer's link describes the tensor it posts, the longer
    one, whether its header goes out with this send or ahead of it, with the send before."""
    tag = f"ov{next(_ids)}"
    ref_p = build_engine([trio.s], f"{tag}-p", ParallelLayout(1, 1), GQA, CacheLayout.CPU, 16, "producer",
                         deadline_s=DEADLINE_S, num_blocks=64, pull_batch_bytes=0)  # layer 1's tensor is oversized
    ref_h = build_engine([trio.h], f"{tag}-h", ParallelLayout(1, 1), GQA, CacheLayout.FLASH_NHD, 16, "producer",
                         deadline_s=DEADLINE_S, num_blocks=64)
    build_engine([trio.r], f"{tag}-d", ParallelLayout(1, 1), GQA, CacheLayout.CPU, 16, "consumer",
                 deadline_s=DEADLINE_S, num_blocks=64)

    def req(rid: str, seed: int, slot: int) -> Req:
        return Req(rid, seed, 40, blocks(40, 16, 4 * slot), blocks(40, 16, 4 * slot))

    warm, doomed, again = req("warm", 3, 0), req("doomed", 7, 1), req("again", 9, 2)
    fine = [req(f"fine{i}", 20 + i, 3 + i) for i in range(4)]
    consumer, key = trio.r, f"{tag}-d"
    trio.s.call("hold", key=f"{tag}-p", reqs=[warm, doomed, again])
    trio.h.call("hold", key=f"{tag}-h", reqs=fine)
    consumer.call("expect", key=key, producer=ref_p, reqs=[warm])
    assert consumer.call("wait", key=key, reqs=[warm])["warm"].ok
    first_link = consumer.call("link_ids", key=key)[f"{tag}-p.r0"]

    trio.s.call("oversize", key=f"{tag}-p", rid="doomed", layer=1, extra_tokens=1)
    consumer.call("expect", key=key, producer=ref_p, reqs=[doomed])
    consumer.call("expect", key=key, producer=ref_h, reqs=fine)
    outcomes = consumer.call("wait", key=key, reqs=[doomed, *fine])
    assert consumer.proc.is_alive()
    lost = outcomes.pop("doomed")
    assert lost.error_type == "ShapeMismatchError" and lost.reported == "ShapeMismatchError", lost
    # wire tensor [2, tokens, heads, head_size] float32: 40 tokens announced, 41 sent
    assert "(2, 41, 4, 32) torch.float32 (41984 B)" in lost.message, lost.message
    assert "(2, 40, 4, 32) torch.float32 (40960 B)" in lost.message, lost.message
    assert all(o.ok for o in outcomes.values()), outcomes
    assert all(o.ok for o in trio.h.call("take_sent", key=f"{tag}-h", rids=[r.rid for r in fine]).values())
    assert trio.s.call("take_sent", key=f"{tag}-p", rids=["doomed"])["doomed"].error_type is not None

    trio.s.call("honest")
    consumer.call("expect", key=key, producer=ref_p, reqs=[again])
    got = consumer.call("wait", key=key, reqs=[again])["again"]
    assert got.ok, got
    assert consumer.call("link_ids", key=key)[f"{tag}-p.r0"] not in (None, first_link)


def test_without_frame_headers_gloo_ends_the_receiving_process(trio: Trio) -> None:
    """The control: the same longer send on a link without headers kills the receiver (SIGABRT)."""
    link = f"unframed-{next(_ids)}"
    _open(trio.s, trio.r, link, framed=False)
    trio.s.submit("transfer", ops=[("send", link, 3000, 1)], wait_s=5.0)
    with pytest.raises(WorkerError, match="died|closed its pipe"):
        trio.r.call("transfer", ops=[("recv", link, 2000, 1)], wait_s=5.0)
    trio.r.proc.join(WAIT_S)
    assert trio.r.proc.exitcode == -6  # std::terminate -> abort()
    trio.s.result()

"""ncclkv.transport across real processes (gloo on CPU, free ports, every wait with a deadline).

Peers are spawned processes that each own a DataPlane and run scenarios on
command over a multiprocessing pipe; the same pipe stands in for the control
channel where a scenario needs one (announcements of shapes and dtypes).
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

import pytest
import torch
import torch.distributed as dist

from ncclkv.errors import TransferError
from ncclkv.transport import DataPlane, Link

from _commands import commands

pytestmark = pytest.mark.multiprocess

WAIT_S = 20.0  # generous: 2 busy cores; a hang still ends here, not at pytest's timeout
IDLE_S = 120.0  # a peer whose parent vanished stops after this long without commands
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.uint8)
MIB = 1 << 20
CTX = mp.get_context("spawn")


def sample(seq: int) -> torch.Tensor:
    """A tensor whose shape, dtype and bytes depend on ``seq`` (seq 3 is empty, seq 5 a scalar)."""
    dtype = DTYPES[seq % len(DTYPES)]
    shape: tuple[int, ...] = (seq % 5 + 1, seq % 9 + 3, 4) if seq % 2 else (seq * 37 % 1000 + 1,)
    shape = (0, 4) if seq == 3 else () if seq == 5 else shape
    numel = torch.Size(shape).numel()
    gen = torch.Generator().manual_seed(seq)
    raw = torch.randint(0, 256, (max(1, numel) * 8,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype)[:numel].reshape(shape).clone()


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    flat = (a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(*flat)


def expect(conn: Connection, tag: str, timeout_s: float = WAIT_S) -> Any:
    if not conn.poll(timeout_s):
        raise TimeoutError(f"no {tag!r} message within {timeout_s} s")
    got_tag, payload = conn.recv()
    if got_tag == "error":
        raise AssertionError(f"peer failed: {payload}")
    assert got_tag == tag, f"expected {tag!r}, got {got_tag!r}: {payload!r}"
    return payload


def raw_group(store_addr: str, rank: int, prefix: str) -> dist.ProcessGroup:
    """The baseline: a bare 2-rank gloo group on the same store, bound to loopback."""
    host, port = store_addr.rsplit(":", 1)
    store = dist.PrefixStore(prefix, dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=WAIT_S)))
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timedelta(seconds=WAIT_S)
    options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1", lazy_init=False)]
    return dist.ProcessGroupGloo(store, rank, 2, options)


# -- scenarios run by a peer (link rank 1 unless told) -------------------------


def recv_announced(conn: Connection, plane: DataPlane, links: dict[str, Link], link_id: str, store: str, count: int) -> None:
    """Post each receive sized from the announcement only, in announcement order; report what arrived."""
    link = links[link_id] = plane.open_link(link_id, 1, store, "cpu", WAIT_S)
    futures = []
    for _ in range(count):
        seq, shape, dtype_name = expect(conn, "announce")
        futures.append((seq, link.recv(shape, getattr(torch, dtype_name))))
    arrived = [(seq, same_bytes(fut.result(WAIT_S), sample(seq))) for seq, fut in futures]
    conn.send(("received", arrived))


def echo(conn: Connection, plane: DataPlane, links: dict[str, Link], link_id: str, store: str, rank: int, count: int) -> None:
    """Send back every tensor sample(0..count-1) as it arrives."""
    link = links[link_id] = plane.open_link(link_id, rank, store, "cpu", WAIT_S)
    sends = [link.send(link.recv(sample(seq).shape, sample(seq).dtype).result(WAIT_S)) for seq in range(count)]
    for fut in sends:
        fut.result(WAIT_S)
    conn.send(("echoed", link.stats().tensors_received))


def stream(conn: Connection, plane: DataPlane, links: dict[str, Link], link_id: str, store: str, count: int) -> None:
    """Queue ``count`` 64 KiB tensors (tensor seq is full of seq) and return at once."""
    link = links[link_id] = plane.open_link(link_id, 1, store, "cpu", WAIT_S)
    for seq in range(count):
        link.send(torch.full((16384,), seq, dtype=torch.int32))
    conn.send(("streaming", None))


def phase_value(rep: int, raw: bool) -> int:
    """The byte every tensor of one phase is full of: a different one per rep and phase (never 0)."""
    return (2 * rep + int(raw)) % 255 + 1


def ends(bufs: list[torch.Tensor]) -> list[tuple[int, int]]:
    """The first and last byte of each buffer."""
    return [(int(buf[0]), int(buf[-1])) for buf in bufs]


def sink(conn: Connection, plane: DataPlane, links: dict[str, Link], link_id: str, store: str, nbytes: int, count: int, reps: int) -> None:
    """Receive ``count`` tensors of ``nbytes`` per phase, through the link then through a raw group, ``reps`` times;
    report each phase's buffers' ``ends`` (the sender fills each phase with its own ``phase_value``)."""
    link = links[link_id] = plane.open_link(link_id, 1, store, "cpu", WAIT_S)
    pg = raw_group(store, 1, f"raw/{link_id}")
    bufs = [torch.zeros(nbytes, dtype=torch.uint8) for _ in range(count)]
    for _ in range(reps):
        for fut in [link.recv(buf.shape, buf.dtype, out=buf) for buf in bufs]:
            fut.result(WAIT_S)
        conn.send(("got", ends(bufs)))
        for work in [pg.recv([buf], 0, 0) for buf in bufs]:
            work.wait(timedelta(seconds=WAIT_S))
        conn.send(("got", ends(bufs)))


def close_link(conn: Connection, plane: DataPlane, links: dict[str, Link], link_id: str) -> None:
    links.pop(link_id).close()
    conn.send(("closed", link_id))


SCENARIOS: dict[str, Callable[..., None]] = {
    f.__name__: f for f in (recv_announced, echo, stream, sink, close_link)
}


def serve(conn: Connection) -> None:
    plane = DataPlane()
    links: dict[str, Link] = {}
    conn.send(("address", plane.address))
    try:
        for name, kwargs in commands(conn, IDLE_S):
            try:
                SCENARIOS[name](conn, plane, links, **kwargs)
            except Exception as exc:  # noqa: BLE001 - reported to the test, which fails
                conn.send(("error", f"{name}: {type(exc).__name__}: {exc}"))
    finally:
        plane.close()


class Peer:
    """A spawned process with its own DataPlane, driven by commands."""

    def __init__(self) -> None:
        self.conn, child = CTX.Pipe()
        self.proc = CTX.Process(target=serve, args=(child,), daemon=True)
        self.proc.start()
        child.close()
        self._address: str | None = None

    @property
    def address(self) -> str:
        if self._address is None:
            self._address = expect(self.conn, "address", 60.0)  # spawning imports torch: slow on busy cores
        return self._address

    def start(self, scenario: str, **kwargs: Any) -> None:
        assert self.address  # its first message, read before any scenario's
        self.conn.send((scenario, kwargs))

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send(None)
            except OSError:
                pass
            self.proc.join(WAIT_S)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(WAIT_S)


@pytest.fixture(scope="module")
def plane() -> Iterator[DataPlane]:
    with DataPlane() as data_plane:
        yield data_plane


@pytest.fixture(scope="module")
def peers() -> Iterator[tuple[Peer, Peer]]:
    pair = (Peer(), Peer())  # both start before either is waited for
    try:
        pair[0].address, pair[1].address
        yield pair
    finally:
        for peer in pair:
            peer.stop()


def test_hundred_tensors_arrive_in_order_with_announcements(plane: DataPlane, peers: tuple[Peer, Peer]) -> None:
    peer = peers[0]
    peer.start("recv_announced", link_id="order", store=plane.address, count=100)
    link = plane.open_link("order", 0, plane.address, "cpu", WAIT_S)
    announced: list[int] = []

    def announce(seq: int, tensor: torch.Tensor) -> None:  # the engine's control-plane message
        announced.append(seq)
        peer.conn.send(("announce", (seq, tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."))))

    tensors = [sample(seq) for seq in range(100)]
    sends = [link.send(t, before_send=lambda seq=seq, t=t: announce(seq, t)) for seq, t in enumerate(tensors)]
    assert [fut.result(WAIT_S) for fut in sends] == [None] * 100
    arrived = expect(peer.conn, "received")
    assert announced == list(range(100))
    assert arrived == [(seq, True) for seq in range(100)]  # in order, byte-exact, sized from announcements
    stats = link.stats()
    assert stats.tensors_sent == 100 and stats.bytes_sent == sum(t.numel() * t.element_size() for t in tensors)
    peer.start("close_link", link_id="order")
    expect(peer.conn, "closed")
    link.close()


def test_one_process_with_links_to_two_peers(plane: DataPlane, peers: tuple[Peer, Peer]) -> None:
    first, second = peers
    count = 30
    first.start("echo", link_id="two-a", store=plane.address, rank=1, count=count)
    second.start("echo", link_id="two-b", store=second.address, rank=1, count=count)  # hosted by the peer's store
    link_a = plane.open_link("two-a", 0, plane.address, "cpu", WAIT_S)
    link_b = plane.open_link("two-b", 0, second.address, "cpu", WAIT_S)
    back_a, back_b = [], []
    for seq in range(count):  # interleaved on both links
        link_a.send(sample(seq))
        link_b.send(sample(seq))
        back_a.append(link_a.recv(sample(seq).shape, sample(seq).dtype))
        back_b.append(link_b.recv(sample(seq).shape, sample(seq).dtype))
    assert all(same_bytes(fut.result(WAIT_S), sample(seq)) for seq, fut in enumerate(back_a))
    assert all(same_bytes(fut.result(WAIT_S), sample(seq)) for seq, fut in enumerate(back_b))
    assert expect(first.conn, "echoed") == count and expect(second.conn, "echoed") == count
    for peer, link in ((first, link_a), (second, link_b)):
        peer.start("close_link", link_id=link.link_id)
        expect(peer.conn, "closed")
        link.close()


def test_killed_peer_fails_pending_receives_then_a_new_link_works(plane: DataPlane, peers: tuple[Peer, Peer]) -> None:
    victim = Peer()
    try:
        sent, posted = 50, 100  # the stream stops half way: the victim stays alive, then dies
        victim.start("stream", link_id="doomed", store=plane.address, count=sent)
        link = plane.open_link("doomed", 0, plane.address, "cpu", WAIT_S, op_timeout_s=60.0)
        recvs = [link.recv((16384,), torch.int32) for _ in range(posted)]
        expect(victim.conn, "streaming")
        assert recvs[sent - 1].result(WAIT_S)[0].item() == sent - 1
        assert not any(fut.done() for fut in recvs[sent:])
        victim.proc.kill()
        killed_at = time.monotonic()
        outcomes = [fut.exception(WAIT_S) for fut in recvs]  # every future ends; none hangs
        elapsed = time.monotonic() - killed_at
    finally:
        victim.stop()
    assert elapsed < 5.0, f"pending receives took {elapsed:.1f} s to fail (operation deadline 60 s)"
    assert all(outcomes[seq] is None and recvs[seq].result()[0].item() == seq for seq in range(sent))
    assert all(isinstance(exc, TransferError) for exc in outcomes[sent:])
    assert isinstance(link.broken, TransferError) and "doomed" in str(link.broken)
    link.close()
    # The same data plane links to a fresh peer under a new id.
    peers[0].start("echo", link_id="doomed.1", store=plane.address, rank=1, count=1)
    with plane.open_link("doomed.1", 0, plane.address, "cpu", WAIT_S) as fresh:
        fresh.send(sample(0))
        assert same_bytes(fresh.recv(sample(0).shape, sample(0).dtype).result(WAIT_S), sample(0))
        assert expect(peers[0].conn, "echoed") == 1
        peers[0].start("close_link", link_id="doomed.1")
        expect(peers[0].conn, "closed")


def test_throughput_16mib_against_raw_gloo(plane: DataPlane, peers: tuple[Peer, Peer], capsys: pytest.CaptureFixture[str]) -> None:
    """Measured and reported, not asserted: a shared 2-core machine gives noisy absolute numbers."""
    peer, nbytes, count, reps = peers[1], 16 * MIB, 4, 6  # the first rep warms up (page faults, gloo buffers)
    peer.start("sink", link_id="speed", store=plane.address, nbytes=nbytes, count=count, reps=reps)
    link = plane.open_link("speed", 0, plane.address, "cpu", WAIT_S)
    pg = raw_group(plane.address, 0, "raw/speed")
    tensor = torch.empty(nbytes, dtype=torch.uint8)
    link_s, raw_s = [], []
    for rep in range(reps):  # each phase sends its own value: a buffer a phase left unfilled shows the last one's
        value = phase_value(rep, raw=False)
        tensor.fill_(value)
        start = time.perf_counter()
        for fut in [link.send(tensor) for _ in range(count)]:
            fut.result(WAIT_S)
        got = expect(peer.conn, "got")
        link_s.append(time.perf_counter() - start)
        assert got == [(value, value)] * count, f"rep {rep}, link: {got}"
        value = phase_value(rep, raw=True)
        tensor.fill_(value)
        start = time.perf_counter()
        for work in [pg.send([tensor], 1, 0) for _ in range(count)]:
            work.wait(timedelta(seconds=WAIT_S))
        got = expect(peer.conn, "got")
        raw_s.append(time.perf_counter() - start)
        assert got == [(value, value)] * count, f"rep {rep}, raw: {got}"
    link_s, raw_s = link_s[1:], raw_s[1:]
    gbps = [count * nbytes / s / 1e9 for s in (min(link_s), statistics.median(link_s), min(raw_s), statistics.median(raw_s))]
    with capsys.disabled():
        print(
            f"\n[transport] {count} x 16 MiB, best/median GB/s: link {gbps[0]:.2f}/{gbps[1]:.2f}, "
            f"raw pg.send/recv {gbps[2]:.2f}/{gbps[3]:.2f}, link/raw (median) {gbps[1] / gbps[3]:.2f}"
        )
    peer.start("close_link", link_id="speed")
    expect(peer.conn, "closed")
    link.close()

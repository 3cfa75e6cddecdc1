"""ncclkv.transport._sender: gloo data sends posted in order from a thread of their own."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

import pytest
import torch

from ncclkv.errors import TransferError
from ncclkv.transport import DataPlane
from ncclkv.transport._sender import SendThread

from link_probes import open_both

WAIT_S = 20.0


class _Work:
    """What ``post`` returns (a ``Pending``): done once the test says so; records the timeouts it is given."""

    def __init__(self, done: bool = True) -> None:
        self.done = threading.Event()
        self.waits: list[float] = []
        if done:
            self.done.set()

    def wait(self, timeout_s: float) -> None:
        self.waits.append(timeout_s)
        if not self.done.wait(timeout_s):
            raise TimeoutError(f"work not done within {timeout_s:g} s")


@contextlib.contextmanager
def running(post: Callable[[torch.Tensor], _Work]) -> Iterator[SendThread]:
    """A send thread posting with ``post``, stopped after, its end checked."""
    sender = SendThread("probe-send", post)
    try:
        yield sender
    finally:
        sender.stop()
        assert sender.join(WAIT_S)


def test_sends_are_posted_in_order_on_the_thread() -> None:
    posted: list[tuple[float, str]] = []

    def post(tensor: torch.Tensor) -> _Work:
        posted.append((tensor.item(), threading.current_thread().name))
        return _Work()

    with running(post) as sender:
        pendings = [sender.submit(torch.tensor(float(i))) for i in range(50)]
        for pending in pendings:
            pending.wait(WAIT_S)
    assert [value for value, _ in posted] == [float(i) for i in range(50)]
    assert {name for _, name in posted} == {"probe-send"}


def test_wait_covers_the_work_after_the_post() -> None:
    work = _Work(done=False)
    with running(lambda tensor: work) as sender:
        pending = sender.submit(torch.zeros(1))
        with pytest.raises(TimeoutError, match="work not done within"):
            pending.wait(0.05)
        assert len(work.waits) == 1 and 0 < work.waits[0] <= 0.05  # what the 0.05 s left after the post
        work.done.set()
        pending.wait(WAIT_S)


def test_a_post_that_raises_fails_its_send_and_every_later_one() -> None:
    """The peer was told of the failed send (its frame header): a later one posted now would land in its receive."""
    posted: list[float] = []

    def post(tensor: torch.Tensor) -> _Work:
        if tensor.item() == 1:
            raise RuntimeError("Connection closed by peer")
        posted.append(tensor.item())
        return _Work()

    with running(post) as sender:
        first, second, third = (sender.submit(torch.tensor(float(i))) for i in range(3))
        first.wait(WAIT_S)
        with pytest.raises(RuntimeError, match="Connection closed by peer"):
            second.wait(WAIT_S)
        for later in (third, sender.submit(torch.tensor(3.0))):
            with pytest.raises(TransferError, match=r"an earlier send's post failed \(RuntimeError\('Connection "
                                                    r"closed by peer'\)\); not posted"):
                later.wait(WAIT_S)
        assert posted == [0.0]


def test_stop_fails_what_is_not_posted_and_ends_the_thread() -> None:
    entered, release = threading.Event(), threading.Event()
    posted: list[float] = []

    def post(tensor: torch.Tensor) -> _Work:
        posted.append(tensor.item())
        entered.set()
        assert release.wait(WAIT_S)
        return _Work()

    sender = SendThread("probe-send", post)
    first = sender.submit(torch.tensor(0.0))
    assert entered.wait(WAIT_S)  # the thread is posting the first: the others queue behind it
    queued = [sender.submit(torch.tensor(float(i))) for i in range(1, 4)]
    sender.stop()
    release.set()
    first.wait(WAIT_S)
    for pending in queued:
        with pytest.raises(TransferError, match="aborted before this send was posted"):
            pending.wait(WAIT_S)
    with pytest.raises(TransferError, match="aborted before this send was posted"):
        sender.submit(torch.tensor(9.0)).wait(WAIT_S)
    assert sender.join(WAIT_S)
    assert posted == [0.0]
    sender.stop()  # idempotent


def test_a_gloo_link_posts_its_data_on_its_send_thread() -> None:
    """The payload's write (gloo writes on the posting thread) is off the link's poster; bytes arrive in order."""
    with DataPlane() as p0, DataPlane() as p1:
        l0, l1 = open_both(p0, p1, "sendthread", p0.address, WAIT_S)
        backend = l0._backend  # noqa: SLF001 - which thread posts is what this test is about
        posting: list[str] = []
        post = backend._post_data

        def spy(tensor: torch.Tensor):
            posting.append(threading.current_thread().name)
            return post(tensor)

        backend._post_data = spy
        backend._sender._post = spy  # the thread was built with the bound method
        sent = [torch.full((1 << 18,), float(i)) for i in range(12)]  # 1 MiB each
        recvs = [l1.recv(t.shape, t.dtype) for t in sent]
        sends = [l0.send(t) for t in sent]
        assert [f.result(WAIT_S) for f in sends] == [None] * 12
        assert [f.result(WAIT_S)[0].item() for f in recvs] == [float(i) for i in range(12)]
        assert posting == ["ncclkv-link-sendthread-send"] * 12
        threads = [t for t in threading.enumerate() if t.name == "ncclkv-link-sendthread-send"]
        assert len(threads) == 2  # one per end
        l0.close()
        l1.close()
        assert not any(t.is_alive() for t in threads)  # closing the link ends it


def test_a_gloo_link_whose_post_fails_sends_nothing_after_it() -> None:
    """Send 1's post fails once: its receive at the peer must not take send 2's bytes (gloo would end the
    peer on a longer one); the link breaks instead, and every send after 1 fails unsent."""
    with DataPlane() as p0, DataPlane() as p1:
        l0, l1 = open_both(p0, p1, "postfails", p0.address, WAIT_S)
        sender = l0._backend._sender  # noqa: SLF001 - its post is what fails here
        real, calls = sender._post, []

        def post(tensor: torch.Tensor):
            calls.append(tensor[0].item())
            if len(calls) == 2:
                raise RuntimeError("transient post failure of send 1")
            return real(tensor)

        sender._post = post
        shapes = [(4,), (8,), (4,)]
        recvs = [l1.recv(shape, torch.float32) for shape in shapes]
        sends = [l0.send(torch.full(shape, float(i + 1))) for i, shape in enumerate(shapes)]
        assert recvs[0].result(WAIT_S).tolist() == [1.0] * 4
        assert sends[0].result(WAIT_S) is None
        for later in sends[1:]:
            assert isinstance(later.exception(WAIT_S), TransferError)
        assert calls == [1.0, 2.0]  # send 2 never reached gloo
        for late in recvs[1:]:
            assert late.exception(WAIT_S) is not None  # the peer's receives fail; none took another's bytes
        l0.close()
        l1.close()

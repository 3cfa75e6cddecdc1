"""Frame headers (ncclkv.transport._framing): the codec, and framed links over the in-process wire.

The gloo side (a real longer send that would end the receiving process) is
in tests/multiprocess/test_oversized_sender.py; here the same Link logic runs
over loopback wires, where every step can be ordered exactly.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future

import pytest
import torch

from ncclkv.errors import ProtocolError, ShapeMismatchError, TransferError
from ncclkv.transport import loopback_pair
from ncclkv.transport._framing import BATCH, Frame, check, decode, encode
from ncclkv.transport._pipe import Op

WAIT_S = 10.0


@pytest.mark.parametrize("tensor", [
    torch.zeros(2, 40, 4, 32), torch.zeros((), dtype=torch.int64), torch.zeros(0, 4, dtype=torch.uint8),
    torch.zeros(3, dtype=torch.bfloat16), torch.zeros(1, 1, 1, 1, 2, dtype=torch.float8_e4m3fn),
], ids=["kv", "scalar", "empty", "bf16", "fp8-5d"])
def test_a_header_describes_each_tensor_exactly(tensor: torch.Tensor) -> None:
    frames = decode(encode(41, [torch.zeros(7), tensor]))
    assert frames[1] == Frame(42, tensor.numel() * tensor.element_size(), tensor.dtype, tuple(tensor.shape))
    check(frames[1], 42, tensor)  # matches what it describes


def test_shapes_past_five_dims_are_checked_by_size_and_dtype() -> None:
    tensor = torch.zeros(1, 2, 1, 2, 1, 2)
    frame = decode(encode(0, [tensor]))[0]
    assert frame.shape is None and frame.nbytes == 32
    check(frame, 0, torch.zeros(8))
    with pytest.raises(ShapeMismatchError, match=r"\? torch.float32 \(32 B\).*\(9,\) torch.float32 \(36 B\)"):
        check(frame, 0, torch.zeros(9))


def test_a_mismatch_names_both_tensors_and_both_sizes() -> None:
    frame = decode(encode(3, [torch.zeros(2, 41, 4, 32)]))[0]
    with pytest.raises(ShapeMismatchError) as err:
        check(frame, 3, torch.zeros(2, 40, 4, 32))
    assert "the peer sends (2, 41, 4, 32) torch.float32 (41984 B)" in str(err.value)
    assert "posted (as announced) for (2, 40, 4, 32) torch.float32 (40960 B)" in str(err.value)
    with pytest.raises(ShapeMismatchError, match="torch.int32"):  # same bytes, other dtype
        check(decode(encode(0, [torch.zeros(4, dtype=torch.int32)]))[0], 0, torch.zeros(4))
    with pytest.raises(ProtocolError, match="entry 3 arrived where frame 4 was due"):
        check(frame, 4, torch.zeros(2, 41, 4, 32))


def test_garbage_is_not_a_header() -> None:
    with pytest.raises(ProtocolError, match="not a frame header"):
        decode(torch.zeros_like(encode(0, [torch.zeros(1)])))
    with pytest.raises(ValueError, match=f"1 to {BATCH}"):
        encode(0, [torch.zeros(1)] * (BATCH + 1))


def test_framed_link_carries_mixed_tensors_in_order() -> None:
    sent = [torch.arange(n, dtype=torch.float32).reshape(-1, 1) for n in range(0, 60, 3)]
    sent += [torch.tensor(5, dtype=torch.int64), torch.zeros(0, 2, dtype=torch.bfloat16), torch.ones(3, 7)]
    a, b = loopback_pair("framed-mixed", framed=True, timeout_s=WAIT_S)
    with a, b:
        recvs = [b.recv(t.shape, t.dtype) for t in sent[:5]]  # some posted before the sends, some after
        sends = [a.send(t) for t in sent]
        recvs += [b.recv(t.shape, t.dtype) for t in sent[5:]]
        for t, fut in zip(sent, recvs):
            assert torch.equal(fut.result(WAIT_S), t)
        for fut in sends:
            assert fut.result(WAIT_S) is None
        assert b.broken is None and a.broken is None


@pytest.mark.parametrize(("sent", "posted"), [(3000, 2000), (1000, 2000)], ids=["longer", "shorter"])
def test_framed_link_refuses_a_mismatched_receive_after_the_earlier_ones_landed(sent: int, posted: int) -> None:
    a, b = loopback_pair("framed-bad", framed=True, timeout_s=WAIT_S)
    with a, b:
        first, bad, after = torch.full((1000,), 1, dtype=torch.uint8), torch.zeros(sent, dtype=torch.uint8), \
            torch.full((500,), 3, dtype=torch.uint8)
        sends = [a.send(first), a.send(bad), a.send(after)]
        recvs = [b.recv((1000,), torch.uint8), b.recv((posted,), torch.uint8), b.recv((500,), torch.uint8)]
        assert torch.equal(recvs[0].result(WAIT_S), first)  # posted before the bad one: lands, not failed
        with pytest.raises(ShapeMismatchError, match=rf"sends \({sent},\) torch.uint8 \({sent} B\).*\({posted} B\)"):
            recvs[1].result(WAIT_S)
        with pytest.raises(TransferError, match="the link broke"):
            recvs[2].result(WAIT_S)
        assert isinstance(b.broken, ShapeMismatchError)
        assert sends[0].result(WAIT_S) is None
        with pytest.raises(TransferError):  # the peer's end fails too: its bytes never went out
            sends[1].result(WAIT_S)


def test_a_header_held_when_the_window_fills_goes_out_although_the_poster_was_about_to_sleep() -> None:
    """post_queued posts B on the caller's thread (its header held: A is in flight), then stops at C, which
    needs the window B holds: the poster must flush B's header even if it had just ended an idle turn and
    was between its gate and its wait (a bare notify is lost there, and B, then C, would wait for the deadline)."""
    a, b = loopback_pair("framed-gap", framed=True, timeout_s=WAIT_S, max_in_flight=8, max_in_flight_bytes=1000)
    pipe = a._pipes[0]  # noqa: SLF001 - the send pipe, to stop its poster at the exact point
    gate, in_gap, go_on, armed = pipe._gate, threading.Event(), threading.Event(), threading.Event()  # noqa: SLF001

    class GapGate:  # the poster's gate; once armed, the poster stops right after releasing it
        def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
            return gate.acquire(blocking, timeout)

        def release(self) -> None:
            gate.release()

        def __enter__(self) -> GapGate:
            gate.acquire()
            return self

        def __exit__(self, *exc_info: object) -> None:
            gate.release()
            if armed.is_set() and threading.current_thread().name.endswith("-post"):
                armed.clear()
                in_gap.set()
                assert go_on.wait(WAIT_S)

    pipe._gate = GapGate()  # noqa: SLF001
    with a, b:
        first, second, third = torch.ones(25), torch.full((200,), 2.0), torch.full((100,), 3.0)  # 100, 800, 400 B
        sent_first = a.send(first)  # posted at once, its header flushed: nothing else was in flight
        armed.set()
        pipe._wake_poster()  # noqa: SLF001 - one idle turn (nothing held), then it stops in the gap
        assert in_gap.wait(WAIT_S)
        ops = []
        for tensor in (second, third):
            future: Future = Future()
            future.set_running_or_notify_cancel()
            ops.append(Op(f"send {tensor.nbytes} B", tensor, future, WAIT_S))
            pipe.submit(ops[-1], wake=False)
        pipe.post_queued()  # posts the second (header held), stops at the third: 900 + 400 B > 1000
        assert torch.equal(b.recv(first.shape, first.dtype).result(WAIT_S), first)
        assert sent_first.result(WAIT_S) is None
        received = [b.recv(t.shape, t.dtype) for t in (second, third)]
        go_on.set()
        assert ops[0].future.result(WAIT_S) is None and ops[1].future.result(WAIT_S) is None
        assert torch.equal(received[0].result(WAIT_S), second) and torch.equal(received[1].result(WAIT_S), third)

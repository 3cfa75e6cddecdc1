import threading, time, pytest
from ncclkv import errors
from ncclkv.channel import Channel
from ncclkv.layout import KVGeometry, ParallelLayout
from ncclkv.protocol import Ack, Ready, Handshake
import sys; sys.path.insert(0, "tests/unit")
from test_channel import FAST, WAIT_S, ack_ready
from _channel_helpers import wait_until

def test_probe_b(make_channel):
    lost_by_b = []
    b = make_channel("B", on_message=ack_ready, on_peer_lost=lambda p, e: lost_by_b.append(e), **FAST)
    a1 = make_channel("A", on_message=ack_ready, **FAST)
    b.connect("A", a1.address)
    assert b.request("A", Ready("to A1"), timeout_s=WAIT_S) == Ack("to A1", None)
    a1.close()
    wait_until(lambda: b.loss_seq == 1, WAIT_S)
    a2 = make_channel("A", on_message=ack_ready, heartbeat_s=0.05, deadline_s=30.0)
    a2.connect("B", b.address)
    hello = Handshake.create("A-engine", "producer", 0, ParallelLayout(1, 1), KVGeometry(2, 2, 64), a2.address,
                             "h:2", incarnation=a2.incarnation)
    a2.send("B", hello)
    wait_until(lambda: b.connected_address("A") == a2.address, WAIT_S)
    # A2 stalls past B's deadline
    held, release = threading.Event(), threading.Event()
    beat = a2._io._beat
    def held_beat():
        if not held.is_set():
            held.set(); release.wait(10)
        beat()
    a2._io._beat = held_beat
    wait_until(lambda: b.loss_seq == 2, WAIT_S)
    print("lost:", b.connected_address("A"), lost_by_b)
    release.set()
    wait_until(lambda: b.peer_alive("A"), WAIT_S)  # A2 heard again on its connection
    print("alive again:", b.connected_address("A"), a1.address, a2.address)
    b.connect("A", a2.address)
    print("after connect", b.loss_seq, lost_by_b)
    wait_until(lambda: b.loss_seq == 4, WAIT_S)
    for i in range(3):
        b.connect("A", a2.address)
        try:
            print("retry", i, b.request("A", Ready("to A2"), timeout_s=2))
        except Exception as e:
            print("retry", i, repr(e))
        wait_until(lambda: not b.peer_alive("A"), WAIT_S)
    print(b.stats)

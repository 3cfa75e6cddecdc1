"""The engine's own deadline_s bounds its data plane's store calls, and its waits check their timeouts.

EngineConfig.deadline_s used to reach every wait but the data plane's: its
TCPStore (and its connections to peers' stores) waited NCCLKV_DEADLINE_S.
The consumer's waits took any float: nan was ignored, a negative one timed
out at once, inf raised OverflowError deep in Condition.wait.
"""

from __future__ import annotations

import math
import time

import pytest
import torch.distributed as dist

from ncclkv.engine import EngineConfig, TransferEngine
from ncclkv.errors import TransferTimeout
from ncclkv.layout import KVGeometry, ParallelLayout
from ncclkv.paged import CacheLayout
from ncclkv.transport import DataPlane, LoopbackHub, LoopbackTransport

from .kvsim import build_sides, close_sides, engine_ref

GQA = KVGeometry(num_layers=4, num_kv_heads=4, head_size=32, dtype="float32")
ONE = ParallelLayout(1, 1)
ENV_DEADLINE_S = 6.0
ENGINE_DEADLINE_S = 0.5


def _timed_get(store: dist.Store) -> float:
    """Seconds a blocking get of a key nobody sets took to time out."""
    started = time.monotonic()
    with pytest.raises(dist.DistStoreError, match="timeout"):
        store.get("never-set")
    return time.monotonic() - started


def test_the_data_plane_store_waits_the_engines_deadline_not_the_environments(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NCCLKV_DEADLINE_S", str(ENV_DEADLINE_S))
    engine = TransferEngine(EngineConfig("short", 0, ONE, GQA, deadline_s=ENGINE_DEADLINE_S))
    peer = TransferEngine(EngineConfig("long", 0, ONE, GQA))  # the environment's deadline
    try:
        plane = engine._data_plane  # noqa: SLF001 - its store: what a link rendezvous blocks on
        assert isinstance(plane, DataPlane)
        # Its own store, and its connection to a peer's store, both time out after the engine's deadline_s.
        assert _timed_get(plane._client(plane.address, time.monotonic() + 5)) < ENV_DEADLINE_S / 2  # noqa: SLF001
        assert _timed_get(plane._client(peer._data_plane.address, time.monotonic() + 5)) < ENV_DEADLINE_S / 2  # noqa: SLF001
    finally:
        engine.close()
        peer.close()


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, -1.0, 2e9])
def test_a_data_plane_refuses_a_deadline_that_is_no_number_of_seconds(bad: float) -> None:
    with pytest.raises(ValueError, match=rf"deadline_s must be .*got {bad!r}"):
        DataPlane("127.0.0.1", deadline_s=bad)


BAD_TIMEOUTS = [(math.nan, ValueError), (math.inf, ValueError), (-1.0, ValueError), (-0.5, ValueError),
                (2e9, ValueError), (True, TypeError), ("1", TypeError)]


@pytest.mark.parametrize(("bad", "error"), BAD_TIMEOUTS, ids=repr)
def test_the_waits_refuse_a_timeout_that_is_no_number_of_seconds(bad: object, error: type[Exception]) -> None:
    """Checked before waiting, naming the value: before, nan and inf waited for the request's stall (1 s here)
    and a negative one timed out at once; wait_finished_receiving raised OverflowError for inf."""
    hub = LoopbackHub()
    prefill = build_sides("prefill", ONE, GQA, CacheLayout.CPU, 16, "producer", transports=[LoopbackTransport(hub)])
    decode = build_sides("decode", ONE, GQA, CacheLayout.CPU, 16, "consumer", transports=[LoopbackTransport(hub)],
                         deadline_s=1.0)
    try:
        consumer = decode[0].engine
        consumer.expect("r", engine_ref("prefill", ONE, prefill), [0, 1], 20)  # parked: nothing lands
        named = rf"timeout_s must be .*got .*{bad!r}"
        with pytest.raises(error, match=named):
            consumer.wait_layer("r", 0, timeout_s=bad)  # type: ignore[arg-type]
        with pytest.raises(error, match=named):
            consumer.wait("r", timeout_s=bad)  # type: ignore[arg-type]
        with pytest.raises(error, match=named):
            consumer.wait_finished_receiving(bad)  # type: ignore[arg-type]
        assert consumer.take_finished_receiving() == {}  # the request itself is untouched
    finally:
        close_sides(prefill, decode)


def test_the_waits_keep_none_and_zero() -> None:
    hub = LoopbackHub()
    prefill = build_sides("prefill", ONE, GQA, CacheLayout.CPU, 16, "producer", transports=[LoopbackTransport(hub)])
    decode = build_sides("decode", ONE, GQA, CacheLayout.CPU, 16, "consumer", transports=[LoopbackTransport(hub)])
    try:
        consumer = decode[0].engine
        consumer.expect("r", engine_ref("prefill", ONE, prefill), [0, 1], 20)
        assert consumer.wait_finished_receiving(0) is False  # 0 only looks
        with pytest.raises(TransferTimeout, match=r"layer 0 not landed within 0(\.0)?s"):
            consumer.wait_layer("r", 0, timeout_s=0)
        prefill[0].fill(seed=1, block_ids=[0, 1], num_tokens=20)
        prefill[0].engine.finish("r", [0, 1], 20)
        consumer.wait("r", timeout_s=None)  # None: as long as it makes progress (deadline_s)
        consumer.wait_layer("r", 0)
        assert consumer.take_finished_receiving() == {"r": None}
    finally:
        close_sides(prefill, decode)

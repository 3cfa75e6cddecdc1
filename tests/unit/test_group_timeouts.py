"""How open_group names a failure to connect a group: a timeout only when time ran out (torch, gloo or NCCL said
so, or the deadline passed), not whenever the text holds "time" ("RuntimeError", "runtime", "lifetime")."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from ncclkv.errors import TransferError, TransferTimeout
from ncclkv.transport import _group

WAIT_S = 10.0  # the deadline given to open_group: far away, so only the text can make a failure a timeout


def _real_store_timeout() -> Exception:
    """What torch raises when a store wait runs out of time (torch 2.13: DistStoreError 'Wait timeout')."""
    try:
        dist.HashStore().wait(["never-set"], timedelta(milliseconds=1))
    except Exception as exc:  # noqa: BLE001 - returned to be raised where a group is made
        return exc
    raise AssertionError("a wait on a key nobody sets returned")


def _open_failing(monkeypatch: pytest.MonkeyPatch, error: Exception, link_id: str) -> None:
    """open_group against a store where the peer already joined with gloo, and whose group fails with ``error``."""
    client = dist.HashStore()
    dist.PrefixStore(f"ncclkv/{link_id}", client).set("backend/1", "gloo")

    def make_group(*args: object) -> dist.ProcessGroup:
        raise error

    monkeypatch.setattr(_group, "_make_group", make_group)
    _group.open_group(link_id, 0, "tcp://127.0.0.1:1", client, torch.device("cpu"), time.monotonic() + WAIT_S,
                      WAIT_S, lambda: None)


@pytest.mark.parametrize("text", [
    "Wait timeout",  # a store wait (HashStore)
    "wait timeout after 300ms, keys: /ncclkv/l/0/1",  # a TCPStore wait, e.g. gloo's rendezvous
    "Socket Timeout",
    "[../third_party/gloo/gloo/transport/tcp/pair.cc:446] Connect timeout [127.0.0.1]:41231",
    "Timed out waiting 1000ms for recv operation to complete",
    "The client socket has timed out after 1000ms while trying to connect to (127.0.0.1, 29500).",
    "Watchdog caught collective operation timeout: WorkNCCL(SeqNum=1, OpType=SEND) ran for 600000 milliseconds",
])
def test_what_torch_says_when_time_runs_out_is_a_timeout(text: str) -> None:
    assert _group._is_timeout(RuntimeError(text), text)


@pytest.mark.parametrize("text", [
    "RuntimeError",  # the text open_group reports for an exception without a message
    "runtime error in the gloo pair",
    "the pair's lifetime ended: Connection reset by peer",
    "Connection refused",
    "NCCL error: unhandled system error (run with NCCL_DEBUG=INFO for details)",
])
def test_other_failures_are_not_timeouts(text: str) -> None:
    assert not _group._is_timeout(RuntimeError(text), text)


def test_a_python_timeout_error_is_a_timeout_whatever_its_text() -> None:
    assert _group._is_timeout(TimeoutError("no route"), "no route")


@pytest.mark.parametrize("error", [RuntimeError(), RuntimeError("runtime failure: the pair's lifetime ended")])
def test_open_group_reports_a_non_timeout_failure_as_a_transfer_error(
    monkeypatch: pytest.MonkeyPatch, error: Exception,
) -> None:
    with pytest.raises(TransferError, match=r"cannot connect to peer \(link rank 1\): (RuntimeError$|runtime failure)") as caught:
        _open_failing(monkeypatch, error, "not-a-timeout")
    assert type(caught.value) is TransferError, f"a {type(caught.value).__name__}: {caught.value}"


def test_open_group_reports_torchs_own_timeout_as_a_transfer_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    error = _real_store_timeout()
    with pytest.raises(TransferTimeout, match=r"not connected within .*: Wait timeout"):
        _open_failing(monkeypatch, error, "a-timeout")

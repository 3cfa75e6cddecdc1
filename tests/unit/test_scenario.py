"""ncclkv.scenario without a launcher: topology, ring payload checks, the store rendezvous, exit codes.

The scenarios themselves run under real launchers in tests/launchers.
"""

from __future__ import annotations

import argparse
import os
import re
import select
import subprocess
import sys
import threading
import time
import types
from collections.abc import Callable
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from ncclkv._env import env_settings
from ncclkv._timeout import MAX_TIMEOUT_S
from ncclkv.errors import PeerLostError, TransferTimeout
from ncclkv.launch import LaunchInfo, free_port
from ncclkv.layout import KVGeometry, ParallelLayout
from ncclkv.scenario import EXIT_CHECK_FAILED, EXIT_OK, EXIT_PEER_FAILURE, SCENARIOS, PDTopology, ScenarioError, load_scenario
from ncclkv.scenario.__main__ import build_parser, main
from ncclkv.scenario._common import checked_topology, resolve_bind_host, resolve_device, topology_from_args
from ncclkv.scenario._rendezvous import StoreRendezvous
from ncclkv.scenario._ring import RingConfig, check_payload, ring_payload
from ncclkv.scenario._transfer import TransferConfig, check_kill

WAIT_S = 20.0


def info(rank: int, world_size: int, port: int = 29500, local_world_size: int | None = None,
         gpus_per_task: int | None = None) -> LaunchInfo:
    local = world_size if local_world_size is None else local_world_size
    launcher = "env" if gpus_per_task is None else "slurm"
    return LaunchInfo(launcher, rank, world_size, rank % local, local, "127.0.0.1", port, gpus_per_task=gpus_per_task)


# -- topology ------------------------------------------------------------------


def test_topology_places_prefill_instances_then_decode_instances() -> None:
    topo = PDTopology(2, ParallelLayout(2, 1), 1, ParallelLayout(2, 2))
    places = [str(topo.place(rank)) for rank in range(topo.world_size)]
    assert topo.world_size == 8 and str(topo) == "2P(tp=2,pp=1)+1D(tp=2,pp=2)"
    assert places == [
        "prefill[0] tp_rank=0 pp_rank=0", "prefill[0] tp_rank=1 pp_rank=0",
        "prefill[1] tp_rank=0 pp_rank=0", "prefill[1] tp_rank=1 pp_rank=0",
        "decode[0] tp_rank=0 pp_rank=0", "decode[0] tp_rank=1 pp_rank=0",
        "decode[0] tp_rank=0 pp_rank=1", "decode[0] tp_rank=1 pp_rank=1",
    ]
    with pytest.raises(ValueError, match=r"rank=8 outside the world_size=8"):
        topo.place(8)
    with pytest.raises(ValueError, match=r"needs 8 ranks, torchrun started 4"):
        topo.check_world(4, "torchrun")
    with pytest.raises(ValueError, match=r"num_decode must be a positive int, got 0"):
        PDTopology(1, ParallelLayout(), 0, ParallelLayout())


def test_topology_options_come_together_or_not_at_all() -> None:
    parser = build_parser("ring")
    assert topology_from_args(parser.parse_args(["--kind", "ring"])) is None
    topo = topology_from_args(parser.parse_args(["--kind", "ring", "--prefill", "1", "--decode", "2", "--decode-tp", "2"]))
    assert topo == PDTopology(1, ParallelLayout(1, 1), 2, ParallelLayout(2, 1))
    with pytest.raises(ValueError, match=r"--prefill=1, --decode=None"):
        topology_from_args(parser.parse_args(["--kind", "ring", "--prefill", "1"]))
    # What __main__ and every scenario's run check: the set against the ranks the launcher started.
    pd_args = parser.parse_args(["--kind", "ring", "--prefill", "1", "--decode", "2", "--decode-tp", "2"])
    assert checked_topology(pd_args, info(0, 5)) == topo
    assert checked_topology(parser.parse_args(["--kind", "ring"]), info(0, 3)) is None
    with pytest.raises(ValueError, match=r"1P\(tp=1,pp=1\)\+2D\(tp=2,pp=1\) needs 5 ranks, env started 4"):
        checked_topology(pd_args, info(0, 4))


@pytest.mark.parametrize(
    ("gpus", "local_world_size", "gpus_per_task", "device"),
    [
        (1, 4, 1, "cuda:0"),  # srun --gpus-per-task=1: each task sees its own one GPU ...
        (2, 4, 2, "cuda:1"),  # ... or its own two (local rank 3 takes 3 % 2)
        (1, 4, None, "cpu"),  # one GPU for four local ranks, none bound per task: they would share it
        (4, 4, None, "cuda:3"),  # one visible per local rank
        (0, 4, 1, "cpu"),  # bound per task, but this torch sees no GPU
    ],
)
def test_auto_device_takes_the_gpus_slurm_bound_to_each_task(
    gpus: int, local_world_size: int, gpus_per_task: int | None, device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    rank_info = info(7, 8, local_world_size=local_world_size, gpus_per_task=gpus_per_task)  # local rank 3
    assert resolve_device("auto", rank_info) == torch.device(device)


# -- ring payloads and configuration --------------------------------------------


def test_payload_check_names_ranks_seq_and_first_bad_byte() -> None:
    good = ring_payload(sender=1, seq=5, nbytes=4096)
    check_payload(good.clone(), receiver=2, sender=1, seq=5)
    bad = good.clone()
    bad[1000] ^= 0xFF
    with pytest.raises(ScenarioError, match=r"rank 2: tensor seq 5 from rank 1 differs in 1 of 4096 bytes \(first at byte 1000\)"):
        check_payload(bad, receiver=2, sender=1, seq=5)
    with pytest.raises(ScenarioError, match=r"it carries rank 1 seq 6"):  # out of order: says what arrived instead
        check_payload(ring_payload(1, 6, 4096), receiver=2, sender=1, seq=5)
    assert not torch.equal(ring_payload(0, 5, 4096), ring_payload(1, 5, 4096))


def test_a_transfer_run_waits_three_deadlines_at_most_the_longest_timeout() -> None:
    geometry = KVGeometry(2, 2, 8, "float32")
    assert TransferConfig(geometry, (16,), deadline_s=10.0).run_deadline_s == 30.0
    assert TransferConfig(geometry, (16,), deadline_s=9e8).run_deadline_s == MAX_TIMEOUT_S
    with pytest.raises(ValueError, match=re.escape("deadline_s must be a finite number of seconds > 0 (at most "
                                                   "1e+09), got inf")):
        TransferConfig(geometry, (16,), deadline_s=float("inf"))


@pytest.mark.parametrize(("value", "message"), [
    ("0", "'0' must be a finite number of seconds > 0 (at most 1e+09), got 0.0"),
    ("inf", "'inf' must be a finite number of seconds > 0 (at most 1e+09), got inf"),
    ("soon", "'soon' is not a number"),
])
def test_the_deadline_option_takes_the_timeout_rule(value: str, message: str,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        build_parser("ring").parse_args(["--kind", "ring", "--deadline", value])
    assert exited.value.code == 2 and f"argument --deadline: {message}" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"count": 0}, r"count must be >= 1, got 0"),
        ({"nbytes": 20}, r"nbytes must be a multiple of 8 and >= 24, got 20"),
        ({"deadline_s": 0.0}, r"deadline_s must be a finite number of seconds > 0 \(at most 1e\+09\), got 0.0"),
        ({"deadline_s": float("inf")}, r"deadline_s must be a finite number of seconds > 0 \(at most 1e\+09\), got inf"),
        ({"kill_rank": 1, "kill_at": 8}, r"kill_at must be in \[0, count=8\), got 8"),
    ],
)
def test_ring_config_rejects_bad_values(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RingConfig(**kwargs)  # type: ignore[arg-type]


def test_ring_config_checks_the_world() -> None:
    with pytest.raises(ValueError, match=r"a ring needs at least 2 ranks, the launcher started 1"):
        RingConfig().check_world(1)
    with pytest.raises(ValueError, match=r"kill_rank=4 is outside world_size=4"):
        RingConfig(kill_rank=4).check_world(4)


# -- registry, parser, resolution ---------------------------------------------------


def test_unknown_kind_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown scenario kind 'nope'; known: .*ring"):
        load_scenario("nope")
    args = build_parser("ring").parse_args(["--kind", "ring", "--small", "--count", "3"])
    assert (args.count, args.small, args.kill_rank) == (3, True, None)


def test_device_and_bind_host_resolution() -> None:
    assert resolve_device("cpu", info(0, 2)) == torch.device("cpu")
    if not torch.cuda.is_available():
        assert resolve_device("auto", info(0, 2)) == torch.device("cpu")
        with pytest.raises(ValueError, match=r"--device cuda on rank 0, but torch sees no GPU"):
            resolve_device("cuda", info(0, 2))
    with pytest.raises(ValueError, match=r"--device must be cpu, cuda or auto, got 'tpu'"):
        resolve_device("tpu", info(0, 2))
    assert resolve_bind_host(None, info(0, 2)) is None
    assert resolve_bind_host("127.0.0.1", info(0, 2)) == "127.0.0.1"
    with pytest.raises(ValueError, match=r"--bind-host '192\.0\.2\.3' is not an address of this host"):
        resolve_bind_host("192.0.2.3", info(0, 2))  # TEST-NET-1: no host's own
    assert resolve_bind_host("auto", info(0, 2)) == "127.0.0.1"
    with pytest.raises(ValueError, match=r"found loopback 127.0.0.1 .* spans several nodes"):
        resolve_bind_host("auto", info(0, 8, local_world_size=4))


# -- the store rendezvous, ranks as threads ---------------------------------------


def on_ranks(world_size: int, body: Callable[[int], object]) -> list[object]:
    """Run ``body(rank)`` on one thread per rank; return each result or the exception it raised."""
    results: list[object] = [None] * world_size

    def target(rank: int) -> None:
        try:
            results[rank] = body(rank)
        except Exception as exc:  # noqa: BLE001 - returned to the test, which asserts on it
            results[rank] = exc

    threads = [threading.Thread(target=target, args=(rank,)) for rank in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT_S)
    assert not any(thread.is_alive() for thread in threads), "a rank did not finish within its deadline"
    return results


def test_rendezvous_exchanges_values_then_finishes() -> None:
    port = free_port()

    def body(rank: int) -> list[str]:
        rendezvous = StoreRendezvous(info(rank, 3, port), prefix="t", deadline_s=WAIT_S)
        values = rendezvous.exchange(f"addr-{rank}")
        rendezvous.finish()
        return values

    assert on_ranks(3, body) == [["addr-0", "addr-1", "addr-2"]] * 3


def test_rendezvous_failure_on_one_rank_reaches_the_others() -> None:
    port = free_port()

    def body(rank: int) -> None:
        rendezvous = StoreRendezvous(info(rank, 3, port), prefix="t", deadline_s=WAIT_S)
        rendezvous.exchange(str(rank))
        if rank == 2:
            rendezvous.report_failure("TransferError: link broke")
            raise ScenarioError("rank 2 gave up")
        rendezvous.finish()

    outcomes = on_ranks(3, body)
    for rank in (0, 1):
        assert isinstance(outcomes[rank], PeerLostError)
        assert f"rank {rank}: " in str(outcomes[rank]) and "rank 2 failed: TransferError: link broke" in str(outcomes[rank])


def test_rendezvous_failure_ends_the_others_exchange_not_their_deadline() -> None:
    """Rank 2 fails before it publishes; ranks 0 and 1, waiting for its value, learn of it at once.

    Their deadline is far beyond on_ranks' join, so only the reported failure can end their wait.
    """
    port = free_port()

    def body(rank: int) -> list[str]:
        rendezvous = StoreRendezvous(info(rank, 3, port), prefix="t", deadline_s=100 * WAIT_S)
        if rank == 2:
            rendezvous.report_failure("TransferTimeout: no progress")
            raise ScenarioError("rank 2 gave up")
        return rendezvous.exchange(str(rank), name="result")

    outcomes = on_ranks(3, body)
    for rank in (0, 1):
        assert isinstance(outcomes[rank], PeerLostError), outcomes
        assert f"rank {rank}: " in str(outcomes[rank]) and "waiting for every rank to publish their value: " \
            "rank 2 failed: TransferTimeout: no progress" in str(outcomes[rank]), outcomes


def test_rendezvous_missing_rank_is_a_timeout_naming_it() -> None:
    port = free_port()

    def body(rank: int) -> list[str]:  # rank 2 of 3 never comes
        return StoreRendezvous(info(rank, 3, port), prefix="t", deadline_s=1.0).exchange(str(rank))

    outcomes = on_ranks(2, body)
    assert all(isinstance(exc, TransferTimeout) and "missing ['value/2']" in str(exc) for exc in outcomes), outcomes


def test_rendezvous_finish_timeout_names_the_rank_that_never_finished() -> None:
    """Rank 2 of 3 publishes its value, then never finishes (it died, it hangs): the others' finish said
    "missing ['outcome']", a key of the store, not who they waited for."""
    port = free_port()

    def body(rank: int) -> None:
        rendezvous = StoreRendezvous(info(rank, 3, port), prefix="t", deadline_s=2.0)
        rendezvous.exchange(str(rank))
        if rank != 2:
            rendezvous.finish()

    outcomes = on_ranks(3, body)
    assert outcomes[2] is None, outcomes
    for rank in (0, 1):
        assert isinstance(outcomes[rank], TransferTimeout), outcomes
        assert f"rank {rank}: " in str(outcomes[rank]) and "missing ['finished/2']" in str(outcomes[rank]), outcomes


_FINISHING_RANK = """
import sys
from ncclkv.launch import LaunchInfo
from ncclkv.scenario._rendezvous import StoreRendezvous
print("imported", flush=True)  # the other ranks wait 2 s for this one's value: not for its imports as well
rendezvous = StoreRendezvous(LaunchInfo("env", 2, 3, 2, 3, "127.0.0.1", int(sys.argv[1])), prefix="t", deadline_s=20.0)
rendezvous.exchange("2")
rendezvous.finish()  # killed while it waits for the outcome, after it counted itself done
"""


def test_rendezvous_finish_timeout_names_the_rank_that_never_read_the_outcome() -> None:
    """Rank 2 of 3 finishes (counts itself done) and dies while it waits for the others; the outcome is ok, and
    the hosting rank waits for every rank to have read it: its deadline said "missing ['all_left']", a key of the
    store, not the rank it waited for."""
    port = free_port()
    killed = threading.Event()
    prefixes: list[str] = []

    def body(rank: int) -> None:
        rendezvous = StoreRendezvous(info(rank, 3, port), prefix="t", deadline_s=2.0)
        prefixes.append(rendezvous.prefix)
        rendezvous.exchange(str(rank))
        assert killed.wait(WAIT_S)
        rendezvous.finish()

    outcomes: list[object] = []
    ranks = threading.Thread(target=lambda: outcomes.extend(on_ranks(2, body)))
    child = subprocess.Popen([sys.executable, "-c", _FINISHING_RANK, str(port)], stdout=subprocess.PIPE, text=True)
    try:
        # Its imports take seconds on a loaded machine, more than the ranks' deadline_s: the ranks start after them.
        assert select.select([child.stdout], [], [], WAIT_S)[0] and child.stdout.readline() == "imported\n"
        ranks.start()
        client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=WAIT_S))
        done_by = time.monotonic() + WAIT_S
        while not (prefixes and client.add(f"{prefixes[0]}/done", 0) == 1):  # rank 2 counted itself done
            assert time.monotonic() < done_by and child.poll() is None, "rank 2 never finished"
            time.sleep(0.01)
    finally:
        child.kill()
        child.wait(WAIT_S)
        child.stdout.close()
        killed.set()
    ranks.join(WAIT_S)
    assert outcomes[1] is None, outcomes
    assert isinstance(outcomes[0], TransferTimeout), outcomes
    assert "rank 0: " in str(outcomes[0]) and "read the outcome" in str(outcomes[0]), outcomes
    assert "missing ['left/2']" in str(outcomes[0]), outcomes


def test_a_restarted_attempt_reads_none_of_the_previous_attempts_keys() -> None:
    """torchrun's agent store outlives its workers: attempt 1 meets in the same store as attempt 0 did.

    Under attempt 0's keys, rank 0 of attempt 1 got attempt 0's addresses at once, before its peer even started.
    """
    port = free_port()
    agent = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=WAIT_S), wait_for_workers=False)

    def attempt_info(rank: int, attempt: int) -> LaunchInfo:
        return LaunchInfo("torchrun", rank, 2, rank, 2, "127.0.0.1", port, store_hosted=True, attempt=attempt)

    def attempt_body(attempt: int) -> Callable[[int], list[str]]:
        def body(rank: int) -> list[str]:
            rendezvous = StoreRendezvous(attempt_info(rank, attempt), prefix="t", deadline_s=WAIT_S)
            values = rendezvous.exchange(f"addr-{rank}-attempt{attempt}")
            rendezvous.finish()
            return values
        return body

    try:
        assert on_ranks(2, attempt_body(0)) == [["addr-0-attempt0", "addr-1-attempt0"]] * 2
        # Attempt 1's rank 0 alone: its peer has published nothing in this attempt yet.
        alone = StoreRendezvous(attempt_info(0, 1), prefix="t", deadline_s=0.5)
        assert alone.prefix == "t/step0/attempt1"
        with pytest.raises(TransferTimeout, match=r"missing \['value/1'\]"):
            alone.exchange("addr-0-attempt1")
        assert on_ranks(2, attempt_body(2)) == [["addr-0-attempt2", "addr-1-attempt2"]] * 2
    finally:
        del agent


# -- exit codes of python -m ncclkv.scenario -------------------------------------------


def fake_scenario(monkeypatch: pytest.MonkeyPatch, kind: str, run: Callable[[LaunchInfo, argparse.Namespace], object],
                  add_arguments: Callable[[argparse.ArgumentParser], object] = lambda parser: None) -> None:
    """Register ``kind`` as a scenario module with this ``run`` and ``add_arguments``, for this test only (its
    ``check`` passes the options on to ``run``); and unset the variables of the launchers that discover() would
    take before plain RANK/WORLD_SIZE."""
    module = types.ModuleType(f"ncclkv_test_{kind}")
    module.HELP = f"the test's {kind} scenario"  # type: ignore[attr-defined]
    module.add_arguments = add_arguments  # type: ignore[attr-defined]
    module.check = lambda args, launch: args  # type: ignore[attr-defined]
    module.run = run  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setitem(SCENARIOS, kind, module.__name__)
    for name in ("TORCHELASTIC_RUN_ID", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMI_SIZE",
                 "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize(
    ("error", "code", "printed"),
    [
        (None, EXIT_OK, ""),
        (PeerLostError("heartbeats stopped"), EXIT_PEER_FAILURE, "rank 0: peer failure detected: PeerLostError: heartbeats stopped"),
        (ScenarioError("rank 0: bytes differ"), EXIT_CHECK_FAILED, "rank 0: check failed: rank 0: bytes differ"),
    ],
)
def test_main_maps_outcomes_to_exit_codes(
    error: Exception | None, code: int, printed: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    seen: list[argparse.Namespace] = []

    def run(launch: LaunchInfo, args: argparse.Namespace) -> None:
        seen.append(args)
        if error is not None:
            raise error

    fake_scenario(monkeypatch, "outcome", run, lambda parser: parser.add_argument("--flag", action="store_true"))
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert main(["--kind", "outcome", "--flag"]) == code
    assert seen and seen[0].flag is True
    assert printed in capsys.readouterr().err


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--prefill", "2"], "give both --prefill and --decode (got --prefill=2, --decode=None)"),
        (["--decode", "1", "--decode-tp", "2"], "--prefill=None, --decode=1"),
        (["--prefill", "1", "--decode", "1", "--decode-tp", "2"], "1P(tp=1,pp=1)+1D(tp=2,pp=1) needs 3 ranks, env started 2"),
    ],
)
def test_main_reports_bad_pd_options_as_usage_errors(
    options: list[str], message: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Exit 2 with argparse's usage line and the values, before the scenario runs (was exit 1 with a traceback)."""
    ran: list[LaunchInfo] = []
    fake_scenario(monkeypatch, "usage", lambda launch, args: ran.append(launch))
    for name in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_STEP_NUM_NODES", "SLURM_NNODES"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    with pytest.raises(SystemExit) as exit_:
        main(["--kind", "usage", *options])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "usage: python -m ncclkv.scenario" in err and "scenario: error: " in err and message in err, err
    assert not ran


def test_the_entry_point_freezes_the_imported_heap_before_main() -> None:
    """Out of the cyclic GC's full collections (each stopped every thread ~50 ms with torch's heap in them)."""
    probe = (
        "import gc, runpy, sys\n"
        "sys.argv = ['ncclkv.scenario', '--help']\n"
        "try:\n"
        "    runpy.run_module('ncclkv.scenario', run_name='__main__')\n"
        "except SystemExit as exc:\n"
        "    assert exc.code == 0, exc.code\n"
        "assert 'torch' in sys.modules  # its heap is the one worth freezing\n"
        "print('frozen', gc.get_freeze_count())\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True).stdout
    frozen = int(out.rsplit("frozen", 1)[1])
    assert frozen > 10_000, out[-500:]


@pytest.mark.parametrize(("mode", "kill_rank", "message"), [
    ("pull", 0, r"--kill-rank 0 needs --mode push"),
    ("push", 2, r"--kill-rank 2 is not a prefill rank of .* \(4 ranks\)"),  # a decode rank
    ("push", 7, r"--kill-rank 7 is not a prefill rank"),
    ("push", 1, r"--kill-rank 1: prefill\[1\] pushes none of the 1 requests"),
])
def test_transfer_kill_rank_must_inject_something(mode: str, kill_rank: int, message: str) -> None:
    topology = PDTopology(2, ParallelLayout(1, 1), 2, ParallelLayout(1, 1))
    cfg = TransferConfig(KVGeometry(2, 2, 8, "float32"), (16,), mode, 10.0, kill_rank)
    with pytest.raises(ValueError, match=message):
        check_kill(cfg, topology, 4)
    check_kill(TransferConfig(cfg.geometry, (16,), "push", 10.0, 0), topology, 4)  # prefill[0] pushes request 0



def test_ncclkv_bind_host_auto_is_resolved_by_the_entry_point(monkeypatch: pytest.MonkeyPatch) -> None:
    """NCCLKV_BIND_HOST=auto worked only as --bind-host auto: a direct run bound the literal host 'auto'."""
    seen: list[tuple[str | None, str | None, str | None]] = []

    def run(launch: LaunchInfo, args: argparse.Namespace) -> None:
        seen.append((args.bind_host, resolve_bind_host(args.bind_host, launch), os.environ.get("NCCLKV_BIND_HOST")))
        env_settings()  # what the data plane and the engine read: no 'auto' left in it

    fake_scenario(monkeypatch, "bindhost", run)
    for name in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_STEP_NUM_NODES", "SLURM_NNODES"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    monkeypatch.setenv("NCCLKV_BIND_HOST", "auto")
    assert main(["--kind", "bindhost"]) == EXIT_OK
    assert seen == [("auto", "127.0.0.1", None)]
    monkeypatch.setenv("NCCLKV_BIND_HOST", "auto")
    assert main(["--kind", "bindhost", "--bind-host", "127.0.0.2"]) == EXIT_OK  # the option wins
    assert seen[1] == ("127.0.0.2", "127.0.0.2", None)
    monkeypatch.setenv("NCCLKV_BIND_HOST", "127.0.0.3")  # an address stays where every reader finds it
    assert main(["--kind", "bindhost"]) == EXIT_OK
    assert seen[2] == (None, None, "127.0.0.3")
    # Outside the scenario nothing knows MASTER_ADDR: an engine or the connector refuses 'auto' by name.
    with pytest.raises(ValueError, match=r"NCCLKV_BIND_HOST='auto': 'auto' .* is understood only by "
                                         r"python -m ncclkv.scenario"):
        env_settings({"NCCLKV_BIND_HOST": "auto"})

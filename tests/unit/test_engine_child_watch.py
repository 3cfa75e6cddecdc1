"""A demo engine child ends, with its process group, when its parent goes, even while its main thread is busy.

Real processes and a real socketpair: the child runs ``watch_parent`` and then
holds its main thread in a long sleep (as vLLM does while it builds an engine),
with a grandchild in its group standing in for a vLLM worker.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

WAIT_S = 20.0

_CHILD = """
import subprocess, sys, time
from ncclkv.demo._engine_child import watch_parent
worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
print(worker.pid, flush=True)
watch_parent(int(sys.argv[1]))
time.sleep(120)  # busy: only the watchdog can notice the parent
"""


def _alive(pid: int) -> bool:
    """Running (a zombie is not: an orphan waits there until whoever adopted it reaps it)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            state = stat.read().rpartition(")")[2].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def _wait_gone(pid: int, deadline: float) -> bool:
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.05)  # polling a pid for its end: nothing else to wait on for a grandchild
    return False


@pytest.mark.parametrize("how", ["close", "shutdown"])
def test_child_and_its_group_end_when_the_parent_end_closes(how: str) -> None:
    ours, theirs = socket.socketpair()
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(theirs.fileno())], pass_fds=(theirs.fileno(),),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    theirs.close()
    try:
        assert child.stdout is not None
        worker_pid = int(child.stdout.readline())
        assert _alive(worker_pid)
        # Still running with the parent's end open: the watchdog does not fire on its own.
        with pytest.raises(subprocess.TimeoutExpired):
            child.wait(timeout=0.5)
        if how == "close":
            ours.close()  # what a killed parent's exit does to its end
        else:
            ours.shutdown(socket.SHUT_RDWR)
        assert child.wait(timeout=WAIT_S) == -signal.SIGKILL  # killpg of its own group, itself included
        assert _wait_gone(worker_pid, time.monotonic() + WAIT_S), "the child's worker outlived it"
        assert child.stderr is not None
        assert "the parent is gone" in child.stderr.read().decode()
    finally:
        ours.close()
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait(timeout=WAIT_S)


def test_child_outside_its_own_group_exits_alone() -> None:
    """Not a group leader (run without start_new_session): it must not kill the group it shares (ours)."""
    ours, theirs = socket.socketpair()
    code = ("import sys, time\nfrom ncclkv.demo._engine_child import watch_parent\n"
            "print('watching', flush=True)\nwatch_parent(int(sys.argv[1]))\ntime.sleep(120)\n")
    child = subprocess.Popen([sys.executable, "-c", code, str(theirs.fileno())], pass_fds=(theirs.fileno(),),
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    theirs.close()
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == b"watching"
        ours.close()
        assert child.wait(timeout=WAIT_S) == 1  # os._exit(1), and we (same group) are still here
    finally:
        ours.close()
        if child.poll() is None:
            child.kill()
            child.wait(timeout=WAIT_S)


def test_engine_child_busy_in_start_dies_with_its_sigkilled_parent(tmp_path) -> None:
    """The wiring in the engine child's main: a parent launches ``ncclkv.demo._engine_child`` as EngineProcess
    does (socketpair, own session), sends 'start' and is SIGKILLed while the child's main thread is held in
    ``import vllm`` (a stand-in module on PYTHONPATH that sleeps: only the watchdog can end the child)."""
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text("import time\nprint('importing', flush=True)\ntime.sleep(120)\n")
    log = tmp_path / "child.log"
    parent_code = f"""
import os, socket, subprocess, sys, time
from multiprocessing.connection import Connection
parent_sock, child_sock = socket.socketpair()
env = {{**os.environ, "PYTHONPATH": os.pathsep.join([{str(tmp_path)!r}, *sys.path])}}
proc = subprocess.Popen([sys.executable, "-m", "ncclkv.demo._engine_child", str(child_sock.fileno())],
                        pass_fds=(child_sock.fileno(),), start_new_session=True, env=env,
                        stdout=open({str(log)!r}, "wb"), stderr=subprocess.STDOUT)
child_sock.close()
conn = Connection(parent_sock.detach())  # kept: its end stays open while the parent lives
conn.send(("start", {{}}))
print(proc.pid, flush=True)
time.sleep(120)
"""
    parent = subprocess.Popen([sys.executable, "-c", parent_code], stdout=subprocess.PIPE, start_new_session=True)
    engine_pid = None
    try:
        assert parent.stdout is not None
        engine_pid = int(parent.stdout.readline())
        deadline = time.monotonic() + WAIT_S
        while "importing" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)  # the child's own line says its main thread is now held
        assert "importing" in log.read_text(), log.read_text()
        os.kill(parent.pid, signal.SIGKILL)
        assert parent.wait(timeout=WAIT_S) == -signal.SIGKILL
        assert _wait_gone(engine_pid, time.monotonic() + WAIT_S), "the engine child outlived its killed parent"
        assert "the parent is gone" in log.read_text()
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(timeout=WAIT_S)
        if engine_pid is not None and _alive(engine_pid):
            os.killpg(engine_pid, signal.SIGKILL)


def test_engine_child_ends_on_sigterm(tmp_path) -> None:
    """EngineProcess.launch starts the child inside signals_deferred() (no child without its handle kept), and a
    child keeps its parent's signal mask across exec: the engine child, and every vLLM worker it spawned, ran
    with SIGINT and SIGTERM blocked (vLLM's shutdown terminates its workers with SIGTERM; kill PID did nothing).
    A stand-in vLLM holds the child's main thread in ``import vllm``."""
    from ncclkv.demo._engine_proc import EngineOptions, EngineProcess

    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text("import time\nprint('importing', flush=True)\ntime.sleep(120)\n")
    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(__import__("ncclkv").__file__)))
    options = EngineOptions(model_dir=tmp_path, extra_env={"PYTHONPATH": os.pathsep.join([str(tmp_path), package_parent])})
    log = tmp_path / "engine.log"
    engine = EngineProcess(options, log)
    engine.launch()
    try:
        deadline = time.monotonic() + WAIT_S
        while "importing" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)  # the child's own line says its main thread is now held
        assert "importing" in log.read_text(), log.read_text()
        assert engine._proc is not None
        os.kill(engine._proc.pid, signal.SIGTERM)
        try:
            code = engine._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            code = None
        assert code == -signal.SIGTERM, f"the engine child ignored SIGTERM (exit {code})"
    finally:
        engine.close(timeout_s=0)

"""``ncclkv demo`` stopped by a signal, or by an engine failing to start, and a bad ``--log-dir`` (no real vLLM).

A stand-in ``vllm`` package (written per test, first on PYTHONPATH) makes
``LLM()`` block for minutes with SIGINT and SIGTERM ignored, or exit at once
for one role: the demo's process harness is the real one, only the engine
inside each child is fake. While it blocks, it records each "close" its parent
sends (and obeys none), so a test can act once the closing has begun. Every
process a test starts carries a marker in its environment, so "no process
left behind" is checked by scanning /proc.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import suppress
from pathlib import Path

import pytest

from ncclkv._signals import Stopped, signals_deferred, stop_on_signals
from ncclkv._vllm_model import MARKER_FILE
from ncclkv.cli import main
from ncclkv.demo import DEMO_SPEC, EngineError, EngineOptions, EngineProcess
from ncclkv.demo._pd import _ABORT_S

pytestmark = pytest.mark.multiprocess

FAKE_VLLM = '''
import os, pathlib, signal, sys, threading, time
from multiprocessing.connection import Connection

def _record_close():  # the parent's messages (the main thread stays in LLM()): each "close" is noted, not obeyed
    conn = Connection(os.dup(int(sys.argv[1])))  # python -m ncclkv.demo._engine_child FD
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg[0] == "close":
            pathlib.Path(os.environ["FAKE_VLLM_CLOSING"], str(os.getpid())).touch()

class LLM:  # builds "forever" and ignores polite signals, as a busy engine would; FAKE_VLLM_DIE's role dies
    def __init__(self, **kwargs):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        role = (kwargs.get("kv_transfer_config") or {}).get("kv_role", "single")
        if role == os.environ.get("FAKE_VLLM_DIE"):
            os._exit(3)
        threading.Thread(target=_record_close, daemon=True).start()
        pathlib.Path(os.environ["FAKE_VLLM_BUILDING"], str(os.getpid())).touch()
        time.sleep(600)
'''

# A stand-in for each rank ``ncclkv demo --transport-only`` starts (a sitecustomize, so it runs before the
# scenario): it notes that it runs, then stays, deaf to SIGTERM and SIGINT, until it is killed.
FAKE_RANK = '''
import os, pathlib, signal, time

if os.environ.get("FAKE_RANK_RUNNING") and "RANK" in os.environ:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    pathlib.Path(os.environ["FAKE_RANK_RUNNING"], f"{os.environ['RANK']}.{os.getpid()}").touch()
    time.sleep(600)
    os._exit(1)
'''


@pytest.fixture
def fake_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    """The environment of a process that gets the stand-in vLLM; on exit, no process marked with it may live."""
    (tmp_path / "fake" / "vllm").mkdir(parents=True)
    (tmp_path / "fake" / "vllm" / "__init__.py").write_text(FAKE_VLLM)
    (tmp_path / "tmp").mkdir()
    (tmp_path / "building").mkdir()
    (tmp_path / "closing").mkdir()
    marker = uuid.uuid4().hex
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "fake"), "TMPDIR": str(tmp_path / "tmp"),
           "NCCLKV_TEST_MARK": marker, "FAKE_VLLM_BUILDING": str(tmp_path / "building"),
           "FAKE_VLLM_CLOSING": str(tmp_path / "closing")}
    for name in ("PYTHONPATH", "NCCLKV_TEST_MARK", "FAKE_VLLM_BUILDING", "FAKE_VLLM_CLOSING"):
        monkeypatch.setenv(name, env[name])  # the engines close_all's tests start here are marked too
    yield env
    left = _marked(marker)
    for pid in left:  # do not leak them into the next tests, then fail
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert left == [], f"processes left behind: {left}"


def _marked(marker: str) -> list[int]:
    """Live (not zombie) processes whose environment holds ``NCCLKV_TEST_MARK=marker``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if f"NCCLKV_TEST_MARK={marker}".encode() not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            if (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def _model_dir(tmp_path: Path) -> Path:
    """A model directory the demo takes as already built (the stand-in engines never read it)."""
    model = tmp_path / "model"
    model.mkdir()
    (model / MARKER_FILE).write_text(DEMO_SPEC.to_json())
    return model


def _wait_for(predicate: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.02)


def _closing(env: dict[str, str]) -> list[str]:
    """The stand-in engines that received "close" (pids)."""
    return os.listdir(env["FAKE_VLLM_CLOSING"])


def _on_first_close(env: dict[str, str], action: Callable[[], None], cancel: threading.Event,
                    timeout_s: float = 30) -> threading.Thread:
    """A started thread that calls ``action`` once a stand-in engine received "close"; not if none did within
    ``timeout_s`` or ``cancel`` was set first."""
    def watch() -> None:
        deadline = time.monotonic() + timeout_s
        while not _closing(env):
            if cancel.wait(0.02) or time.monotonic() > deadline:
                return
        if not cancel.is_set():
            action()
    thread = threading.Thread(target=watch, name="test-on-first-close", daemon=True)
    thread.start()
    return thread


def _wait_building(env: dict[str, str], count: int) -> None:
    """Until ``count`` stand-in engines are inside ``LLM()``, deaf to "close"."""
    _wait_for(lambda: len(os.listdir(env["FAKE_VLLM_BUILDING"])) >= count, 30)


def _demo(tmp_path: Path, env: dict[str, str], *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "ncclkv.cli", "demo", "--quick", "--plain", "--timeout", "300",
                             "--model-dir", str(_model_dir(tmp_path)), *extra],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen[str], timeout_s: float) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        try:
            out, err = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:  # a child holds its pipes open: what was read is lost
            out, err = "(output not read: a child still holds the pipes)", ""
        pytest.fail(f"ncclkv demo still running {timeout_s} s later\n{out}\n{err}")
    return proc.returncode, out, err


# ------------------------------------------------------------------ close_all

def _launch(tmp_path: Path, env: dict[str, str], count: int) -> list[EngineProcess]:
    engines = [EngineProcess(EngineOptions(model_dir=tmp_path), tmp_path / f"e{i}.log", name=f"e{i}")
               for i in range(count)]
    for engine in engines:
        engine.launch()
    _wait_building(env, count)
    return engines


@pytest.mark.timeout(60)
def test_close_all_waits_once_for_all_then_kills(tmp_path: Path, fake_env: dict[str, str]) -> None:
    from ncclkv.demo import close_all

    engines = _launch(tmp_path, fake_env, 3)
    pids = [engine.pid for engine in engines]
    started = time.monotonic()
    close_all(engines, timeout_s=2.0)
    assert time.monotonic() - started < 5.0  # one shared deadline, not 2 s per engine
    assert all(engine.pid is None for engine in engines) and not set(pids) & set(_marked(fake_env["NCCLKV_TEST_MARK"]))


@pytest.mark.timeout(60)
def test_ctrl_c_while_closing_still_kills_every_engine(tmp_path: Path, fake_env: dict[str, str]) -> None:
    from ncclkv.demo import close_all

    engines = _launch(tmp_path, fake_env, 2)
    # Python's own Ctrl-C handler: an earlier test in this process (vLLM's, in tests/connector) may have
    # installed another, under which SIGINT raised nothing (fresh-clone CI).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    cancel = threading.Event()
    try:
        # Ctrl-C once close_all is closing: an engine received its "close" (and, deaf, stays).
        watcher = _on_first_close(fake_env, lambda: os.kill(os.getpid(), signal.SIGINT), cancel)
        started = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            close_all(engines, timeout_s=30.0)
    finally:
        cancel.set()  # no Ctrl-C after this test
        watcher.join(10)
        signal.signal(signal.SIGINT, previous)
    assert not watcher.is_alive() and _closing(fake_env)  # it landed while close_all waited for the engines
    assert time.monotonic() - started < 10.0
    assert _marked(fake_env["NCCLKV_TEST_MARK"]) == []


# ------------------------------------------------------------------ stop_on_signals

def test_only_the_first_signal_stops_and_later_ones_do_not_cut_the_clean_up_short() -> None:
    before = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    cleaned_up = []
    with pytest.raises(Stopped) as stopped:
        with stop_on_signals():
            try:
                signal.raise_signal(signal.SIGINT)  # runs the handler before it returns: Stopped from here
            finally:  # the clean-up, hit by a second Ctrl-C and a SIGTERM
                signal.raise_signal(signal.SIGINT)
                signal.raise_signal(signal.SIGTERM)
                cleaned_up.append(True)
    assert cleaned_up == [True]
    assert stopped.value.signum == signal.SIGINT and stopped.value.__context__ is None  # the first one only
    assert {signum: signal.getsignal(signum) for signum in before} == before  # the previous handlers are back


def test_signals_deferred_holds_a_stop_back_while_another_thread_could_take_the_signal() -> None:
    """The mask blocks the signals on this thread only: with another thread running (rich's spinner thread while the
    demo launches its engines), the kernel hands a SIGTERM to that thread, and Python ran the handler on the main
    thread at once, inside the block: Stopped between a child's fork and its handle being kept."""
    before = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    ends = threading.Event()
    other = threading.Thread(target=ends.wait, name="other-thread", daemon=True)  # its mask lets both signals in
    other.start()
    seen: list[str] = []
    try:
        with pytest.raises(Stopped) as stopped:
            with stop_on_signals(), signals_deferred():
                os.kill(os.getpid(), signal.SIGTERM)  # process-directed: this thread blocks it, the other does not
                deadline = time.monotonic() + 0.5
                while time.monotonic() < deadline:  # bytecode running: where a handler would run
                    time.sleep(0.001)
                seen.append("block ended")
    finally:
        ends.set()
        other.join(5)
    assert seen == ["block ended"]  # the signal waited for the block's end ...
    assert stopped.value.signum == signal.SIGTERM  # ... and then stopped as usual
    assert {signum: signal.getsignal(signum) for signum in before} == before  # the handlers are back
    assert not set(signal.pthread_sigmask(signal.SIG_BLOCK, [])) & {signal.SIGINT, signal.SIGTERM}  # and the mask


def test_signals_deferred_delivers_every_signal_it_held_back_even_when_a_handler_raises() -> None:
    """SIGINT and SIGTERM both held back while another thread could take them: at the block's end each is delivered
    to its handler. They were raised again one by one, and SIGINT's KeyboardInterrupt left the loop before SIGTERM's
    turn: the SIGTERM was lost (its handler never ran; with SIG_DFL the process lived on)."""
    before = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    ends = threading.Event()
    other = threading.Thread(target=ends.wait, name="other-thread", daemon=True)  # its mask lets both signals in
    other.start()
    seen: list[str] = []
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda signum, frame: seen.append("SIGTERM handled"))
    try:
        with pytest.raises(KeyboardInterrupt):
            with signals_deferred():
                os.kill(os.getpid(), signal.SIGINT)
                os.kill(os.getpid(), signal.SIGTERM)
                deadline = time.monotonic() + 0.5
                while time.monotonic() < deadline:  # bytecode running: where a handler would run
                    time.sleep(0.001)
                seen.append("block ended")
        deadline = time.monotonic() + 2.0
        while "SIGTERM handled" not in seen and time.monotonic() < deadline:
            time.sleep(0.001)
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)
        ends.set()
        other.join(5)
    assert seen == ["block ended", "SIGTERM handled"]
    assert not set(signal.pthread_sigmask(signal.SIG_BLOCK, [])) & {signal.SIGINT, signal.SIGTERM}


# ------------------------------------------------------------------ the command

@pytest.mark.timeout(90)
@pytest.mark.parametrize(("signum", "code", "times"), [(signal.SIGINT, 130, 1), (signal.SIGINT, 130, 2),
                                                       (signal.SIGTERM, 143, 1)])
def test_a_signal_stops_every_engine_and_removes_the_temp_folder(tmp_path: Path, fake_env: dict[str, str],
                                                                  signum: int, code: int, times: int) -> None:
    proc = _demo(tmp_path, fake_env)
    _wait_building(fake_env, 3)
    signalled = time.monotonic()
    os.kill(proc.pid, signum)  # the command only: the engines are in their own sessions
    if times == 2:  # a second one once the engines are being closed: an engine received "close"
        _wait_for(lambda: bool(_closing(fake_env)) or proc.poll() is not None, 20)
        assert proc.poll() is None, "the demo ended before any engine was asked to close"
        os.kill(proc.pid, signum)
    rc, out, err = _finish(proc, 20)
    elapsed = time.monotonic() - signalled
    assert elapsed < 12.0, err
    if times == 2:  # ignored: the engines still got their whole grace before the kill, not cut short
        assert elapsed >= _ABORT_S, f"the second {signal.Signals(signum).name} cut the close short ({elapsed:.1f} s)"
    assert rc == code and "Traceback" not in err, err
    assert f"stopped by {signal.Signals(signum).name}" in err
    assert list((tmp_path / "tmp").iterdir()) == []  # the temporary log folder is gone


@pytest.mark.timeout(60)
def test_a_signal_names_a_log_dir_that_was_given(tmp_path: Path, fake_env: dict[str, str]) -> None:
    proc = _demo(tmp_path, fake_env, "--log-dir", str(tmp_path / "logs"))
    _wait_building(fake_env, 3)
    os.kill(proc.pid, signal.SIGINT)
    rc, _, err = _finish(proc, 20)
    assert rc == 130 and f"engine logs: {tmp_path / 'logs'}" in err and (tmp_path / "logs" / "decode.log").exists()


@pytest.mark.timeout(60)
def test_an_engine_failing_at_start_up_ends_the_run_promptly(tmp_path: Path, fake_env: dict[str, str]) -> None:
    started = time.monotonic()
    rc, _, err = _finish(_demo(tmp_path, {**fake_env, "FAKE_VLLM_DIE": "kv_consumer"}), 30)
    assert rc == 1 and time.monotonic() - started < 20.0, err
    assert "ncclkv demo: EngineError: decode engine " in err and "engine logs: " in err
    assert "Traceback" not in err


@pytest.mark.timeout(90)
def test_transport_only_sigterm_leaves_no_folder_and_no_rank(tmp_path: Path, fake_env: dict[str, str]) -> None:
    (tmp_path / "rank").mkdir()
    (tmp_path / "rank" / "sitecustomize.py").write_text(FAKE_RANK)
    running = tmp_path / "running"
    running.mkdir()
    env = {key: value for key, value in fake_env.items() if key != "RANK"}  # the command is no rank
    env.update(PYTHONPATH=os.pathsep.join([str(tmp_path / "rank"), env["PYTHONPATH"]]), FAKE_RANK_RUNNING=str(running))
    proc = subprocess.Popen([sys.executable, "-m", "ncclkv.cli", "demo", "--transport-only", "--timeout", "60"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # Every rank of the first run is up (and stays, deaf to SIGTERM, until killed).
    _wait_for(lambda: len(os.listdir(running)) >= 4 or proc.poll() is not None, 30)
    started = sorted(name.split(".") for name in os.listdir(running))
    assert [rank for rank, _ in started] == ["0", "1", "2", "3"], (proc.poll(), started)
    ranks = [int(pid) for _, pid in started]
    os.kill(proc.pid, signal.SIGTERM)
    rc, _, err = _finish(proc, 20)
    assert rc == 143 and "stopped by SIGTERM" in err, err
    assert list((tmp_path / "tmp").iterdir()) == []
    assert not set(ranks) & set(_marked(fake_env["NCCLKV_TEST_MARK"]))  # killed, and reaped


# ------------------------------------------------------------------ --log-dir

@pytest.mark.parametrize(("where", "needle"), [("file", "(File exists)"), ("file/sub", "(Not a directory)")])
def test_a_bad_log_dir_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str], where: str,
                                        needle: str) -> None:
    (tmp_path / "file").write_text("")
    assert main(["demo", "--log-dir", str(tmp_path / where)]) == 2
    err = capsys.readouterr().err
    assert err == f"ncclkv demo: error: --log-dir {tmp_path / where}: cannot create {tmp_path / where} {needle}\n"


# ------------------------------------------------------------------ the harness's waits

# A stand-in vLLM that builds at once and answers ``generate`` (each prompt's output: its first ``max_tokens``
# ids), enough for the engine child's own ``_generate``.
ANSWERING_VLLM = '''
from types import SimpleNamespace

class SamplingParams:
    def __init__(self, *, max_tokens, **others):
        self.max_tokens = max_tokens

class LLM:
    def __init__(self, **kwargs):
        pass

    def generate(self, prompts, sampling_params, use_tqdm):
        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=list(p)[:s.max_tokens], finish_reason="length")],
                                kv_transfer_params=None, num_cached_tokens=0, metrics=None)
                for p, s in zip(prompts, sampling_params)]
'''


def _answering_engine(tmp_path: Path) -> EngineProcess:
    fake = tmp_path / "answering"
    (fake / "vllm").mkdir(parents=True)
    (fake / "vllm" / "__init__.py").write_text(ANSWERING_VLLM)
    (fake / "vllm" / "inputs.py").write_text("def TokensPrompt(prompt_token_ids):\n    return prompt_token_ids\n")
    package_parent = Path(__import__("ncclkv").__file__).resolve().parents[1]
    options = EngineOptions(model_dir=tmp_path, extra_env={"PYTHONPATH": os.pathsep.join([str(fake),
                                                                                         str(package_parent)])})
    return EngineProcess(options, tmp_path / "engine.log", name="answering engine")


@pytest.mark.timeout(60)
def test_the_longest_timeout_accepted_is_a_wait_that_works(tmp_path: Path) -> None:
    """``ncclkv demo --timeout`` takes up to MAX_TIMEOUT_S (check_timeout) and hands it to every engine wait; a
    Connection.poll of more than about 24 days (select.poll's int of milliseconds) raised OverflowError: the demo
    built its engines, then died in a traceback at its first generate."""
    from ncclkv._timeout import MAX_TIMEOUT_S

    engine = _answering_engine(tmp_path)
    try:
        assert engine.start(timeout_s=MAX_TIMEOUT_S) >= 0
        results = engine.generate([[5, 6, 7], [8, 9]], max_tokens=2, timeout_s=MAX_TIMEOUT_S)
        assert [r.token_ids for r in results] == [(5, 6), (8, 9)]
    finally:
        engine.close(timeout_s=10)
    assert engine.pid is None


@pytest.mark.timeout(60)
def test_transport_only_names_its_deadline_when_ranks_outlive_it(tmp_path: Path, fake_env: dict[str, str]) -> None:
    """Ranks still running at --timeout are killed (exit 124, as timeout(1)); the demo said only 'run 1 failed
    with exit code 124', never that its deadline had passed nor which flag sets it."""
    (tmp_path / "rank").mkdir()
    (tmp_path / "rank" / "sitecustomize.py").write_text(FAKE_RANK)
    running = tmp_path / "running"
    running.mkdir()
    env = {key: value for key, value in fake_env.items() if key != "RANK"}
    env.update(PYTHONPATH=os.pathsep.join([str(tmp_path / "rank"), env["PYTHONPATH"]]), FAKE_RANK_RUNNING=str(running))
    proc = subprocess.Popen([sys.executable, "-m", "ncclkv.cli", "demo", "--transport-only", "--timeout", "3"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    rc, _, err = _finish(proc, 30)
    assert rc == 1 and "run 1 failed with exit code 124" in err, err
    assert "did not end within --timeout 3 s" in err, err


@pytest.mark.timeout(60)
def test_engines_not_built_by_the_timeout_fail_naming_it(tmp_path: Path, fake_env: dict[str, str]) -> None:
    """Engines still building at --timeout end the run naming that timeout; the error said "no 'ready' within
    0 s" (the 0.1 s of the last look, rounded), whatever --timeout was."""
    proc = subprocess.Popen([sys.executable, "-m", "ncclkv.cli", "demo", "--quick", "--plain", "--timeout", "4",
                             "--model-dir", str(_model_dir(tmp_path))],
                            env=fake_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    rc, _, err = _finish(proc, 30)
    assert rc == 1 and "ncclkv demo: EngineError: prefill engine " in err, err
    assert "not built within 4 s" in err and "within 0 s" not in err, err


# ------------------------------------------------------------------ how the engines end

# A stand-in vLLM that answers everything ``ncclkv demo`` asks (outputs: each prompt's first ``max_tokens`` ids;
# the decode engine counts every prompt token's KV bytes as received), so the demo passes its checks; the engine
# of role FAKE_VLLM_AT_EXIT_ROLE then ends badly once asked to close: FAKE_VLLM_AT_EXIT "code" exits 7, "signal"
# kills itself (SIGKILL), "hang" never exits (a thread that does not end).
DEMO_VLLM = {
    "__init__.py": '''
import atexit, json, os, signal, subprocess, sys, threading, time
from types import SimpleNamespace
from vllm.v1.metrics.reader import Counter

BYTES_PER_TOKEN = 4096  # the demo's tiny Llama: 2 layers x 4 kv-heads x (K, V) x 64 x float32

class SamplingParams:
    def __init__(self, *, max_tokens, extra_args=None, **others):
        self.max_tokens, self.extra_args = max_tokens, extra_args or {}

class LLM:
    def __init__(self, **kwargs):
        config = kwargs.get("kv_transfer_config") or {}
        self.role = config.get("kv_role", "single")
        ref_path = (config.get("kv_connector_extra_config") or {}).get("ref_path")
        if ref_path:
            with open(ref_path, "w") as ref:
                json.dump({"engine_id": "fake"}, ref)
        self.received = 0
        record = os.environ.get("FAKE_VLLM_RECORD")  # what each engine got, and whether the single one started
        if record:                                  # while the prefill one built (it waits up to 2 s to see)
            info = {"gpu": os.environ.get("CUDA_VISIBLE_DEVICES"), "util": kwargs.get("gpu_memory_utilization")}
            open(os.path.join(record, self.role + ".started"), "w").close()
            if self.role == "kv_producer":
                deadline = time.monotonic() + 2.0
                while not os.path.exists(os.path.join(record, "single.started")) and time.monotonic() < deadline:
                    time.sleep(0.01)
                info["single_started_meanwhile"] = os.path.exists(os.path.join(record, "single.started"))
            with open(os.path.join(record, self.role + ".json"), "w") as out:
                json.dump(info, out)
        if os.environ.get("FAKE_VLLM_WORKER"):  # a worker process in the engine's session, as vLLM's TP workers
            self.worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        scheduler = SimpleNamespace(has_requests=lambda: False, requests={})
        self.llm_engine = SimpleNamespace(engine_core=SimpleNamespace(engine_core=SimpleNamespace(scheduler=scheduler)))
        if self.role == os.environ.get("FAKE_VLLM_AT_EXIT_ROLE"):
            how = os.environ["FAKE_VLLM_AT_EXIT"]
            if how == "code":
                atexit.register(os._exit, 7)
            elif how == "signal":
                atexit.register(lambda: os.kill(os.getpid(), signal.SIGKILL))
            elif how == "hang":
                threading.Thread(target=time.sleep, args=(600,)).start()

    def generate(self, prompts, sampling_params, use_tqdm):
        if os.environ.get("FAKE_VLLM_GENERATE_DIES") == self.role:  # a crash inside vLLM, no word in the log
            os.kill(os.getpid(), signal.SIGKILL)
        outputs = []
        for prompt, sampling in zip(prompts, sampling_params):
            params = sampling.extra_args.get("kv_transfer_params")
            if params and self.role == "kv_consumer":
                self.received += len(prompt) * BYTES_PER_TOKEN
            stats = SimpleNamespace(first_token_ts=1.0, first_token_latency=0.01, scheduled_ts=2.0, queued_ts=1.99)
            outputs.append(SimpleNamespace(
                outputs=[SimpleNamespace(token_ids=list(prompt)[:sampling.max_tokens], finish_reason="length")],
                kv_transfer_params={"remote": True} if params and self.role == "kv_producer" else None,
                num_cached_tokens=0, metrics=stats))
        return outputs

    def get_metrics(self):
        return [Counter("vllm:ncclkv_bytes_received", self.received)]
''',
    "inputs.py": "def TokensPrompt(prompt_token_ids):\n    return prompt_token_ids\n",
    "v1/__init__.py": "",
    "v1/metrics/__init__.py": "",
    "v1/metrics/reader.py": '''
class Counter:
    def __init__(self, name, value):
        self.name, self.value = name, value

class Gauge(Counter):
    pass

class Histogram:
    pass
''',
}


@pytest.fixture
def demo_env(tmp_path: Path, fake_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """``fake_env`` with the answering stand-in vLLM (DEMO_VLLM) first on PYTHONPATH."""
    fake = tmp_path / "demo_vllm"
    for name, text in DEMO_VLLM.items():
        (fake / "vllm" / name).parent.mkdir(parents=True, exist_ok=True)
        (fake / "vllm" / name).write_text(text)
    monkeypatch.setenv("PYTHONPATH", str(fake))
    return {**fake_env, "PYTHONPATH": str(fake)}


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("how", "ended"), [
    (None, None),
    ("code", "exited with code 7 once asked to close"),
    ("signal", "was killed by SIGKILL once asked to close"),
    ("hang", "did not exit within 2 s of being asked to close and was killed"),
])
def test_close_all_says_how_each_engine_that_did_not_end_cleanly_ended(
        tmp_path: Path, demo_env: dict[str, str], monkeypatch: pytest.MonkeyPatch, how: str | None,
        ended: str | None) -> None:
    """close_all killed and reaped every child but said nothing of how they had ended: an engine that crashed or
    hung in its shutdown looked like one that exited 0."""
    from ncclkv.demo import close_all

    if how is not None:
        monkeypatch.setenv("FAKE_VLLM_AT_EXIT", how)
        monkeypatch.setenv("FAKE_VLLM_AT_EXIT_ROLE", "single")
    engines = [EngineProcess(EngineOptions(model_dir=tmp_path, kv_transfer_config=config), tmp_path / f"e{i}.log",
                             name=f"engine {i}") for i, config in enumerate(({"kv_role": "kv_producer"}, None))]
    for engine in engines:
        engine.start(timeout_s=30)
    assert close_all(engines, timeout_s=2.0) == ([] if ended is None else [f"engine 1 {ended}"])
    assert all(engine.pid is None for engine in engines)


@pytest.mark.timeout(90)
@pytest.mark.parametrize(("how", "ended"), [
    (None, None),
    ("code", "the decode engine exited with code 7 once asked to close"),
    ("signal", "the decode engine was killed by SIGKILL once asked to close"),
])
def test_an_engine_ending_badly_at_shutdown_fails_the_demo(tmp_path: Path, demo_env: dict[str, str],
                                                           how: str | None, ended: str | None) -> None:
    """Every check passed, then the decode engine crashed (or exited non-zero) as it closed: the demo printed OK
    and exited 0, never saying so."""
    env = dict(demo_env) if how is None else {**demo_env, "FAKE_VLLM_AT_EXIT": how,
                                              "FAKE_VLLM_AT_EXIT_ROLE": "kv_consumer"}
    rc, out, err = _finish(_demo(tmp_path, env), 60)
    if ended is None:
        assert rc == 0 and "OK: every output equals the single engine's" in out and "FAILED" not in err, (out, err)
    else:  # the shutdown is the only problem: every other check passed
        assert rc == 1 and f"ncclkv demo: FAILED\n  at shutdown: {ended}\nengine logs: " in err, (out, err)


# ------------------------------------------------------------------ GPUs

def _demo_in_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gpus: tuple[str, ...]) -> int:
    """``ncclkv demo --quick`` in this process, its engines' children on the stand-in vLLM, as if torch saw
    ``gpus`` (CUDA_VISIBLE_DEVICES entries)."""
    import ncclkv.demo

    monkeypatch.syspath_prepend(os.environ["PYTHONPATH"])  # `vllm` is found (the stand-in; never imported here)
    monkeypatch.setattr(ncclkv.demo, "gpus_here", lambda: gpus, raising=False)
    return main(["demo", "--quick", "--plain", "--timeout", "60", "--model-dir", str(_model_dir(tmp_path)),
                 "--log-dir", str(tmp_path / "logs")])


@pytest.mark.timeout(90)
def test_two_gpus_give_prefill_and_decode_their_own_and_the_single_engine_builds_after_the_prefill(
        tmp_path: Path, demo_env: dict[str, str], monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """On a GPU machine every engine took the first visible GPU with vLLM's default gpu_memory_utilization
    (0.9 of its memory each) and all three built at once: the second could not get its memory, and a prefill
    and a decode engine on one GPU cannot link over NCCL anyway."""
    import json

    record = tmp_path / "record"
    record.mkdir()
    monkeypatch.setenv("FAKE_VLLM_RECORD", str(record))
    assert _demo_in_process(tmp_path, monkeypatch, ("4", "6")) == 0, capsys.readouterr()
    got = {role: json.loads((record / f"{role}.json").read_text()) for role in ("kv_producer", "kv_consumer", "single")}
    assert got == {"kv_producer": {"gpu": "4", "util": 0.4, "single_started_meanwhile": False},
                   "kv_consumer": {"gpu": "6", "util": None}, "single": {"gpu": "4", "util": 0.4}}
    assert "prefill engine (core " in capsys.readouterr().out


@pytest.mark.timeout(60)
def test_one_gpu_is_refused_naming_the_count_before_any_engine_starts(
        tmp_path: Path, demo_env: dict[str, str], monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    record = tmp_path / "record"
    record.mkdir()
    monkeypatch.setenv("FAKE_VLLM_RECORD", str(record))
    assert _demo_in_process(tmp_path, monkeypatch, ("0",)) == 2
    err = capsys.readouterr().err
    assert err.startswith("ncclkv demo: ncclkv demo with vLLM on GPUs needs 2 of them") and "sees 1" in err, err
    assert list(record.iterdir()) == []  # no engine started


@pytest.mark.timeout(60)
def test_an_engine_that_dies_mid_request_is_reported_with_how_it_ended(
        tmp_path: Path, demo_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine killed by a signal while generating (a crash that writes nothing to its log) was reported only as
    "died while waiting for 'result'": its exit status, the one clue, was reaped and dropped."""
    from ncclkv.demo import EngineError

    monkeypatch.setenv("FAKE_VLLM_GENERATE_DIES", "single")
    engine = EngineProcess(EngineOptions(model_dir=tmp_path), tmp_path / "engine.log", name="single engine")
    engine.start(timeout_s=30)
    with pytest.raises(EngineError, match=r"^single engine died while waiting for 'result' \(killed by SIGKILL\)\n"):
        engine.generate([[5, 6, 7]], max_tokens=2, timeout_s=30)
    assert engine.pid is None


@pytest.mark.timeout(60)
@pytest.mark.parametrize("when", ["mid-request", "at shutdown"])
def test_an_engine_that_ends_by_itself_leaves_no_worker_behind(
        tmp_path: Path, demo_env: dict[str, str], monkeypatch: pytest.MonkeyPatch, when: str) -> None:
    """The engine child leads its own session so that the kill reaches every worker it spawned; but the group was
    killed only while the child itself still ran: one that had ended by itself (killed mid-request, waited for
    to name how it ended; or crashing as it closed) was reaped and its workers were left running."""
    monkeypatch.setenv("FAKE_VLLM_WORKER", "1")
    if when == "mid-request":
        monkeypatch.setenv("FAKE_VLLM_GENERATE_DIES", "single")
    else:
        monkeypatch.setenv("FAKE_VLLM_AT_EXIT", "signal")
        monkeypatch.setenv("FAKE_VLLM_AT_EXIT_ROLE", "single")
    marker = demo_env["NCCLKV_TEST_MARK"]
    engine = EngineProcess(EngineOptions(model_dir=tmp_path), tmp_path / "engine.log", name="single engine")
    engine.start(timeout_s=30)
    child = engine.pid
    _wait_for(lambda: len(_marked(marker)) == 2, 30)  # the child and its worker
    if when == "mid-request":
        with pytest.raises(EngineError, match=r"^single engine died while waiting for 'result' \(killed by SIGKILL\)"):
            engine.generate([[5, 6, 7]], max_tokens=2, timeout_s=30)
    else:
        assert engine.close(timeout_s=10) == ["single engine was killed by SIGKILL once asked to close"]
    assert engine.pid is None
    deadline = time.monotonic() + 10.0  # the worker is no child of ours to wait for: its SIGKILL lands by itself
    while (left := _marked(marker)) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert left == [], f"left behind by engine child {child}: {left}"

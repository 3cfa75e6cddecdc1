"""``ncclkv demo`` stopped by a signal, or by an engine failing to start, and a bad ``--log-dir`` (no real vLLM).

A stand-in ``vllm`` package (written per test, first on PYTHONPATH) makes
``LLM()`` block for minutes with SIGINT and SIGTERM ignored, or exit at once
for one role: the demo's process harness is the real one, only the engine
inside each child is fake. Every process a test starts carries a marker in
its environment, so "no process left behind" is checked by scanning /proc.
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

from ncclkv._vllm_model import MARKER_FILE
from ncclkv.cli import main
from ncclkv.demo import DEMO_SPEC, EngineOptions, EngineProcess

pytestmark = pytest.mark.multiprocess

FAKE_VLLM = '''
import os, pathlib, signal, time

class LLM:  # builds "forever" and ignores polite signals, as a busy engine would; FAKE_VLLM_DIE's role dies
    def __init__(self, **kwargs):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        role = (kwargs.get("kv_transfer_config") or {}).get("kv_role", "single")
        if role == os.environ.get("FAKE_VLLM_DIE"):
            os._exit(3)
        pathlib.Path(os.environ["FAKE_VLLM_BUILDING"], str(os.getpid())).touch()
        time.sleep(600)
'''


@pytest.fixture
def fake_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    """The environment of a process that gets the stand-in vLLM; on exit, no process marked with it may live."""
    (tmp_path / "fake" / "vllm").mkdir(parents=True)
    (tmp_path / "fake" / "vllm" / "__init__.py").write_text(FAKE_VLLM)
    (tmp_path / "tmp").mkdir()
    (tmp_path / "building").mkdir()
    marker = uuid.uuid4().hex
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "fake"), "TMPDIR": str(tmp_path / "tmp"),
           "NCCLKV_TEST_MARK": marker, "FAKE_VLLM_BUILDING": str(tmp_path / "building")}
    for name in ("PYTHONPATH", "NCCLKV_TEST_MARK", "FAKE_VLLM_BUILDING"):
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
        time.sleep(0.1)


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
        out, err = proc.communicate()
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
    try:
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
        started = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            close_all(engines, timeout_s=30.0)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert time.monotonic() - started < 10.0
    assert _marked(fake_env["NCCLKV_TEST_MARK"]) == []


# ------------------------------------------------------------------ the command

@pytest.mark.timeout(90)
@pytest.mark.parametrize(("signum", "code", "times"), [(signal.SIGINT, 130, 1), (signal.SIGINT, 130, 2),
                                                       (signal.SIGTERM, 143, 1)])
def test_a_signal_stops_every_engine_and_removes_the_temp_folder(tmp_path: Path, fake_env: dict[str, str],
                                                                  signum: int, code: int, times: int) -> None:
    proc = _demo(tmp_path, fake_env)
    _wait_building(fake_env, 3)
    signalled = time.monotonic()
    for _ in range(times):  # a second Ctrl-C lands while the engines are being closed
        os.kill(proc.pid, signum)  # the command only: the engines are in their own sessions
        time.sleep(1.0)
    rc, out, err = _finish(proc, 20)
    assert time.monotonic() - signalled < 12.0, err
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
    proc = subprocess.Popen([sys.executable, "-m", "ncclkv.cli", "demo", "--transport-only", "--timeout", "60"],
                            env=fake_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for(lambda: len(_marked(fake_env["NCCLKV_TEST_MARK"])) >= 5, 30)  # the command and its four ranks
    time.sleep(1.0)
    os.kill(proc.pid, signal.SIGTERM)
    rc, _, err = _finish(proc, 20)
    assert rc == 143 and "stopped by SIGTERM" in err, err
    assert list((tmp_path / "tmp").iterdir()) == []


# ------------------------------------------------------------------ --log-dir

@pytest.mark.parametrize(("where", "needle"), [("file", "(File exists)"), ("file/sub", "(Not a directory)")])
def test_a_bad_log_dir_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str], where: str,
                                        needle: str) -> None:
    (tmp_path / "file").write_text("")
    assert main(["demo", "--log-dir", str(tmp_path / where)]) == 2
    err = capsys.readouterr().err
    assert err == f"ncclkv demo: error: --log-dir {tmp_path / where}: cannot create {tmp_path / where} {needle}\n"

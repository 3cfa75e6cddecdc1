"""Lifecycle tests of NcclKVConnector: skipped (with the reason) where vLLM is not installed.

Only its absence skips them (each test module is then skipped, not imported; tests/strict_skips.py):
an installed vLLM that fails to import is a broken component, and its import error fails here."""

from __future__ import annotations

import importlib.util
import os
import threading
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from ncclkv._vllm_model import TinyLlamaSpec, build_tiny_llama

_VLLM_ABSENT = importlib.util.find_spec("vllm") is None

if _VLLM_ABSENT:
    class _WithoutVllm(pytest.Module):
        """A test module of this folder on a machine without vLLM: skipped, never imported (it imports vLLM)."""

        def collect(self) -> Any:
            pytest.skip("vLLM is not installed: the connector lifecycle tests drive vLLM's own scheduler")

    def pytest_pycollect_makemodule(module_path: Path, parent: pytest.Collector) -> pytest.Module:
        return _WithoutVllm.from_parent(parent, path=module_path)
else:
    from .harness import EngineSim  # imports vLLM: an installed one that fails to import fails here


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama's config (vLLM's ModelConfig reads it; no weights are loaded here)."""
    return build_tiny_llama(tmp_path_factory.mktemp("tiny_llama") / "model", **asdict(TinyLlamaSpec()))


@pytest.fixture(autouse=True)
def _restore_environment() -> Iterator[None]:
    """vLLM, run in this process here, writes os.environ (LOCAL_WORLD_SIZE, ...): later tests must not see it."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture
def engines(model_dir: Path) -> Iterator[list[EngineSim]]:
    made: list[EngineSim] = []
    yield made
    for engine in made:
        engine.close()
    assert not [t.name for t in threading.enumerate() if t.name.startswith("ncclkv")], "threads left after shutdown"

"""Lifecycle tests of NcclKVConnector: skipped (with the reason) where vLLM is not installed."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="the connector lifecycle tests drive vLLM's own scheduler")

from ncclkv._vllm_model import TinyLlamaSpec, build_tiny_llama  # noqa: E402

from .harness import EngineSim  # noqa: E402


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

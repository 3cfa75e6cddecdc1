"""Speculative decoding: which drafters the connector takes, and the reason it names for the others.

An EAGLE drafter's layer moving with the model's, pulled and pushed, is in
test_lifecycle.py; real vLLM engines doing it are in tests/vllm.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from ncclkv._vllm_model import build_eagle_head
from ncclkv.connector import NcclKVConnector
from ncclkv.connector._vllm_env import drafter_layers

from .harness import EngineSim, make_vllm_config

ROLES = pytest.mark.parametrize("role", [KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER],
                                ids=["scheduler", "worker"])


def _eagle(model_dir: Path, out: Path, **config: Any) -> dict[str, Any]:
    head = build_eagle_head(model_dir, out)
    if config:
        path = head / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    return {"method": "eagle", "model": str(head), "num_speculative_tokens": 2}


@ROLES
def test_an_eagle_drafter_of_the_models_geometry_is_taken(model_dir: Path, tmp_path: Path,
                                                          role: KVConnectorRole) -> None:
    config = make_vllm_config("spec", model_dir, "kv_consumer", speculative=_eagle(model_dir, tmp_path / "eagle"))
    assert NcclKVConnector(config, role).config is not None
    assert drafter_layers(config, 2, [0, 1, 2]) == [2]


def test_drafter_layers_must_follow_the_models_and_need_a_drafter(model_dir: Path, tmp_path: Path) -> None:
    eagle = make_vllm_config("spec", model_dir, "kv_consumer", speculative=_eagle(model_dir, tmp_path / "eagle"))
    assert drafter_layers(eagle, 2, [0, 1]) == []
    with pytest.raises(ValueError, match=r"drafter's KV cache layers \[3\] do not follow the model's 2 layers"):
        drafter_layers(eagle, 2, [0, 1, 3])
    plain = make_vllm_config("plain", model_dir, "kv_consumer")
    with pytest.raises(ValueError, match=r"KV cache layers \[2\] lie past the model's 2 layers, and no speculative "
                                         r"drafter with a KV cache is configured"):
        drafter_layers(plain, 2, [0, 1, 2])


@ROLES
def test_a_drafter_of_another_geometry_is_refused_naming_both(model_dir: Path, tmp_path: Path,
                                                               role: KVConnectorRole) -> None:
    speculative = _eagle(model_dir, tmp_path / "eagle", num_key_value_heads=2)
    config = make_vllm_config("spec", model_dir, "kv_consumer", speculative=speculative)
    with pytest.raises(ValueError, match=r"method 'eagle' keeps a drafter KV cache that ncclkv cannot move \(its "
                                         r"\(kv heads, head size, MLA\) \(2, 64, False\) differ from the model's "
                                         r"\(4, 64, False\)"):
        NcclKVConnector(config, role)


@ROLES
def test_a_separate_draft_model_is_refused(model_dir: Path, role: KVConnectorRole) -> None:
    speculative = {"method": "draft_model", "model": str(model_dir), "num_speculative_tokens": 2}
    config = make_vllm_config("spec", model_dir, "kv_consumer", speculative=speculative)
    with pytest.raises(ValueError, match=r"method 'draft_model' keeps a drafter KV cache that ncclkv cannot move "
                                         r"\(its KV cache layers are not numbered after the model's\)"):
        NcclKVConnector(config, role)


def test_a_drafter_without_a_kv_cache_is_served(model_dir: Path) -> None:
    """ngram: both roles built, the model's caches registered, the engine reachable."""
    engine = EngineSim.build("spec", model_dir, "kv_consumer",
                             speculative={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3})
    try:
        assert engine.drafter_passes == 0 and len(engine.caches) == 2
        assert engine.worker.get_handshake_metadata() is not None and engine.ref["engine_id"]
    finally:
        engine.close()

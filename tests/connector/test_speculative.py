"""Speculative decoding: a drafter with a KV cache of its own is refused with the reason; one without is served."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from ncclkv.connector import NcclKVConnector

from .harness import EngineSim, make_vllm_config


def eagle_head(model_dir: Path, out: Path) -> Path:
    """An EAGLE drafter's config for the tiny Llama (one layer; no weights: only the config is read here)."""
    config = json.loads((model_dir / "config.json").read_text())
    config.update(architectures=["EagleLlamaForCausalLM"], num_hidden_layers=1)
    out.mkdir()
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize("role", [KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER], ids=["scheduler", "worker"])
def test_a_drafter_with_its_own_kv_cache_is_refused_naming_the_method(model_dir: Path, tmp_path: Path,
                                                                       role: KVConnectorRole) -> None:
    speculative = {"method": "eagle", "model": str(eagle_head(model_dir, tmp_path / "eagle")),
                   "num_speculative_tokens": 2}
    config = make_vllm_config("spec", model_dir, "kv_consumer", speculative=speculative)
    assert config.speculative_config is not None and config.speculative_config.uses_draft_kv_cache()
    with pytest.raises(ValueError, match=r"speculative_config method 'eagle' keeps a drafter KV cache, which ncclkv "
                                         r"does not move .*Use a method without one \('ngram', 'suffix'\)"):
        NcclKVConnector(config, role)


def test_a_drafter_without_a_kv_cache_is_served(model_dir: Path) -> None:
    """ngram: both roles built, the model's caches registered, the engine reachable."""
    engine = EngineSim.build("spec", model_dir, "kv_consumer",
                             speculative={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3})
    try:
        assert engine.vllm_config.speculative_config is not None
        assert engine.worker.get_handshake_metadata() is not None and engine.ref["engine_id"]
    finally:
        engine.close()

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

from .harness import EngineSim, make_prompts, make_vllm_config

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


def test_a_drafter_on_one_side_only_fails_the_load_naming_it_and_vllm_recomputes(
        model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The prefill side has one more layer than the decode side: the handshake refuses the pull, the load
    fails with that reason, and the decode engine computes the prompt itself (kv_load_failure_policy)."""
    fast = {"deadline_s": 2.0, "heartbeat_s": 0.25}
    prompt = make_prompts([45])[0]
    sims = [EngineSim.build("p", model_dir, "kv_producer", fast, speculative=_eagle(model_dir, tmp_path / "e")),
            EngineSim.build("d", model_dir, "kv_consumer", fast), EngineSim.build("single", model_dir, "kv_both", fast)]
    prefill, decode, single = sims
    try:
        single.add("ref", prompt, 3)
        single.run(lambda: "ref" in single.finished)
        prefill.add("p", prompt, 1, {"do_remote_decode": True, "remote_engine_id": None})
        prefill.run(lambda: "p" in prefill.finished)
        decode.add("d", prompt, 3, prefill.finished["p"].kv_transfer_params)
        decode.run(lambda: "d" in decode.finished, also=(prefill,))
        assert decode.outputs(["d"]) == single.outputs(["ref"]) and decode.load_errors
        assert any("num_layers mismatch: local 3, remote 2 (a speculative drafter's KV layers count as layers"
                   in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]
    finally:
        for sim in sims:
            sim.close()

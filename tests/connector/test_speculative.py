"""Speculative decoding: which drafters the connector takes, and the reason it names for the others.

An EAGLE drafter's layer moving with the model's, pulled and pushed, is in
test_lifecycle.py; real vLLM engines doing it are in tests/vllm.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from ncclkv._vllm_model import eagle_speculative_config
from ncclkv.connector import NcclKVConnector
from ncclkv.connector._config import NcclKVConfig
from ncclkv.connector._metadata import LoadJob, NcclKVMetadata, PushJob
from ncclkv.connector._vllm_env import check_speculative, drafter_layers, rank_info
from ncclkv.connector._worker import RankInfo, WorkerSide, _Load
from ncclkv.engine import EngineRef
from ncclkv.layout import KVGeometry, ParallelLayout

from .harness import EngineSim, make_prompts, make_vllm_config

ROLES = pytest.mark.parametrize("role", [KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER],
                                ids=["scheduler", "worker"])


def _eagle(model_dir: Path, out: Path, **config: Any) -> dict[str, Any]:
    """An EAGLE drafter's speculative_config, its head's config changed by ``config``."""
    speculative = eagle_speculative_config(model_dir, out)
    if config:
        path = out / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    return speculative


@ROLES
def test_an_eagle_drafter_of_the_models_geometry_is_taken(model_dir: Path, tmp_path: Path,
                                                          role: KVConnectorRole) -> None:
    config = make_vllm_config("spec", model_dir, "kv_consumer", speculative=_eagle(model_dir, tmp_path / "eagle"))
    NcclKVConnector(config, role)  # not refused
    info = rank_info(config, torch.float32, [0, 1, 2])
    assert info.geometry.num_layers == 3 and info.drafter_layers == (2,)


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
                                         r"\(a separate draft model's KV cache layers are numbered from 0"):
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


class _Engine:
    """What the worker's hooks ask of an engine: layer-wise waits and saves, recorded in order."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def wait_layer(self, transfer_id: str, layer: int) -> None:
        self.calls.append(("wait", layer))

    def start_push(self, *args: object) -> None:
        self.calls.append(("start_push", -1))

    def save_layer(self, transfer_id: str, layer: int) -> None:
        self.calls.append(("save", layer))

    def finish(self, transfer_id: str) -> None:
        self.calls.append(("finish", -1))


def _worker_with_a_drafter() -> tuple[WorkerSide, _Engine]:
    """A worker of layers 0, 1 and a drafter's 2 over a recording engine (a unit test of the hooks alone)."""
    info = RankInfo("e", 0, 0, ParallelLayout(1, 1), KVGeometry(3, 4, 64, "float32"), 32, drafter_layers=(2,))
    worker = WorkerSide(info, NcclKVConfig(), "consumer")
    engine = _Engine()
    worker._engine = engine  # type: ignore[assignment]  # noqa: SLF001 - the hooks' engine, recorded
    worker._layers = {f"model.layers.{i}.self_attn.attn": i for i in range(3)}  # noqa: SLF001
    worker._caches = dict.fromkeys(range(3))  # type: ignore[arg-type]  # noqa: SLF001 - the layers, no tensors
    return worker, engine


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_a_layerwise_load_waits_for_the_drafters_layer_once_at_its_first_hook_or_the_error_query(
        runner: str) -> None:
    """vLLM's V1 runner asks for the step's load errors after the model's forward and before the drafter's
    (so the wait is there, and a failure is reported with the model's); V2 runs the drafter first and asks
    after wait_for_save (so the wait is at the drafter's first hook). Either way once a step."""
    worker, engine = _worker_with_a_drafter()
    producer = EngineRef("p", ParallelLayout(1, 1), ("tcp://127.0.0.1:1",))
    job = LoadJob("r", "t", producer, (0, 1), ((0, 40),), 40, sync=True)
    meta = NcclKVMetadata(loads=(job,))
    worker._loads["t"] = _Load(job, 0.0)  # noqa: SLF001 - started by start_load_kv
    for name in ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"):
        worker.wait_for_layer_load(meta, name)

    def drafter_passes() -> None:
        for _ in range(2):
            worker.wait_for_layer_load(meta, "model.layers.2.self_attn.attn")

    if runner == "v1":
        assert worker.get_block_ids_with_load_errors(meta) == set()
        drafter_passes()
        worker.wait_for_save(meta)
    else:
        drafter_passes()
        worker.wait_for_save(meta)
        assert worker.get_block_ids_with_load_errors(meta) == set()
    assert engine.calls == [("wait", 0), ("wait", 1), ("wait", 2)]


def test_a_push_saves_the_drafters_layer_once_a_step_and_in_wait_for_save_if_vllm_skipped_it() -> None:
    worker, engine = _worker_with_a_drafter()
    consumer = EngineRef("d", ParallelLayout(1, 1), ("tcp://127.0.0.1:1",))
    push = PushJob("r", "t", consumer, (0, 1), 40)
    step = NcclKVMetadata(pushes=(push,))
    for name in ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn", *["model.layers.2.self_attn.attn"] * 3):
        worker.save_kv_layer(step, name)
    worker.wait_for_save(step)
    assert engine.calls == [("start_push", -1), ("save", 0), ("save", 1), ("save", 2), ("finish", -1)]
    engine.calls.clear()
    skipped = NcclKVMetadata(pushes=(push,))  # the next step: vLLM skipped the drafter
    for name in ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"):
        worker.save_kv_layer(skipped, name)
    worker.wait_for_save(skipped)
    assert engine.calls == [("start_push", -1), ("save", 0), ("save", 1), ("save", 2), ("finish", -1)]


@pytest.mark.parametrize(("change", "why"), [
    ({"method": "dflash"}, r"ncclkv moves the drafters of eagle, eagle3, mtp only"),
    ({"method": "extract_hidden_states"}, r"it caches hidden states, not KV"),
    ({"method": "mtp", "num_nextn_predict_layers": 2}, r"multi-module MTP: the prefill side's MTP layers hold"),
    ({"method": "mtp", "num_nextn_predict_layers": 2, "num_speculative_tokens": 1}, r"multi-module MTP"),
    ({"pipeline_parallel_size": 2}, r"a drafter under pipeline parallelism is not supported"),
], ids=["dflash", "extract_hidden_states", "multi-module-mtp", "multi-module-mtp-one-token", "pp2"])
def test_other_drafters_are_refused_naming_why(model_dir: Path, tmp_path: Path, change: dict[str, Any],
                                               why: str) -> None:
    """vLLM's own SpeculativeConfig of an EAGLE head, then changed where building the real one needs a model
    this test does not have (the method, the MTP module count, the pipeline)."""
    config = make_vllm_config("spec", model_dir, "kv_consumer", speculative=_eagle(model_dir, tmp_path / "eagle"))
    speculative = config.speculative_config
    assert speculative is not None
    if "method" in change:
        object.__setattr__(speculative, "method", change["method"])
    if "num_nextn_predict_layers" in change:
        speculative.draft_model_config.hf_config.num_nextn_predict_layers = change["num_nextn_predict_layers"]
    if "num_speculative_tokens" in change:
        object.__setattr__(speculative, "num_speculative_tokens", change["num_speculative_tokens"])
    if "pipeline_parallel_size" in change:
        object.__setattr__(config.parallel_config, "pipeline_parallel_size", change["pipeline_parallel_size"])
    assert speculative.uses_draft_kv_cache()
    with pytest.raises(ValueError, match=rf"keeps a drafter KV cache that ncclkv cannot move \({why}"):
        check_speculative(config)


@pytest.mark.parametrize("kv_role", ["kv_producer", "kv_both"])
@pytest.mark.parametrize("method", ["ngram", "suffix"])
@ROLES
def test_any_speculative_method_on_a_pipelined_producer_is_refused_naming_why(
        model_dir: Path, kv_role: str, method: str, role: KVConnectorRole) -> None:
    """vLLM's V1 runner defers wait_for_save past the drafter for any speculative_config, and its non-last
    pipeline ranks return before it: they would never hold or finish a push. A consumer does nothing there."""
    speculative = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}
    config = make_vllm_config("spec", model_dir, kv_role, speculative=speculative)
    assert config.speculative_config is not None
    object.__setattr__(config.speculative_config, "method", method)  # suffix needs a package this test lacks
    assert not config.speculative_config.uses_draft_kv_cache()
    NcclKVConnector(config, role)  # no pipeline: taken
    object.__setattr__(config.parallel_config, "pipeline_parallel_size", 2)
    with pytest.raises(ValueError, match=rf"speculative_config method '{method}' with pipeline_parallel_size=2 on a "
                                         rf"KV producer \(kv_role '{kv_role}'\) is not supported: .*non-last "
                                         r"pipeline ranks never reach"):
        NcclKVConnector(config, role)
    consumer = make_vllm_config("spec", model_dir, "kv_consumer", speculative=speculative)
    object.__setattr__(consumer.parallel_config, "pipeline_parallel_size", 2)
    check_speculative(consumer)  # wait_for_save has nothing to do on a consumer: taken


def test_a_push_whose_step_ran_no_layer_hook_sends_every_layer_in_wait_for_save() -> None:
    """vLLM's kv_connector_no_forward: no hook runs, wait_for_save is all there is."""
    worker, engine = _worker_with_a_drafter()
    push = PushJob("r", "t", EngineRef("d", ParallelLayout(1, 1), ("tcp://127.0.0.1:1",)), (0, 1), 40)
    worker.wait_for_save(NcclKVMetadata(pushes=(push,)))
    assert engine.calls == [("start_push", -1), ("save", 0), ("save", 1), ("save", 2), ("finish", -1)]

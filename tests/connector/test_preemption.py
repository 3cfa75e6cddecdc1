"""Prefill requests preempted outside ``schedule()``, under vLLM's real scheduler, with real transfer engines.

vLLM's ``Scheduler.reset_prefix_cache(reset_running_requests=True)`` (reached
through ``LLM.reset_prefix_cache``, the dev ``/reset_prefix_cache`` route and
``pause_scheduler(clear_cache=True)``) preempts every running request between
two steps: their blocks are freed at once, and only the next step's
``preempted_req_ids`` tells the connector. Before that step the request may
be aborted, or that very step may resume it (see docs/VLLM_NOTES.md).
Every test ends with the prefill engine idle: nothing left in vLLM or the
connector.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from .harness import EngineSim
from .test_lifecycle import (CELL_BYTES, FAST, LENGTHS, MAX_TOKENS, NUM_LAYERS, PROMPTS, _bytes, _decode, _pair,
                             _reference, _settle)

MODES = pytest.mark.parametrize("push", [False, True], ids=["pull", "push"])


def _reset_prefix_cache(sim: EngineSim) -> None:
    """vLLM's own preemption outside schedule(): every running request back to the waiting queue."""
    assert sim.scheduler.reset_prefix_cache(reset_running_requests=True)


@MODES
def test_a_request_preempted_outside_schedule_then_aborted_is_freed_at_once(engines: list[EngineSim],
                                                                            model_dir: Path, push: bool) -> None:
    # hold_s far beyond the test's deadlines on the prefill side: nothing but the fix frees the request in time.
    prefill, decode = _pair(engines, model_dir, prefill_extra={"hold_s": 600.0}, decode_extra={"hold_s": 0.5})
    params = {"do_remote_decode": True, **({"remote_decode": decode.ref} if push else {})}
    prefill.add("p-0", PROMPTS[1], 50, params)  # decodes on here after the step that completed its prompt
    worker = prefill.worker._work()
    prefill.run(lambda: "p-0" in set(worker._sends.values()) | worker._sent, timeout_s=10)  # held / pushed
    _reset_prefix_cache(prefill)
    prefill.abort("p-0")  # the client goes away before the next step
    # vLLM freed its blocks at the preemption: the connector holds nothing and vLLM forgets it now (before:
    # delayed free, while the workers dropped the transfer at the next step and never reported it sent).
    assert "p-0" not in prefill.scheduler.requests
    assert prefill.connector._sched().num_tracked_requests == 0
    prefill.step()  # names the preemption and the finish: the workers drop the transfer, report nothing
    assert "p-0" not in set(worker._sends.values()) | worker._sent
    _settle(prefill, decode)


@MODES
def test_a_request_preempted_outside_schedule_completes_its_prompt_in_the_step_that_resumes_it(
        engines: list[EngineSim], model_dir: Path, push: bool) -> None:
    expected = _reference(engines, model_dir, PROMPTS[1:2])
    prefill = EngineSim.build("prefill", model_dir, "kv_producer", FAST, max_num_batched_tokens=100)
    engines.append(prefill)
    decode = EngineSim.build("decode", model_dir, "kv_consumer", {**FAST, "hold_s": 0.5})
    engines.append(decode)
    prefill.add("a", PROMPTS[0], 1)  # 45 tokens, no transfer
    prefill.add("p-0", PROMPTS[1], 1, {"do_remote_decode": True, **({"remote_decode": decode.ref} if push else {})})
    prefill.step()
    assert prefill.scheduler.requests["p-0"].num_computed_tokens == 100 - LENGTHS[0]  # a first chunk
    _reset_prefix_cache(prefill)
    prefill.step()  # names the preemption and resumes it: its whole prompt, its one token
    params = prefill.finished["p-0"].kv_transfer_params
    assert params is not None and params["remote_num_tokens"] == LENGTHS[1] and params["pushed"] == push
    (req,) = _decode(decode, PROMPTS[1:2], [params], also=(prefill,))
    assert decode.outputs([req]) == expected and decode.mismatches == [] and not decode.load_errors
    assert decode.computed[req] == MAX_TOKENS  # loaded, not recomputed
    assert _bytes(decode, "transfers_received") == 1
    _settle(prefill, decode)


def test_a_held_request_preempted_outside_schedule_is_held_anew_in_the_step_that_resumes_it(
        engines: list[EngineSim], model_dir: Path) -> None:
    """In one step the workers drop the old hold (before the forward) and register the new one (after it)."""
    expected = _reference(engines, model_dir, PROMPTS[1:2])
    prefill, decode = _pair(engines, model_dir)
    prefill.add("p-0", PROMPTS[1], 2, {"do_remote_decode": True})
    worker = prefill.worker._work()
    prefill.step()  # completes the prompt: held from the end of this step
    (first,) = worker._sends
    _reset_prefix_cache(prefill)
    prefill.step()  # resumed: prompt and first token recomputed, the second sampled; finished
    params = prefill.finished["p-0"].kv_transfer_params
    assert params is not None and params["transfer_id"] != first
    assert set(worker._sends) == {params["transfer_id"]}  # the old hold dropped, the new one stands
    (req,) = _decode(decode, PROMPTS[1:2], [params], also=(prefill,))
    assert decode.outputs([req]) == expected and decode.mismatches == [] and not decode.load_errors
    assert decode.computed[req] == MAX_TOKENS
    _settle(prefill, decode)
    assert _bytes(prefill, "bytes_sent") == LENGTHS[1] * CELL_BYTES * NUM_LAYERS  # the new hold, pulled once


class _Quiet:
    """An engine with nothing finished (a unit test of get_finished's bookkeeping alone)."""

    def take_finished_receiving(self) -> dict[str, BaseException | None]:
        return {}

    def take_finished_sending(self) -> dict[str, BaseException | None]:
        return {}


def test_a_request_whose_dropped_transfer_still_sends_is_not_kept_as_finished() -> None:
    """handle_preemptions gave up waiting for a preempted request's sends (it logs that); when vLLM then
    finishes the request, the worker must not keep it as finished for a transfer it will never report."""
    from ncclkv.connector import NcclKVConfig
    from ncclkv.connector._worker import RankInfo, WorkerSide
    from ncclkv.layout import KVGeometry, ParallelLayout

    worker = WorkerSide(RankInfo("e", 0, 0, ParallelLayout(1, 1), KVGeometry(2, 4, 64, "float32"), 32),
                        NcclKVConfig(), "producer")
    worker._engine = _Quiet()  # type: ignore[assignment]  # noqa: SLF001
    worker._sends["t-old"] = "p-0"  # noqa: SLF001 - dropped at the preemption, its sends still running
    worker._dropped.add("t-old")  # noqa: SLF001
    assert worker.get_finished({"p-0"}) == (set(), set())
    assert worker._finished == set()  # noqa: SLF001
    worker._sends["t-new"] = "p-1"  # noqa: SLF001 - a live hold of another request still counts
    worker.get_finished({"p-1"})
    assert worker._finished == {"p-1"}  # noqa: SLF001


class _Sending:
    """An engine whose transfers report as sent only once ``done`` names them; records ``reclaim``'s calls."""

    def __init__(self, deadline_s: float) -> None:
        self.config = type("Config", (), {"deadline_s": deadline_s})()
        self.reclaimed: list[tuple[str, bool]] = []
        self.done: set[str] = set()

    def reclaim(self, request_id: str, *, reused: bool = False) -> bool:
        self.reclaimed.append((request_id, reused))
        if request_id == "t-quick":
            self.done.add(request_id)  # its announced sends end soon after
        return True

    def take_finished_sending(self) -> dict[str, BaseException | None]:
        done, self.done = self.done, set()
        return {tid: RuntimeError("reclaimed (test)") for tid in done}


def test_preempted_sends_are_reclaimed_and_those_past_the_deadline_are_told_the_blocks_are_reused(
        caplog: pytest.LogCaptureFixture) -> None:
    """handle_preemptions used release(), which left the sends not posted yet to read the blocks whenever the link
    got to them, after vLLM had written the next request's KV there. It reclaims each preempted transfer (sends
    not announced yet fail), waits for them up to deadline_s, and tells the engine the blocks are reused for those
    still sending then."""
    from ncclkv.connector import NcclKVConfig
    from ncclkv.connector._metadata import NcclKVMetadata
    from ncclkv.connector._worker import RankInfo, WorkerSide
    from ncclkv.layout import KVGeometry, ParallelLayout

    worker = WorkerSide(RankInfo("e", 0, 0, ParallelLayout(1, 1), KVGeometry(2, 4, 64, "float32"), 32),
                        NcclKVConfig(), "producer")
    engine = _Sending(deadline_s=0.2)
    worker._engine = engine  # type: ignore[assignment]  # noqa: SLF001
    worker._sends.update({"t-quick": "p-0", "t-stuck": "p-1", "t-other": "p-2"})  # noqa: SLF001
    with caplog.at_level("ERROR", logger="ncclkv"):
        worker.handle_preemptions(NcclKVMetadata(preempted=frozenset({"p-0", "p-1"})))
    assert sorted(engine.reclaimed[:2]) == [("t-quick", False), ("t-stuck", False)]
    assert engine.reclaimed[2:] == [("t-stuck", True)]  # still sending after deadline_s: its blocks are reused
    assert "still sending after the deadline: ['t-stuck']" in caplog.text
    assert worker._sends == {"t-stuck": "p-1", "t-other": "p-2"}  # noqa: SLF001 - t-other's request runs on

"""The connector's KV events: pushed KV in the decode engine's staging, published by vLLM's own scheduler.

The engines are the lifecycle tests' (harness.py): vLLM's real Scheduler
with both connector roles over real transfer engines. What the scheduler
publishes is caught by an event publisher installed in its place (vLLM's
ZMQ publisher is exercised by tests/vllm/test_ncclkv_pd.py). The other
tests drive the event container through vLLM's own output aggregator.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from vllm.distributed.kv_events import BlockRemoved, BlockStored, EventBatch, EventPublisher, KVCacheEvent
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

from ncclkv.connector._events import MEDIUM, EventGatherer, NcclKVEvents
from ncclkv.hashing import hash_request_tokens

from .harness import BLOCK_SIZE, EngineSim, make_prompts

PROMPTS = make_prompts([45, 77, 130], seed=5)  # 1, 2 and 4 full blocks
FAST = {"deadline_s": 2.0, "heartbeat_s": 0.25}


class _Recorder(EventPublisher):
    """Stands in the scheduler's publisher slot and keeps every batch it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[KVCacheEvent] = []

    def publish(self, events: EventBatch) -> None:
        self.events.extend(events.events)

    def shutdown(self) -> None:
        pass


def _staging(recorder: _Recorder) -> list[KVCacheEvent]:
    return [e for e in recorder.events if getattr(e, "medium", None) == MEDIUM]


def _hashes(prompt: list[int]) -> list[bytes]:
    return [h.digest for h in hash_request_tokens(BLOCK_SIZE, prompt, (None, None))]  # (no LoRA, no salt)


def test_push_is_reported_stored_then_removed_and_pull_is_not(engines: list[EngineSim], model_dir: Path) -> None:
    prefill = EngineSim.build("prefill", model_dir, "kv_producer", FAST)
    decode = EngineSim.build("decode", model_dir, "kv_consumer", FAST)
    engines += [prefill, decode]
    published, prefill_published = _Recorder(), _Recorder()
    decode.scheduler.kv_event_publisher = published
    prefill.scheduler.kv_event_publisher = prefill_published
    ids = [f"p-{i}" for i in range(len(PROMPTS))]
    for req_id, prompt in zip(ids, PROMPTS):
        prefill.add(req_id, prompt, 1, {"do_remote_decode": True, "remote_decode": decode.ref})
    prefill.run(lambda: prefill.idle)  # all pushed into the decode engine's staging; prefill blocks freed
    params = [prefill.finished[r].kv_transfer_params for r in ids]
    # The decode engine has no request yet: its workers report what landed in staging.
    decode.run(lambda: len(_staging(published)) == len(PROMPTS))
    stored = _staging(published)
    assert all(isinstance(e, BlockStored) for e in stored)
    assert sorted((e.block_hashes, e.token_ids) for e in stored) == sorted(
        (_hashes(p), p[:len(p) // BLOCK_SIZE * BLOCK_SIZE]) for p in PROMPTS)
    assert {(e.block_size, e.parent_block_hash, e.lora_name, e.locality) for e in stored} == {
        (BLOCK_SIZE, None, None, "LOCAL")}
    # The decode requests take their KV out of staging.
    dec = [f"d-{i}" for i in range(len(PROMPTS))]
    for req_id, prompt, p in zip(dec, PROMPTS, params):
        decode.add(req_id, prompt, 2, p)
    decode.run(lambda: all(r in decode.finished for r in dec), also=(prefill,))
    assert decode.mismatches == [] and decode.computed == {r: 2 for r in dec}  # loaded, not recomputed
    removed = _staging(published)[len(PROMPTS):]
    assert all(isinstance(e, BlockRemoved) for e in removed)
    assert sorted(e.block_hashes for e in removed) == sorted(_hashes(p) for p in PROMPTS)
    # A pull moves KV straight into vLLM's blocks: nothing staged, nothing reported by us.
    prefill.add("pull", PROMPTS[0], 1, {"do_remote_decode": True})
    prefill.run(lambda: "pull" in prefill.finished)
    decode.add("d-pull", PROMPTS[0], 2, prefill.finished["pull"].kv_transfer_params)
    decode.run(lambda: "d-pull" in decode.finished, also=(prefill,))
    decode.run(lambda: decode.idle and prefill.idle, also=(prefill,))
    assert len(_staging(published)) == 2 * len(PROMPTS) and _staging(prefill_published) == []
    assert decode.connector._sched()._events.num_pending == 0


def _output(events: NcclKVEvents | None) -> ModelRunnerOutput:
    return ModelRunnerOutput(req_ids=[], req_id_to_index={}, kv_connector_output=KVConnectorOutput(
        kv_cache_events=events))


def test_workers_reporting_in_different_steps_give_one_event_each_in_order() -> None:
    """Two TP workers, merged by vLLM's own aggregator: worker 1 lands the push a step later."""
    stored = BlockStored(block_hashes=[b"a" * 32], parent_block_hash=None, token_ids=[1] * 4, block_size=4,
                         lora_id=None, medium=MEDIUM, lora_name=None)
    removed = BlockRemoved(block_hashes=[b"a" * 32], medium=MEDIUM)
    merge, gather = KVOutputAggregator(2), EventGatherer(horizon_s=60)
    steps = [  # (worker 0, worker 1)
        (NcclKVEvents([stored]), None),
        (NcclKVEvents([removed]), NcclKVEvents([stored, removed])),
    ]
    yielded = []
    for worker0, worker1 in steps:
        merged = merge.aggregate([_output(worker0), _output(worker1)]).kv_connector_output
        assert merged is not None
        if merged.kv_cache_events is not None:
            gather.add(merged.kv_cache_events.get_all_events(), num_workers=2)
        yielded.append(gather.take())
    assert yielded == [[], [stored, removed]]
    assert gather.num_pending == 0


def test_reports_that_never_reach_every_worker_are_forgotten() -> None:
    stored = BlockStored(block_hashes=[b"b" * 32], parent_block_hash=None, token_ids=[2] * 4, block_size=4,
                         lora_id=None, medium=MEDIUM, lora_name=None)
    gather = EventGatherer(horizon_s=0.05)
    gather.add([stored], num_workers=2)
    assert gather.take() == [] and gather.num_pending == 1
    threading.Event().wait(0.1)
    gather.add([], num_workers=2)
    assert gather.num_pending == 0 and gather.take() == []


def test_a_report_past_the_horizon_is_not_counted_with_a_new_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """Worker 0 reported a push's blocks stored, worker 1 never did (it took the push straight into its blocks);
    no event came for longer than the horizon. A later push of the same prompt, reported by worker 0 only, is
    not every worker's: the old report was dropped, not counted with the new one."""
    from ncclkv.connector import _events

    now = [100.0]
    monkeypatch.setattr(_events, "time", type("Clock", (), {"monotonic": staticmethod(lambda: now[0])}))
    stored = BlockStored(block_hashes=[b"c" * 32], parent_block_hash=None, token_ids=[3] * 4, block_size=4,
                         lora_id=None, medium=MEDIUM, lora_name=None)
    gather = EventGatherer(horizon_s=5.0)
    gather.add([stored], num_workers=2)  # worker 0, first push
    now[0] += 6.0  # past the horizon, no event meanwhile
    gather.add([stored], num_workers=2)  # worker 0, second push
    assert gather.take() == [] and gather.num_pending == 1
    gather.add([stored], num_workers=2)  # worker 1, second push: now every worker reported it
    assert gather.take() == [stored] and gather.num_pending == 0


def test_aggregate_keeps_what_every_worker_reported() -> None:
    a = BlockRemoved(block_hashes=[b"a" * 32], medium=MEDIUM)
    b = BlockRemoved(block_hashes=[b"b" * 32], medium=MEDIUM)
    events = NcclKVEvents([a, b])
    events.add_events([a])
    events.increment_workers()
    assert events.get_number_of_workers() == 2 and len(events) == 3
    assert events.aggregate().get_all_events() == [a] and events.get_number_of_workers() == 1

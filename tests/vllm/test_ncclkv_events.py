"""Real vLLM engines: ncclkv's staging events on the decode engine's own KV-event stream (ZMQ).

A prefill engine pushes prompts into a decode engine whose KV events vLLM
publishes (``kv_events_config``: its ZMQ publisher binds an ipc endpoint in
the test's temporary folder, no port; this test subscribes with a SUB
socket). Pushed KV that waited in ncclkv's
staging store must show up there as ``BlockStored`` then ``BlockRemoved``
with ``medium="ncclkv_staging"`` and ncclkv's block hashes, next to vLLM's own
events; pulled KV (straight into vLLM's blocks) must not show up as ours.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from engine_proc import EngineOptions, EngineProcess
from ncclkv.hashing import hash_request_tokens
from tiny_model import make_prompts

pytestmark = pytest.mark.vllm

BLOCK_SIZE = 32
PULL_PROMPTS = make_prompts((45, 96), seed=21)
PUSH_PROMPTS = make_prompts((45, 77, 130), seed=22)  # 1, 2 and 4 full blocks
MEDIUM = "ncclkv_staging"
DEADLINE = {"deadline_s": 30.0}


@dataclass(frozen=True)
class _Publishing(EngineOptions):
    """An engine whose scheduler publishes its KV events on ``kv_events_endpoint`` (ipc://: it binds it).

    Not a PUB connecting to a bound SUB: on these machines such a PUB lost
    messages sent more than a few ms apart (libzmq 4.3.5), i.e. nearly all."""

    kv_events_endpoint: str = ""

    def llm_kwargs(self) -> dict[str, Any]:
        events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": self.kv_events_endpoint}
        return {**EngineOptions.llm_kwargs(self), "kv_events_config": events}


def _connector(role: str, **extra: Any) -> dict[str, Any]:
    return dict(kv_connector="NcclKVConnector", kv_connector_module_path="ncclkv.connector", kv_role=role,
                kv_load_failure_policy="recompute", kv_connector_extra_config={**DEADLINE, **extra})


def _prefill(engine: Any, prompts: list[list[int]], **params: Any) -> list[dict[str, Any]]:
    results = engine.generate(prompts, max_tokens=1, kv_transfer_params=[
        {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None, **params}] * len(prompts))
    return [r.kv_transfer_params for r in results]


def _receive(sub: zmq.Socket, until: int, timeout_s: float) -> list[dict[str, Any]]:
    """Every event published until ``until`` of them are ncclkv's (or the deadline passes)."""
    events: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout_s
    while sum(e.get("medium") == MEDIUM for e in events) < until:
        left = deadline - time.monotonic()
        if left <= 0 or not sub.poll(int(left * 1000)):
            break
        _topic, _seq, payload = sub.recv_multipart()
        _ts, batch, *_ = msgspec.msgpack.decode(payload)  # an EventBatch: [ts, events, dp rank]
        events += batch
    return events


def _hashes(prompt: list[int]) -> list[bytes]:
    return [h.digest for h in hash_request_tokens(BLOCK_SIZE, prompt, (None, None))]  # (no LoRA, no salt)


@pytest.mark.timeout(300)
def test_decode_engine_publishes_staged_push_events(tiny_model_dir: Path, launch_engine, cpu_cores: list[int],
                                                    tmp_path: Path) -> None:
    t0 = time.monotonic()
    endpoint = f"ipc://{tmp_path / 'kv_events'}"
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)  # ZMQ connects once the engine binds it
    ref_path = tmp_path / "decode_ref.json"
    prefill = launch_engine("prefill", cpu_core=cpu_cores[0], kv_transfer_config=_connector("kv_producer"))
    options = replace(_Publishing(model_dir=tiny_model_dir), cpu_core=cpu_cores[-1],
                      kv_transfer_config=_connector("kv_consumer", ref_path=str(ref_path)),
                      kv_events_endpoint=endpoint)
    decode = EngineProcess(options, tmp_path / "decode.log", name="decode")
    try:
        decode.launch()
        prefill.wait_ready()
        decode.wait_ready()
        t1 = time.monotonic()
        # Pulled first: anything of ours it produced would come first on the stream.
        params = _prefill(prefill, PULL_PROMPTS)
        decode.generate(PULL_PROMPTS, max_tokens=4, kv_transfer_params=params)
        # Pushed: it all lands in staging before the decode requests exist, which then take it.
        params = _prefill(prefill, PUSH_PROMPTS, remote_decode=json.loads(ref_path.read_text()))
        assert all(p["pushed"] for p in params)
        # The prefill holds each request until its push is done: then it all sits in the decode's staging
        # (a decode request that came first would take the tensors directly, and nothing is staged).
        assert prefill.drain(max_steps=10**7, timeout_s=30) == 0
        decoded = decode.generate(PUSH_PROMPTS, max_tokens=4, kv_transfer_params=params)
        assert all(len(r.token_ids) == 4 for r in decoded)
        log = decode.log_path.read_text(errors="replace")
        assert "ncclkv: load of" not in log, "a load failed (and vLLM recomputed it)"
        events = _receive(sub, until=2 * len(PUSH_PROMPTS), timeout_s=30)
        ours = [e for e in events if e.get("medium") == MEDIUM]
        assert len(events) > len(ours), "vLLM's own events come on the same stream"
        stored = [e for e in ours if e["type"] == "BlockStored"]
        removed = [e for e in ours if e["type"] == "BlockRemoved"]
        expected = sorted(_hashes(p) for p in PUSH_PROMPTS)
        assert len(ours) == 2 * len(PUSH_PROMPTS), ours
        assert sorted(e["block_hashes"] for e in stored) == expected
        assert sorted(e["block_hashes"] for e in removed) == expected
        for prompt in PUSH_PROMPTS:  # stored before removed, with the blocks' own tokens
            at = {e["type"]: i for i, e in enumerate(ours) if e["block_hashes"] == _hashes(prompt)}
            s, r = at["BlockStored"], at["BlockRemoved"]
            assert s < r and ours[s]["token_ids"] == prompt[:len(prompt) // BLOCK_SIZE * BLOCK_SIZE]
            assert ours[s]["block_size"] == BLOCK_SIZE and ours[s].get("locality") == "LOCAL"
        print(f"\nengines up in {t1 - t0:.1f} s; transfers and events {time.monotonic() - t1:.1f} s")
    finally:
        decode.close()
        sub.close(linger=0)
        ctx.term()

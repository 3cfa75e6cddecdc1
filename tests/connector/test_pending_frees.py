"""A prefill engine short of blocks waits for held blocks to be freed instead of preempting (vLLM's real scheduler).

vLLM asks ``has_pending_block_frees()`` when a running request's blocks
cannot be allocated: True keeps every running request (the one that did not
fit and those after it wait this step), False preempts the last one. ncclkv
answers True while a request finished here holds blocks for a transfer and
finished at most ``free_wait_s`` ago (docs/ARCHITECTURE.md, The vLLM
connector). Every test ends with both engines idle.
"""

from __future__ import annotations

from pathlib import Path

from vllm.v1.request import Request

from tests.fake_time import FakeTime

from .harness import BLOCK_SIZE, EngineSim, make_prompts
from .test_lifecycle import FAST, PROMPTS, _settle

# 7 usable blocks (vLLM keeps block 0 as its null block): a held 130-token prompt takes 5 of them, a running
# request of 45 tokens 2, and it needs a third at its 65th token.
NUM_BLOCKS = 8
HELD = PROMPTS[2]  # 130 tokens: 5 blocks
RUNNING = make_prompts([45], seed=7)[0]  # 2 blocks
RUNNING_TOKENS = 30  # decodes past 64 tokens: a third block


def _pressed(engines: list[EngineSim], model_dir: Path, prefill_extra: dict,
             clock: FakeTime | None = None) -> tuple[EngineSim, EngineSim, dict, Request]:
    """A prefill engine holding a finished request's 5 blocks for a pull, its other request running out of blocks
    (its 64 tokens computed, the 65th needs a block none is free for); its params; that running request.
    ``clock``: the prefill scheduler side's (it reads it when a request is kept, and when vLLM asks)."""
    prefill = EngineSim.build("prefill", model_dir, "kv_producer", {**FAST, "hold_s": 600.0, **prefill_extra},
                              num_blocks=NUM_BLOCKS)
    engines.append(prefill)
    if clock is not None:
        prefill.connector._sched()._clock = clock
    decode = EngineSim.build("decode", model_dir, "kv_consumer", FAST)
    engines.append(decode)
    prefill.add("p-0", HELD, 1, {"do_remote_decode": True})
    prefill.run(lambda: "p-0" in prefill.finished)
    params = prefill.finished["p-0"].kv_transfer_params
    assert params is not None and "p-0" in prefill.scheduler.requests  # held for the pull
    prefill.add("a", RUNNING, RUNNING_TOKENS)
    running = prefill.scheduler.requests["a"]
    prefill.run(lambda: running.num_computed_tokens == 2 * BLOCK_SIZE)
    assert prefill.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 0
    return prefill, decode, params, running


def test_a_running_request_waits_for_a_held_requests_blocks_instead_of_being_preempted(
        engines: list[EngineSim], model_dir: Path) -> None:
    prefill, decode, params, running = _pressed(engines, model_dir, {"free_wait_s": 600.0})
    for _ in range(3):  # no block comes free while the decode engine has not pulled: it waits, step after step
        prefill.step()
    assert (running.num_computed_tokens, running.num_preemptions) == (2 * BLOCK_SIZE, 0)
    assert prefill.connector.has_pending_block_frees()
    decode.add("d-0", HELD, 4, params)  # pulls p-0: the prefill engine frees its blocks, "a" goes on
    decode.run(lambda: "d-0" in decode.finished and "a" in prefill.finished, also=(prefill,))
    assert running.num_preemptions == 0
    assert prefill.computed["a"] == len(RUNNING) + RUNNING_TOKENS - 1  # nothing computed twice
    assert prefill.mismatches == [] and decode.mismatches == [] and decode.computed["d-0"] == 4
    assert not prefill.connector.has_pending_block_frees()
    _settle(prefill, decode)


def test_a_hold_older_than_free_wait_s_no_longer_keeps_vllm_from_preempting(engines: list[EngineSim],
                                                                             model_dir: Path) -> None:
    """A decode engine that does not pull (hold_s is 600 s) stalls the prefill engine free_wait_s at most."""
    clock = FakeTime()
    prefill, decode, params, running = _pressed(engines, model_dir, {"free_wait_s": 5.0}, clock)
    prefill.step()
    assert prefill.connector.has_pending_block_frees()
    assert (running.num_computed_tokens, running.num_preemptions) == (2 * BLOCK_SIZE, 0)
    clock.t += 4.9
    prefill.step()
    assert running.num_preemptions == 0
    clock.t += 0.2  # the hold is 5.1 s old
    assert not prefill.connector.has_pending_block_frees()
    prefill.step()
    assert running.num_preemptions == 1  # vLLM preempted it: its blocks went back, it waits for blocks
    decode.add("d-0", HELD, 4, params)
    decode.run(lambda: "d-0" in decode.finished and "a" in prefill.finished, also=(prefill,))
    assert prefill.mismatches == [] and decode.mismatches == []
    _settle(prefill, decode)


def test_free_wait_s_0_lets_vllm_preempt_at_once(engines: list[EngineSim], model_dir: Path) -> None:
    prefill, decode, params, running = _pressed(engines, model_dir, {"free_wait_s": 0})
    assert not prefill.connector.has_pending_block_frees()
    prefill.step()
    assert running.num_preemptions == 1
    decode.add("d-0", HELD, 4, params)
    decode.run(lambda: "d-0" in decode.finished and "a" in prefill.finished, also=(prefill,))
    _settle(prefill, decode)


def test_a_consumer_never_waits(engines: list[EngineSim], model_dir: Path) -> None:
    """Nothing held on a decode engine: vLLM preempts there as without a connector."""
    decode = EngineSim.build("decode", model_dir, "kv_consumer", FAST, num_blocks=NUM_BLOCKS)
    engines.append(decode)
    decode.add("a", RUNNING, RUNNING_TOKENS)
    decode.add("b", make_prompts([130], seed=9)[0], RUNNING_TOKENS)
    decode.run(lambda: decode.scheduler.requests["b"].num_preemptions > 0
               or decode.scheduler.requests["a"].num_preemptions > 0)
    assert not decode.connector.has_pending_block_frees()
    decode.run(lambda: "a" in decode.finished and "b" in decode.finished)
    _settle(decode)



def test_a_stream_of_new_holds_stalls_a_running_request_free_wait_s_at_most(engines: list[EngineSim],
                                                                             model_dir: Path) -> None:
    """A busy prefill engine: a running request's next chunk needs 2 blocks while 1 is free, and every step a
    new request takes that block, completes its prompt and is held (its decode engine pulls the oldest hold,
    whose block then comes free). The newest hold is always less than free_wait_s old, yet the running request
    waits free_wait_s at most, counted from the first step it waited: then vLLM preempts it, as without the
    connector. Before, the answer stayed True while new holds came: the running request never moved (128 tokens
    computed, no preemption), however long the stream went on."""
    clock = FakeTime()
    prefill = EngineSim.build("prefill", model_dir, "kv_producer", {**FAST, "hold_s": 600.0, "free_wait_s": 5.0},
                              num_blocks=NUM_BLOCKS)
    engines.append(prefill)
    prefill.connector._sched()._clock = clock
    # Chunks of 2 blocks while another request waits, so a new request gets token budget beside it.
    prefill.scheduler.scheduler_config.long_prefill_token_threshold = 2 * BLOCK_SIZE
    decode = EngineSim.build("decode", model_dir, "kv_consumer", FAST)
    engines.append(decode)
    small = make_prompts([20] * 12, seed=11)  # a block each
    added: list[str] = []

    def add_small() -> None:
        added.append(f"w-{len(added)}")
        prefill.add(added[-1], small[len(added) - 1], 1, {"do_remote_decode": True})

    prefill.add("r", make_prompts([6 * BLOCK_SIZE], seed=12)[0], 1)  # 6 blocks, fits the 7 when it is admitted
    running = prefill.scheduler.requests["r"]
    for _ in range(2):
        add_small()
        prefill.step()
    assert running.num_computed_tokens == 4 * BLOCK_SIZE and all(w in prefill.finished for w in added)
    assert prefill.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 1  # its next chunk needs 2
    requested: list[str] = []

    def pull_held() -> None:
        for w in added:
            if w in prefill.finished and w not in requested:
                decode.add(f"d-{w}", small[added.index(w)], 1, prefill.finished[w].kv_transfer_params)
                requested.append(w)

    start = clock.t
    while len(added) < len(small):
        add_small()
        prefill.step()
        if running.num_preemptions or running.num_computed_tokens != 4 * BLOCK_SIZE:
            break
        assert added[-1] in prefill.finished  # it took the free block and is held: the newest hold is new
        oldest = next(w for w in added if w not in requested)  # the decode engine pulls it: its block comes free
        decode.add(f"d-{oldest}", small[added.index(oldest)], 1, prefill.finished[oldest].kv_transfer_params)
        requested.append(oldest)
        decode.run(lambda: f"d-{oldest}" in decode.finished and oldest not in prefill.scheduler.requests,
                   also=(prefill,))
        clock.t += 1.0
    assert (running.num_computed_tokens, running.num_preemptions, clock.t - start) == (0, 1, 5.0)
    decode.run(lambda: (pull_held(), "r" in prefill.finished and
                        all(f"d-{w}" in decode.finished for w in added))[1], also=(prefill,))
    assert prefill.mismatches == [] and decode.mismatches == [] and decode.load_errors == set()
    _settle(prefill, decode)

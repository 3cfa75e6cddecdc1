"""Running the vLLM benchmark's engines: one set-up (a prefill/decode pair) at a time, and one recompute engine.

The recompute engine (no connector) stays up for the whole run, pinned to the
decode core like every decode engine. For each set-up in turn:

1. with no other engine up, the recompute engine runs ``repeats`` rounds over
   every prompt length: the baseline, taken alone so that no set-up's
   background threads are in it, and spread over the run so that it sees the
   machine's load as the set-ups do;
2. the set-up's pair starts, runs one untimed round over every length, then
   ``repeats`` rounds; within a round each length goes through the pair once
   per mode (round r's prompts are the same everywhere, so every output is
   checked against recompute's for the same prompt);
3. once per round, the recompute engine runs the shortest prompt while the
   pair is up but idle ("beside"): how much the set-up's engines slow another
   engine on the machine when they have nothing to do;
4. the pair stops; only three engines are ever up at once.

A set-up that cannot run is recorded with the reason, not left out.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ncclkv.demo import EngineError, EngineOptions, EngineProcess, make_prompts

from ._vllm_peers import Mode, PairSetup, error_line, pair_setup, unavailable_reason

__all__ = ["RECOMPUTE", "Outcome", "Plan", "Sample", "Skipped", "recompute_outputs", "run_plan"]

RECOMPUTE = "recompute (no connector)"
_CACHED_METRIC = "vllm:prompt_tokens_cached"  # prompt tokens not computed: with prefix caching off, the connector's


@dataclass(frozen=True, slots=True)
class Plan:
    model_dir: Path
    vocab_size: int
    max_model_len: int
    dtype: str
    lengths: tuple[int, ...]
    repeats: int
    gen_tokens: int
    setups: tuple[str, ...]  # PEER_KEYS, in the order they run
    modes: tuple[str, ...]  # ncclkv's
    prefill_core: int
    decode_core: int
    workdir: Path  # engine logs and the set-ups' files
    timeout_s: float = 300.0


@dataclass(frozen=True, slots=True)
class Sample:
    """One request's timings on the decode engine (or the recompute engine) and what came with it."""

    method: str
    setup: str  # the set-up whose turn it was taken in
    tokens: int
    round: int
    ttft_s: float
    kv_wait_s: float | None = None  # arrival to first scheduling: for an async load, the wait for KV
    prefill_ttft_s: float | None = None  # the pair's prefill engine, for the same prompt
    loaded_tokens: int | None = None
    output: tuple[int, ...] = ()
    beside: bool = False  # a recompute sample taken while the set-up's (idle) pair was up


@dataclass(frozen=True, slots=True)
class Skipped:
    setup: str
    title: str
    methods: tuple[str, ...]
    reason: str
    failed: bool  # True: it started and then failed; False: it could not run here


@dataclass(slots=True)
class Outcome:
    samples: list[Sample] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)


def run_plan(plan: Plan, progress: Callable[[str], None]) -> Outcome:
    outcome = Outcome()
    with _engine(plan, "recompute", plan.decode_core, None) as recompute:
        recompute.start(plan.timeout_s)
        _warm_up(plan, recompute, None, progress)
        for key in plan.setups:
            setup = pair_setup(key, plan.workdir, plan.modes)
            methods = tuple(m.label for m in setup.modes)
            reason = unavailable_reason(setup, plan.prefill_core)
            if reason is not None:
                outcome.skipped.append(Skipped(key, setup.title, methods, f"not runnable here: {reason}", False))
                continue
            _alone(plan, key, recompute, outcome.samples, progress)
            try:
                _run_setup(plan, setup, recompute, outcome.samples, progress)
            except EngineError as err:
                text = str(err)
                if text.startswith(recompute.name):
                    raise  # the baseline itself: nothing can be measured
                started = "waiting for 'ready'" not in text and "while building" not in text
                outcome.skipped.append(Skipped(key, setup.title, methods,
                                               ("failed: " if started else "not runnable here: ") + error_line(text),
                                               started))
        if not any(s.method == RECOMPUTE for s in outcome.samples):  # no set-up ran: the baseline still does
            _alone(plan, "recompute", recompute, outcome.samples, progress)
    return outcome


@contextmanager
def _engine(plan: Plan, name: str, core: int, config: Any, env: dict[str, str] | None = None) -> Iterator[EngineProcess]:
    options = EngineOptions(model_dir=plan.model_dir, cpu_core=core, kv_transfer_config=config,
                            max_model_len=plan.max_model_len, enable_prefix_caching=False, dtype=plan.dtype,
                            log_stats=True, extra_env=env or {})
    engine = EngineProcess(options, plan.workdir / f"{name}.log", name=f"{name} engine")
    try:
        yield engine
    finally:
        engine.close()


@dataclass(slots=True)
class _Pair:
    setup: PairSetup
    prefill: EngineProcess
    decode: EngineProcess
    decode_ref: dict[str, Any] | None


def _prompt(plan: Plan, length: int, index: int) -> list[int]:
    """Round ``index``'s prompt of ``length`` tokens, the same in every set-up's turn (-1: the warm-up's)."""
    return make_prompts((length,), plan.vocab_size, seed=1000 * (index + 2) + length)[0]


def _alone(plan: Plan, key: str, recompute: EngineProcess, samples: list[Sample],
           progress: Callable[[str], None]) -> None:
    for index in range(plan.repeats):
        progress(f"vllm: recompute alone before {key}, round {index + 1}/{plan.repeats}")
        for length in plan.lengths:
            samples.append(_recompute_sample(plan, key, recompute, _prompt(plan, length, index), index, False))


def _warm_up(plan: Plan, recompute: EngineProcess, pair: _Pair | None, progress: Callable[[str], None]) -> None:
    """Every length and path once, untimed (first forwards, first links, NIXL's handshake)."""
    progress(f"vllm: warm-up{'' if pair is None else ' of ' + pair.setup.title}")
    for length in plan.lengths:
        prompt = _prompt(plan, length, -1)
        if pair is None:
            _recompute_sample(plan, "", recompute, prompt, -1, False)
        else:
            for mode in pair.setup.modes:
                _pair_sample(plan, pair, mode, prompt, -1)


def _run_setup(plan: Plan, setup: PairSetup, recompute: EngineProcess, samples: list[Sample],
               progress: Callable[[str], None]) -> None:
    with ExitStack() as stack:
        prefill = stack.enter_context(_engine(plan, f"{setup.key}-prefill", plan.prefill_core,
                                              setup.prefill_config, dict(setup.prefill_env)))
        decode = stack.enter_context(_engine(plan, f"{setup.key}-decode", plan.decode_core,
                                             setup.decode_config, dict(setup.decode_env)))
        progress(f"vllm: starting the {setup.title} engines")
        prefill.launch()
        decode.launch()
        prefill.wait_ready(plan.timeout_s)
        decode.wait_ready(plan.timeout_s)
        ref = json.loads(setup.ref_path.read_text()) if setup.ref_path is not None else None
        pair = _Pair(setup, prefill, decode, ref)
        _warm_up(plan, recompute, pair, progress)
        for index in range(plan.repeats):
            progress(f"vllm: {setup.key}, round {index + 1}/{plan.repeats}")
            for length in plan.lengths:
                prompt = _prompt(plan, length, index)
                samples.extend(_pair_sample(plan, pair, mode, prompt, index) for mode in setup.modes)
            shortest = min(plan.lengths)
            samples.append(_recompute_sample(plan, setup.key, recompute, _prompt(plan, shortest, index), index, True))


def _recompute_sample(plan: Plan, key: str, engine: EngineProcess, prompt: list[int], index: int,
                      beside: bool) -> Sample:
    result = engine.generate([prompt], max_tokens=plan.gen_tokens, timeout_s=plan.timeout_s)[0]
    return Sample(RECOMPUTE, key, len(prompt), index, _timed(result.ttft_s, RECOMPUTE), result.queued_s,
                  output=result.token_ids, beside=beside)


def _pair_sample(plan: Plan, pair: _Pair, mode: Mode, prompt: list[int], index: int) -> Sample:
    intent = None if mode.intent is None else dict(mode.intent)
    if intent is not None and mode.push:
        intent["remote_decode"] = pair.decode_ref
    before = pair.decode.metrics(_CACHED_METRIC).get(_CACHED_METRIC, 0.0)
    prefilled = pair.prefill.generate([prompt], max_tokens=1, timeout_s=plan.timeout_s,
                                      kv_transfer_params=None if intent is None else [intent])[0]
    params = prefilled.kv_transfer_params
    if intent is not None and params is None:
        raise EngineError(f"{pair.setup.title}: the prefill engine returned no kv_transfer_params")
    decoded = pair.decode.generate([prompt], max_tokens=plan.gen_tokens, timeout_s=plan.timeout_s,
                                   kv_transfer_params=None if params is None else [params])[0]
    after = pair.decode.metrics(_CACHED_METRIC).get(_CACHED_METRIC, 0.0)
    pair.prefill.drain(timeout_s=plan.timeout_s)  # blocks a prefill engine holds for the decode free as it steps
    if pair.setup.scratch is not None:
        shutil.rmtree(pair.setup.scratch, ignore_errors=True)  # ExampleConnector's files: 128 MiB per 4096 tokens
    return Sample(mode.label, pair.setup.key, len(prompt), index, _timed(decoded.ttft_s, mode.label),
                  decoded.queued_s, _timed(prefilled.ttft_s, mode.label), round(after - before), decoded.token_ids)


def _timed(value: float | None, what: str) -> float:
    if value is None:
        raise EngineError(f"{what}: vLLM reported no time to first token (are its stats off?)")
    return value


def recompute_outputs(samples: Sequence[Sample]) -> dict[tuple[int, int], tuple[int, ...]]:
    """The recompute engine's output per (tokens, round), i.e. per prompt: what each method's output is checked against."""
    return {(s.tokens, s.round): s.output for s in samples if s.method == RECOMPUTE}

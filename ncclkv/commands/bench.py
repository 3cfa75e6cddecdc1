"""``ncclkv bench``: run the benchmarks, print a table each, save JSON + PNG, regenerate RESULTS.md.

Examples::

    ncclkv bench --quick                 # every benchmark, small sizes (well under a minute)
    ncclkv bench transfer overlap        # full runs of two benchmarks
    ncclkv bench control --repeats 200   # fewer requests

The benchmarks are those of the registry, ``benchmarks._runner.BENCHMARKS``:
``--list`` and ``--help`` name each with its title. Results go to ``--out`` (default
benchmarks/out/, quick runs benchmarks/out/quick/); full runs into the default
folder also rewrite benchmarks/RESULTS.md, other runs write RESULTS.md into
their output folder. The benchmarks live in the source checkout's
``benchmarks/`` folder, next to the ``ncclkv`` package.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

from ._paths import writable_dir

__all__ = ["add_parser", "run"]

_LIST_MARK = "<the benchmark registry>"  # replaced in --help by the registry's names and titles


class _HelpWithBenchmarks(argparse.RawDescriptionHelpFormatter):
    """Lists the benchmarks in the description from the registry, so the help cannot drift from ``--list``.

    Read when help is shown, not when the parser is built: the registry imports torch, and every
    ``ncclkv`` command (``plan`` included) builds this parser.
    """

    def add_text(self, text: str | None) -> None:
        if text is not None and _LIST_MARK in text:
            text = text.replace(_LIST_MARK, _benchmark_lines("  "))
        super().add_text(text)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="run the benchmarks (tables, JSON, PNG, RESULTS.md)",
        description=f"{__doc__}\nBenchmarks:\n\n{_LIST_MARK}\n",
        formatter_class=_HelpWithBenchmarks,
    )
    parser.add_argument("names", nargs="*", metavar="NAME", help="benchmarks to run (default: all)")
    parser.add_argument("--quick", action="store_true", help="small sizes and few repeats: a smoke test")
    parser.add_argument("--out", type=Path, help="folder for NAME.json and NAME.png")
    parser.add_argument("--repeats", type=int, help="timed rounds per measurement (default: each benchmark's own)")
    parser.add_argument("--results", type=Path, help="the RESULTS.md to write (default: see above)")
    parser.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    parser.add_argument("--report-only", action="store_true",
                        help="run nothing: redraw the figures and rewrite RESULTS.md from the JSON in --out")
    parser.set_defaults(run=run)


def _benchmark_lines(indent: str) -> str:
    """``NAME  TITLE`` per benchmark of the registry; in help without the checkout, why there are none."""
    try:
        runner = _runner()
    except ValueError as err:
        if indent:  # --help still shows the options; --list has nothing else to say, so it fails
            return f"{indent}(none: {err})"
        raise
    return "\n".join(f"{indent}{name:10} {runner.load(name).TITLE}" for name in runner.BENCHMARKS)


def _runner() -> ModuleType:
    """``benchmarks._runner`` from the checkout that holds this package."""
    root = Path(__file__).resolve().parents[2]
    if not (root / "benchmarks" / "_runner.py").is_file():
        raise ValueError(f"ncclkv bench needs the source checkout's benchmarks/ folder; none next to {root.name}/ncclkv")
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))  # a console script's sys.path holds the package, not the checkout
    return importlib.import_module("benchmarks._runner")


@contextlib.contextmanager
def _progress(name: str) -> Iterator[Callable[[str], None]]:
    """A live status line (rich) while one benchmark runs; plain lines on stderr without rich."""
    try:
        from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
    except ImportError:
        print(f"running {name} ...", file=sys.stderr, flush=True)
        yield lambda _text: None
        return
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), transient=True) as bar:
        task = bar.add_task(name)
        yield lambda text: bar.update(task, description=text)


def _show(outcome: Any) -> None:
    result = outcome.result
    print(f"\n{result.name}: {result.title}\n")
    print(result.table())
    for line in result.headline:
        print(f"  {line}")
    saved = [outcome.json_path] + ([outcome.png_path] if outcome.png_path else [])
    print("wrote " + ", ".join(str(p) for p in saved))


def _check_outputs(out: Path, results: Path) -> None:
    """``--out`` and ``--results`` can be written, checked before any benchmark runs: a bad path costs nothing
    rather than the runs before it."""
    writable_dir("--out", out)
    writable_dir("--results", results, results.parent)
    if results.exists() and not (results.is_file() and os.access(results, os.W_OK)):
        raise ValueError(f"--results {results}: not a writable file")


def run(args: argparse.Namespace) -> int:
    if args.list:
        print(_benchmark_lines(""))
        return 0
    runner = _runner()
    names = list(dict.fromkeys(args.names)) or list(runner.BENCHMARKS)
    unknown = [n for n in names if n not in runner.BENCHMARKS]
    if unknown:
        raise ValueError(f"unknown benchmark(s) {', '.join(unknown)}; choose from {', '.join(runner.BENCHMARKS)}")
    if args.repeats is not None and args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    common = importlib.import_module("benchmarks._common")
    out = args.out or common.default_out(args.quick)
    path = args.results or runner.results_path(out, args.quick)
    if args.report_only and not any((out / f"{name}.json").is_file() for name in names):
        # In a fresh clone out/ is empty: rewriting RESULTS.md from nothing would drop every section.
        raise ValueError(f"--report-only: no results to present in {out} (no {', '.join(f'{n}.json' for n in names)}); "
                         f"run `ncclkv bench` first; {path} is left as it is")
    _check_outputs(out, path)
    with common.BenchContext(common.BenchOptions(args.quick, args.repeats, out)) as ctx:
        for name in [] if args.report_only else names:  # each gets its own status line and prints its table when done
            with _progress(name) as progress:
                ctx.report_to(progress)
                outcome = runner.run_one(name, ctx)
                ctx.report_to(None)
            _show(outcome)
    main_results = path.resolve() == (common.BENCH_DIR / "RESULTS.md").resolve()  # it also presents the lent machines
    results = runner.write_results_md(path, out, redraw=args.report_only, lent=runner.LENT_DIR if main_results else None)
    print(f"\nwrote {results}")
    return 0

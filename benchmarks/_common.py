"""Shared pieces of the benchmarks: options, timing and statistics, tables, machine facts, JSON and PNG output.

Every benchmark module has ``NAME``, ``TITLE``, ``run(ctx) -> BenchResult`` and
``plot(result, path) -> bool``; :mod:`benchmarks._runner` runs them for
``ncclkv bench`` and each module's ``main(argv)`` runs it alone.
"""

from __future__ import annotations

import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

__all__ = [
    "BENCH_DIR",
    "DEFAULT_OUT",
    "KIB",
    "MIB",
    "QUICK_OUT",
    "BenchContext",
    "BenchOptions",
    "BenchResult",
    "Column",
    "base_meta",
    "code_version",
    "default_out",
    "format_size",
    "format_table",
    "machine_info",
    "percentile",
    "pyplot",
    "run_standalone",
    "save",
    "show_and_save",
    "standalone_command",
    "summary",
    "timed",
    "write_figure",
]

KIB = 1 << 10
MIB = 1 << 20
BENCH_DIR = Path(__file__).resolve().parent
DEFAULT_OUT = BENCH_DIR / "out"
QUICK_OUT = DEFAULT_OUT / "quick"  # quick runs never overwrite the full results


def default_out(quick: bool) -> Path:
    return QUICK_OUT if quick else DEFAULT_OUT


@dataclass(frozen=True, slots=True)
class BenchOptions:
    """What every benchmark takes: ``repeats`` None means the benchmark's own default (quick or full)."""

    quick: bool = False
    repeats: int | None = None
    out: Path = DEFAULT_OUT
    command: str = ""  # the command line that reproduces the run, recorded with the results

    def __post_init__(self) -> None:
        if self.repeats is not None and (not isinstance(self.repeats, int) or self.repeats < 1):
            raise ValueError(f"repeats must be an int >= 1, got {self.repeats!r}")

    def rounds(self, full: int, quick: int) -> int:
        """The number of timed rounds: ``repeats`` if given, else the quick or full default."""
        return self.repeats if self.repeats is not None else (quick if self.quick else full)


class BenchContext:
    """Options, a progress callback, and one spawned peer process shared by the benchmarks of a run.

    The peer starts on the first :meth:`peer` call (spawning imports torch: seconds);
    :meth:`close` stops it.
    """

    def __init__(self, options: BenchOptions, progress: Callable[[str], None] | None = None) -> None:
        self.options = options
        self._progress = progress
        self._peer: Any = None
        gc.freeze()  # as docs/LAUNCH.md asks of a process that runs engines: full collections skip the import heap

    def progress(self, text: str) -> None:
        if self._progress is not None:
            self._progress(text)

    def report_to(self, progress: Callable[[str], None] | None) -> None:
        """Send later progress lines to ``progress`` (e.g. one status line per benchmark)."""
        self._progress = progress

    def peer(self) -> Any:
        """The shared :class:`benchmarks._peer.PeerProcess`, started now if needed."""
        if self._peer is None or not self._peer.alive:
            from ._peer import PeerProcess  # spawning machinery only for the benchmarks that need it

            self.progress("starting the peer process")
            self._peer = PeerProcess()
        return self._peer

    def close(self) -> None:
        if self._peer is not None:
            self._peer.close()
            self._peer = None

    def __enter__(self) -> BenchContext:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


@dataclass(frozen=True, slots=True)
class Column:
    """One table column: the row key, its header, a ``str.format`` spec for the value, and ``<`` or ``>`` alignment."""

    key: str
    header: str
    fmt: str = "{:.2f}"
    align: str = ">"

    def __post_init__(self) -> None:
        if self.align not in ("<", ">"):
            raise ValueError(f"column {self.key!r}: align must be '<' or '>', got {self.align!r}")

    def cell(self, row: dict[str, Any]) -> str:
        value = row.get(self.key)
        if value is None:
            return "-"
        if isinstance(value, str):
            return value
        return self.fmt.format(value)


@dataclass(slots=True)
class BenchResult:
    """One benchmark's outcome: rows, how to show them, and what they mean.

    ``headline`` lines are computed from the numbers (ratios, goals met or not);
    ``analysis`` is the standing explanation of the mechanisms, in Markdown.
    """

    name: str
    title: str
    columns: tuple[Column, ...]
    rows: list[dict[str, Any]]
    meta: dict[str, Any] = field(default_factory=dict)
    headline: list[str] = field(default_factory=list)
    analysis: str = ""

    def table(self) -> str:
        return format_table(self.columns, self.rows)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "title": self.title,
            "meta": self.meta,
            "columns": [[c.key, c.header, c.fmt, c.align] for c in self.columns],
            "results": self.rows,
            "headline": self.headline,
            "analysis": self.analysis,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> BenchResult:
        """The inverse of :meth:`to_json`; ValueError naming the missing key."""
        try:
            columns = tuple(Column(*c) for c in data["columns"])
            return cls(data["name"], data["title"], columns, list(data["results"]), dict(data.get("meta", {})),
                       list(data.get("headline", [])), str(data.get("analysis", "")))
        except (KeyError, TypeError) as err:
            raise ValueError(f"not a benchmark result (missing or bad {err}): keys {sorted(data)}") from None


def timed(fn: Callable[[], object], device: torch.device | None = None) -> float:
    """Seconds ``fn()`` takes (on CUDA, with the device synchronised before and after)."""
    cuda = device is not None and device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if cuda:
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def percentile(samples: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation between closest ranks."""
    if not samples:
        raise ValueError("percentile of no samples")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    ordered = sorted(samples)
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def summary(samples: Sequence[float]) -> dict[str, float]:
    """``min``, ``median``, ``p99``, ``max`` and ``count`` of the samples."""
    if not samples:
        raise ValueError("summary of no samples")
    return {
        "min": min(samples),
        "median": statistics.median(samples),
        "p99": percentile(samples, 99),
        "max": max(samples),
        "count": float(len(samples)),
    }


def format_size(nbytes: float) -> str:
    """``65536`` -> ``"64 KiB"``, ``4194304`` -> ``"4 MiB"``."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", MIB), ("KiB", KIB)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes:g} B"


def format_table(columns: Sequence[Column], rows: Iterable[dict[str, Any]]) -> str:
    """A Markdown pipe table, aligned so it also reads well in a terminal."""
    cells = [[c.header for c in columns]] + [[c.cell(row) for c in columns] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]

    def pad(text: str, width: int, column: Column) -> str:
        return text.ljust(width) if column.align == "<" else text.rjust(width)

    lines = ["| " + " | ".join(pad(t, w, c) for t, w, c in zip(line, widths, columns)) + " |" for line in cells]
    rule = [(":" + "-" * (w + 1)) if c.align == "<" else ("-" * (w + 1) + ":") for w, c in zip(widths, columns)]
    lines.insert(1, "|" + "|".join(rule) + "|")
    return "\n".join(lines)


def _cpu_model(cpuinfo: str) -> str:
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() in ("model name", "Model", "cpu model", "Processor"):
            return value.strip()
    return platform.processor() or platform.machine()


def code_version() -> str:
    """``git describe --always --dirty`` of the checkout the benchmarks run from, or ``unknown`` outside one.

    Read without optional locks (``--no-optional-locks``): describing the tree must not touch its index."""
    try:
        done = subprocess.run(["git", "--no-optional-locks", "describe", "--always", "--dirty"], cwd=BENCH_DIR,
                              capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return done.stdout.strip() if done.returncode == 0 and done.stdout.strip() else "unknown"


def machine_info() -> dict[str, Any]:
    """CPU model, core counts, load, memory, torch and Python versions, the time, and the code: where a number
    came from."""
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        cpuinfo = ""
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count() or 0
    info: dict[str, Any] = {
        "cpu": _cpu_model(cpuinfo),
        "cores": os.cpu_count(),
        "usable_cores": usable,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "os": f"{platform.system()} {platform.release()}",
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "code": code_version(),
    }
    if hasattr(os, "getloadavg"):
        info["loadavg_1m"] = round(os.getloadavg()[0], 2)
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def pyplot() -> ModuleType | None:
    """matplotlib's pyplot on the Agg backend, or None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def write_figure(plt: ModuleType, fig: Any, path: Path) -> bool:
    """Lay out, write ``path`` as a PNG and release ``fig``; True, as a benchmark's ``plot`` returns."""
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def base_meta(opts: BenchOptions) -> dict[str, Any]:
    """What every result records first: the machine, the command that reproduces it, quick or full."""
    return {"machine": machine_info(), "command": opts.command, "quick": opts.quick}


def save(
    result: BenchResult, out: Path, plot: Callable[[BenchResult, Path], bool] | None = None
) -> tuple[Path, Path | None]:
    """Write ``<out>/<name>.json`` and, when ``plot`` draws one, ``<out>/<name>.png``; return both paths."""
    out.mkdir(parents=True, exist_ok=True)
    json_path = out / f"{result.name}.json"
    json_path.write_text(json.dumps(result.to_json(), indent=1))
    png_path = out / f"{result.name}.png"
    png_path.unlink(missing_ok=True)  # an older run's figure must not stand beside this run's table
    if plot is not None and plot(result, png_path):
        return json_path, png_path
    return json_path, None


def run_standalone(
    run: Callable[[BenchContext], BenchResult], plot: Callable[[BenchResult, Path], bool], options: BenchOptions
) -> int:
    """A module's ``main``: run, print the table and findings, save JSON and PNG into ``options.out``."""
    with BenchContext(options, progress=print) as ctx:
        result = run(ctx)
    return show_and_save(result, options.out, plot)


def show_and_save(result: BenchResult, out: Path, plot: Callable[[BenchResult, Path], bool] | None) -> int:
    """Print the table and findings, write JSON (and PNG when ``plot`` is given) into ``out``; exit code 0."""
    print(result.table())
    print("\n".join(result.headline))
    json_path, png_path = save(result, out, plot)
    print(f"wrote {json_path}" + (f" and {png_path}" if png_path else ""))
    return 0


def standalone_command(module: str, argv: Sequence[str] | None) -> str:
    """The command line that reproduces a ``python -m benchmarks.<module>`` run.

    ``--out`` is left out, as in :func:`~benchmarks._runner.command_for`: where the
    files went is the runner's machine, not part of what reproduces the numbers."""
    args = list(sys.argv[1:] if argv is None else argv)
    kept: list[str] = []
    skip = False
    for arg in args:
        if skip:
            skip = False
        elif arg == "--out":
            skip = True
        elif not arg.startswith("--out="):
            kept.append(arg)
    return " ".join([f"python -m benchmarks.{module}", *kept])

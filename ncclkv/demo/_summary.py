"""The demo's results as values, the checks that decide its exit code, and its summary table.

Pure: no engines, no vLLM. The table is rows of text cells; :func:`format_plain`
lays them out in aligned columns, :mod:`ncclkv.demo._progress` hands them to
rich when it is installed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from statistics import fmean, median

__all__ = ["DemoReport", "PhaseResult", "Table", "format_plain", "summary_table"]

DASH = "-"


@dataclass(frozen=True, slots=True)
class PhaseResult:
    """One batch of requests through one set-up: a single engine, or prefill + decode in a transfer mode.

    ``ttft_s`` is what the client sees per request: the single engine's TTFT,
    or the prefill engine's plus the decode engine's. ``kv_wait_s`` is how long
    each request waited on the decode side before it was first scheduled
    (vLLM's queued -> scheduled time: for an async pull, the wait for its KV).
    ``kv_bytes`` and ``transfers_failed`` are the decode engine's connector
    counters over the batch.
    """

    name: str
    outputs: tuple[tuple[int, ...], ...]
    ttft_s: tuple[float, ...]
    wall_s: float
    mode: str | None = None  # None: the single engine; else "pull" or "push"
    prefill_ttft_s: tuple[float, ...] = ()
    decode_ttft_s: tuple[float, ...] = ()
    kv_wait_s: tuple[float, ...] = ()
    kv_bytes: int = 0
    transfers_failed: int = 0
    prefill_left: int = 0  # requests the prefill engine still held after the batch (blocks not released)


@dataclass(frozen=True, slots=True)
class DemoReport:
    """Every batch one demo run sent, in order; the first single-engine batch is the reference.

    The same batch runs ``rounds`` times through each set-up, interleaved, so
    that a busy machine slows every set-up alike; the table shows medians."""

    lengths: tuple[int, ...]
    gen_tokens: int
    bytes_per_token: int  # KV bytes of one token, all layers and kv-heads
    phases: tuple[PhaseResult, ...]
    # How each engine that did not exit cleanly once asked to close ended (close_all): a crash or a hang in an
    # engine's shutdown (the connector's included) is a failed run, however right its outputs were.
    shutdown: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not any(p.mode is None for p in self.phases):
            raise ValueError("a DemoReport needs at least one single-engine batch (the reference)")

    @property
    def reference(self) -> PhaseResult:
        return next(p for p in self.phases if p.mode is None)

    @property
    def expected_kv_bytes(self) -> int:
        """Every prompt token's KV crosses once per batch."""
        return sum(self.lengths) * self.bytes_per_token

    def setups(self) -> dict[str, list[PhaseResult]]:
        """Batches by set-up name, single engine first, then in order of appearance."""
        grouped: dict[str, list[PhaseResult]] = {self.reference.name: []}
        for phase in self.phases:
            grouped.setdefault(phase.name, []).append(phase)
        return grouped

    def num_equal(self, phase: PhaseResult) -> int:
        return sum(a == b for a, b in zip(phase.outputs, self.reference.outputs))

    def problems(self) -> list[str]:
        """Why the run failed; empty when every check passed.

        Equal outputs alone would not prove a transfer (vLLM recomputes a
        failed load), so the bytes received and the failure count are checked too."""
        found = []
        expected, reference = len(self.lengths), self.reference
        for index, phase in enumerate(self.phases, 1):
            what = f"batch {index} ({phase.name})"
            if len(phase.outputs) != expected or any(len(o) != self.gen_tokens for o in phase.outputs):
                found.append(f"{what}: expected {expected} outputs of {self.gen_tokens} tokens, got "
                             f"{[len(o) for o in phase.outputs]}")
                continue
            differ = [i for i, (a, b) in enumerate(zip(phase.outputs, reference.outputs)) if a != b]
            if differ:
                found.append(f"{what}: outputs of requests {differ} differ from the single engine's")
            if phase.mode is None:
                continue
            if phase.transfers_failed:
                found.append(f"{what}: {phase.transfers_failed} KV loads failed (vLLM recomputed them)")
            if phase.kv_bytes != self.expected_kv_bytes:
                found.append(f"{what}: the decode engine received {phase.kv_bytes} KV bytes, expected "
                             f"{self.expected_kv_bytes} ({sum(self.lengths)} tokens x {self.bytes_per_token})")
            if phase.prefill_left:
                found.append(f"{what}: the prefill engine still holds {phase.prefill_left} requests")
        found.extend(f"at shutdown: the {line}" for line in self.shutdown)
        return found


@dataclass(frozen=True, slots=True)
class Table:
    header: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]


def summary_table(report: DemoReport) -> Table:
    """Rows of metrics, one column per set-up (single engine first); times are medians over the rounds."""
    setups = report.setups()
    columns = list(setups.values())

    def row(label: str, cell: Callable[[list[PhaseResult]], str], single: str | None = None) -> tuple[str, ...]:
        return (label, *(single if single is not None and runs[0].mode is None else cell(runs) for runs in columns))

    def median_ms(name: str) -> Callable[[list[PhaseResult]], str]:
        def cell(runs: list[PhaseResult]) -> str:
            means = [fmean(getattr(p, name)) for p in runs if getattr(p, name)]
            return f"{1000 * median(means):.1f} ms" if means else DASH
        return cell

    n = len(report.lengths)

    def equal(runs: list[PhaseResult]) -> str:  # the reference batch itself is no comparison
        compared = [p for p in runs if p is not report.reference]
        return f"{sum(map(report.num_equal, compared))}/{n * len(compared)}" if compared else "reference"

    rows = (
        row("requests / batch", lambda runs: str(len(runs[0].outputs))),
        row("prompt tokens / batch", lambda runs: str(sum(report.lengths))),
        row("generated tokens / batch", lambda runs: str(sum(len(o) for o in runs[0].outputs))),
        row("outputs equal to single engine", equal),
        row("KV bytes moved / batch", lambda runs: _bytes(runs[0].kv_bytes), DASH),
        row("KV throughput", _throughput, DASH),
        row("exposed KV wait / request", median_ms("kv_wait_s"), DASH),
        row("TTFT / request (client)", median_ms("ttft_s")),
        row("  prefill engine", median_ms("prefill_ttft_s"), DASH),
        row("  decode engine, after prefill", median_ms("decode_ttft_s"), DASH),
        row("batch wall time", lambda runs: f"{median(p.wall_s for p in runs):.2f} s"),
    )
    return Table(("", *setups), rows)


def format_plain(table: Table) -> str:
    """Aligned columns: the label left, values right."""
    lines = [table.header, *table.rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(table.header))]
    out = []
    for index, line in enumerate(lines):
        cells = [line[0].ljust(widths[0])] + [cell.rjust(w) for cell, w in zip(line[1:], widths[1:])]
        out.append("  ".join(cells).rstrip())
        if index == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def _bytes(n: int) -> str:
    return f"{n / 1e6:.2f} MB"


def _throughput(runs: list[PhaseResult]) -> str:
    """A pull's bytes over the decode side's wait for the whole batch (median); a push overlaps the prefill."""
    if runs[0].mode == "push":
        return "overlapped"
    rates = [p.kv_bytes / max(p.kv_wait_s) for p in runs if p.kv_wait_s and max(p.kv_wait_s) > 0 and p.kv_bytes]
    return f"{median(rates) / 1e9:.3f} GB/s" if rates else DASH

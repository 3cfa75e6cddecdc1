"""Layer-wise sending against sending after compute: the transfer time a synthetic prefill leaves exposed.

A prefill of L layers: each layer computes for c ms (a matmul loop calibrated on
one thread) and produces a KV slice sized so that moving it (gather -> Link ->
scatter, the ncclkv path of bench_transfer) takes x ms. Layer-wise sending
gathers and sends layer l right after computing it, asynchronously; the
baseline computes all layers, then sends them all. Exposed time = when the
receiver has the last layer scattered minus when the last layer's compute
ended, in units of x (the per-layer transfer time measured alone in the same
round). Ideal layer-wise: about 1 (the last layer); baseline: about L.

Two paths: ``link`` rows time that gather -> Link -> scatter pipeline (with
``--chunk-kib`` token chunks); ``engine push`` rows time the product, a real
producer TransferEngine pushing the request to a consumer engine in the peer
(``start_push``, ``save_layer`` after each layer's compute, ``finish``), one
row set per ``--engine-pieces P:L`` (KiB): the producer's ``piece_bytes`` P
(every layer) and ``last_piece_bytes`` L (a route's last layer; the engine's
default: both 0, whole layers); x is then the engine's own per-layer time.
Every mode of each row's last timed round is checked: the receiver's cache
scrambled before it, every layer's hash compared with the sender's after it.

    python -m benchmarks.bench_overlap [--quick] [--layers L] [--compute-ms C ...] [--transfer-ms X]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from ncclkv.engine import DEFAULT_LAST_PIECE_BYTES
from ncclkv.transport import DataPlane

from ._common import (
    BenchContext, BenchOptions, BenchResult, Column, base_meta, default_out, format_size, pyplot, run_standalone,
    standalone_command, write_figure,
)
from ._engine_path import CONSUMER_ID, EngineSender
from ._overlap_runs import ENGINE_MODES, MODES, Busy, calibrate_slice, chunked, engine_scenario, scenario
from ._transfer_paths import WAIT_S, BytesDiffer, PagedSide, Sender, SliceCase, raw_group

__all__ = ["NAME", "TITLE", "OverlapParams", "main", "plot", "run"]

NAME = "overlap"
TITLE = "Layer-wise sending: transfer time exposed after the last layer's compute"
GOAL_LAYERS = 1.2


@dataclass(frozen=True, slots=True)
class OverlapParams:
    num_layers: int = 16
    compute_ms: tuple[float, ...] = (5.0, 10.0, 20.0, 30.0)  # x is calibrated to 10 ms: two rows judge c >= x
    transfer_ms: float = 10.0
    matmul_size: int = 192
    chunk_bytes: tuple[int, ...] = (0, 2 << 20, 4 << 20)  # each layer in token chunks of about this size; 0: whole
    # The engine path: (piece_bytes, last_piece_bytes) of its producer, a row set each: whole layers (the default),
    # whole with the last layer in pieces, every layer in pieces.
    engine_pieces: tuple[tuple[int, int], ...] = ((0, 0), (0, 4 << 20), (4 << 20, 4 << 20))

    @classmethod
    def quick(cls) -> OverlapParams:
        # Each path once whole and once in pieces: quick slices are about 4 MiB, so 1 MiB pieces make about 4.
        return cls(num_layers=6, compute_ms=(4.0,), transfer_ms=4.0, chunk_bytes=(0, 1 << 20),
                   engine_pieces=((0, DEFAULT_LAST_PIECE_BYTES), (1 << 20, 1 << 20)))  # first: the engine's default


RunMode = Callable[[str, Callable[[], None]], tuple[float, float, float]]


class _ByteCheck:
    """What a mode's round left in the receiver's cache: random bytes there before the round (outside its timed
    interval), the layers' hashes compared with the sender's after it. ``single`` sends the last layer alone.

    ``sender``: a link row's :class:`Sender`, whose wire buffers get random bytes too: they were filled with the
    gathered slices when it was made, so a round that sent them without gathering would deliver the right bytes."""

    def __init__(self, peer: Any, expected: list[str], what: str, sender: Sender | None = None) -> None:
        self.peer, self.expected, self.what, self.sender = peer, expected, what, sender

    def before(self) -> None:
        if self.sender is not None:
            self.sender.scramble("wires")
        self.peer.endpoint.send("scramble")
        self.peer.endpoint.expect("scrambled")

    def after(self, mode: str, c_ms: float) -> None:
        self.peer.endpoint.send("digests")
        got = self.peer.endpoint.expect("digests")
        layers = slice(-1, None) if mode == "single" else slice(None)
        if got[layers] != self.expected[layers]:
            bad = [i for i, (a, b) in enumerate(zip(got, self.expected)) if a != b and (mode != "single" or
                                                                                    i == len(got) - 1)]
            raise BytesDiffer(f"{self.what}, c={c_ms:g} ms, {mode} round: layers {bad} of the receiver's cache "
                              "differ from the sender's after the round")


_BYTE_MODES = ("transfer", "single", "layerwise", "after")  # the modes that move bytes ("compute" moves none)


def _config(c_ms: float, case: SliceCase, path: str, run_mode: RunMode, modes: Sequence[str], busy: Busy,
            repeats: int, ctx: BenchContext, check: _ByteCheck | None = None) -> dict[str, Any]:
    """One row: every mode of one path, ``repeats`` rounds (after a warm-up), modes interleaved per round.

    ``check``: the bytes of every mode of the last timed round are checked (a fast but wrong path must not look
    good); the check's scramble and hashes run between rounds, outside what is timed."""
    compute = busy.for_ms(c_ms)
    samples: dict[str, list[tuple[float, float, float]]] = {m: [] for m in modes}
    for rep in range(repeats + 1):
        ctx.progress(f"{NAME}: {path}, c={c_ms:g} ms, {len(case.chunks())} piece(s) per layer, round {rep}/{repeats}")
        for mode in modes:
            checked = check is not None and rep == repeats and mode in _BYTE_MODES
            if checked:
                check.before()
            result = run_mode(mode, compute)
            if checked:
                check.after(mode, c_ms)
            if rep:
                samples[mode].append(result)
    layers = case.num_layers
    c_alone = [(end - start) / layers for start, end, _ in samples["compute"]]
    x_alone = [(done - start) / layers for start, _, done in samples["transfer"]]
    single = [(done - start) / x for (start, _, done), x in zip(samples.get("single", []), x_alone)]
    row: dict[str, Any] = {
        "path": path, "layers": layers, "c_target_ms": c_ms, "slice_bytes": case.num_tokens * case.token_bytes,
        "chunks": _pieces(case),
        "single_layer_x": statistics.median(single) if single else None,
        "c_ms": 1e3 * statistics.median(c_alone), "x_ms": 1e3 * statistics.median(x_alone),
    }
    for mode in ("layerwise", "after"):
        # Each round's exposure in units of that round's x: both saw the same load.
        exposed = [(done - end) / x for (_, end, done), x in zip(samples[mode], x_alone)]
        total = [(done - start) for start, _, done in samples[mode]]
        compute_span = [(end - start) / layers for start, end, _ in samples[mode]]
        row[f"{mode}_exposed_median"] = statistics.median(exposed)
        row[f"{mode}_exposed_min"] = min(exposed)
        row[f"{mode}_total_ms"] = 1e3 * statistics.median(total)
        row[f"{mode}_compute_slowdown"] = statistics.median(compute_span) / statistics.median(c_alone)
    row["c_over_x"] = row["c_ms"] / row["x_ms"]
    row["speedup"] = row["after_total_ms"] / row["layerwise_total_ms"]
    return row


COLUMNS = (
    Column("path", "path", align="<"),
    Column("layers", "L", "{:d}"),
    Column("chunks", "sent as"),
    Column("c_ms", "c ms"),
    Column("x_ms", "x ms"),
    Column("c_over_x", "c/x"),
    Column("single_layer_x", "1 layer alone (x)"),
    Column("layerwise_exposed_median", "layer-wise exposed (x)"),
    Column("layerwise_exposed_min", "min"),
    Column("after_exposed_median", "after-compute exposed (x)"),
    Column("layerwise_compute_slowdown", "compute slowdown"),
    Column("layerwise_total_ms", "layer-wise total ms", "{:.1f}"),
    Column("after_total_ms", "after total ms", "{:.1f}"),
    Column("speedup", "speed-up"),
)

ANALYSIS = """\
This run's numbers are in the findings above (computed from its table: per
path and grouping, the layers exposed and `1 layer alone` where c >= x);
what follows explains them, with numbers from dated earlier runs.

Two effects set the exposed time.

The last layer's latency. After the last compute, that layer's slice is still
gathered, sent and scattered. `1 layer alone` is that latency in units of x
(x: the per-layer time of a pipelined stream of layers). A whole layer goes
through the three steps one after the other: in four runs on the EPYC up to
2026-11-24, 1.05-1.35 x alone and 1.35-1.5 layers exposed when c >= x, the
goal never met (more on the Xeon of 2026-11-26: 1.41-1.55 x alone over every
row, 1.57-1.63 layers exposed at c >= x). Token chunks pipeline the steps within the layer: 1.03-1.27 x alone
in those EPYC runs. What a chunk costs
besides its bytes is the link's per-message latency: a round trip of one tensor and an 8-byte reply
takes about 5x raw gloo's at 64 KiB and 2x at 1-4 MiB (bench transfer's
findings): a gloo receiver posts a payload only once its frame header arrived
and was checked, and each landed tensor wakes the link's reaper thread. Until
2026-11-24 each send also woke the link's poster thread, which on these two busy
cores waited 0.2-2 ms for a core before posting (traced per chunk: chunks sat
gathered while the wire was idle); sends without a hook are now posted on the
caller's thread (docs/ARCHITECTURE.md, Threads). Before that change chunked
layers exposed 1.35-1.9 layers (the goal met in no row of two runs, 1, 2 and
4 MiB chunks tried). With it, on 2026-11-24 04:31, 4 MiB chunks met the goal
in both rows and in 5 of 8 rows over that run and three development runs the
same morning (1.00-1.44 layers, median of 5-9 rounds each); 2 MiB chunks pay
the per-message cost twice as often (1.18-1.31). A slower machine that
afternoon (memcpy and the gather kernel at about half their morning speed,
see bench transfer) gave 4 MiB chunks 1.48 and 1.51, 2 MiB 1.23 and 1.29,
whole layers 1.46 and 1.68. On 2026-11-25, with a fourth compute row (30
ms, so that at least two rows have c >= x whatever the calibration gives),
two runs gave 4 MiB chunks 1.18-1.53, 2 MiB 1.22-1.54 and whole layers
1.47-1.79 at c >= x. Exposure moves by 0.3 layer and more between runs on
a shared machine, and between rows of one run; the findings above count
this run's rows.

The engine rows. A real producer engine pushing to a real consumer engine
(the product's path, the connector's `save_kv_layer`). Until the run of
2026-11-24 22:51 the engine exposed 1.48-1.57 layers with whole layers and 1.47-1.51 with 4 MiB
pieces (`piece_bytes`) at c >= x, in three runs: the link rows' behaviour
plus the engine's own hops after the last layer's compute. Traced per
event on the EPYC (a 14 MiB layer, nothing else running): the link's
poster thread took the last layer 0.3-0.8 ms after it was saved, gathered
it (1.9 ms), then announced it; the consumer's dispatcher posted the
receive 0.9 ms after the gather had ended, and gloo's sender waited for
that receive before writing a byte. Three changes since
(docs/ARCHITECTURE.md, Message flow and Threads): the producer announces
each piece before gathering it and the link sends its frame header before
the gather (`Link.send`'s `fill`), so the consumer's receive is posted
during the gather (traced: 0.9 ms before it ends); the header of the next
queued piece goes ahead of this piece's bytes (on one TCP stream it reached
the consumer only after them, and that piece's bytes then waited a round
trip: a bubble per piece); and `finish` (the connector's `wait_for_save`)
posts the last layer's sends from its caller instead of waiting for the
poster to be scheduled. On the evening of 2026-11-24 4 MiB pieces exposed
1.14 layers at c/x 1.68, the first engine row to meet the goal, and whole
layers 1.48 (one row each with c >= x: the calibration gave x of 9-12 ms,
so the 5 and 10 ms compute rows fell below x); the run an hour before,
without the header look-ahead, gave 1.22-1.23 in pieces and 1.49-1.52
whole. Since 2026-11-25 the next piece's hook (take its wire buffer,
announce it) also runs before this piece's gather, so the consumer has the
next piece's announcement as well as its header while this piece is on the
wire: A/B the same hour, old and new code in turn, 20 and 30 ms compute, 4
MiB pieces, eight rows each: 1.04-1.34 layers exposed, median 1.15, with
it; 1.13-1.46, median 1.23, without. Full runs that day: 1.14 and 1.14
(before that change, the 20 and 30 ms rows) and, in the last EPYC run,
1.13-1.32 in pieces and 1.42-1.68 whole at c >= x: met in one row of
three in pieces. So the engine in 4 MiB pieces sits at the goal, within a
2-core machine's noise, and whole layers do not. A/B of the last layer's latency after its
compute (a tracing script, the code before these changes and after them run
in turn, 16 layers of 14 MiB, 20 ms compute, medians of 5-7 requests per
run): whole layers 12.3-15.6 ms before over five runs, 10.5-11.7 ms after
over five; 4 MiB pieces 12.1-14.8 before, 11.5-12.7 after (two runs of the
final code); the machine's noise is as large as the gain in pieces. A whole layer cannot
meet the goal on two cores: its gather, its 14 MiB on the wire (5.3-6.2 ms for one
message over loopback gloo, 0.8 x) and its scatter run one after the other,
about 1.3 x before any hop. The engine's x is higher than the link rows'
(the Announce, the receive posted from the dispatcher, the done-callbacks:
see bench transfer, engine/ncclkv), which flatters its ratio a little; in
pieces its x grows more (one Announce and receive per piece).

On the 2-core Xeon (2026-11-26), with the engine's run-ahead of
announcements (bench transfer), the engine in 4 MiB pieces exposed 1.16 and
1.24 layers at c >= x (met in one row of two), 1.08-1.12 in a run an hour
before (three of three), 1.12 and 1.20 in a third with 15 repeats; whole
layers 1.29-1.44 over the three runs. The engine rows now also send whole
layers with only the last one in pieces (`last_piece_bytes`): after the
forward only that layer is left, and the layers before it hide behind
compute, where pieces cost messages and buy nothing. On that Xeon it did worse than
whole layers: 1.47-1.63 with 4 MiB pieces over two runs, 1.56-1.68 with 2
MiB. Traced (the last layer's gathers and posts, old and new settings in
turn, 17 MiB layers, 20 ms compute, medians of 7 requests): done 12.2-12.9
ms after the last compute with the last layer in pieces, 10.6-12.3 whole,
10.6-12.1 with every layer in pieces; the last layer's five gathers took
3.7-4.3 ms in all against 2.6-2.9 for the same bytes when every layer goes
in pieces. Their wire buffers are the difference: a piece-sized buffer is
used once a request and comes back cold (in every-layer pieces the same
ones are reused layer after layer), on the consumer too. On two cores the
last layer's four copies (gather, gloo's write and read, scatter: about
10.6 ms of CPU for 17 MiB) cannot take less than half that anyway, so
`last_piece_bytes` stays 0 (whole) by default; these rows are there to
measure it where the copies have cores of their own.

Two cores. Compute (one torch thread), the sender's gather and gloo thread, and
the receiver's gloo thread and scatter share two cores, with other engineers'
jobs. While sending, compute slows down (`compute slowdown`: the forward's
time per layer while sending over compute alone, 1.1-3.2x in the runs up to
2026-11-26; in link rows that
time includes each layer's gather, which runs on the compute thread after the
layer, about 3 ms for a 16.5 MiB layer at 5.5 GB/s and most of the slowdown
at large c; engine rows gather on the link's poster thread) and the transfer
meant to hide behind it stretches too, so layer-wise sending finished only
about 0.8-1.35x sooner than sending after compute in those runs (chunked
layers least: they compete hardest), although exposure drops from about L to
about 1 layer. With c < x the backlog would grow by (x - c) per layer, towards
L(1 - c/x) + 1 layers exposed; on two cores compute's slowdown shrinks the backlog.
Where the transfer has its own cores (or a GPU: kernels on the SMs, NCCL
copies alongside) the slowdown goes and layer-wise sending saves about (L - 1) x.
"""


def _group(row: dict[str, Any]) -> str:
    # Rows of JSON written before the engine's last-layer pieces have no group: whole iff one piece a layer.
    return row.get("group") or ("whole layers" if row["chunks"].split(" x ")[0] == "1" else "in pieces")


def _ranges(rows: list[dict[str, Any]]) -> list[str]:
    """Per path and grouping, over the rows with c >= x: layers exposed and one layer alone, low-high."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        if r["c_over_x"] >= 1:
            groups.setdefault((r.get("path", "link"), _group(r)), []).append(r)

    def span(values: list[float]) -> str:
        return f"{min(values):.2f}" if min(values) == max(values) else f"{min(values):.2f}-{max(values):.2f}"

    parts = []
    for (path, group), mine in groups.items():
        text = f"{path}, {group}: {span([r['layerwise_exposed_median'] for r in mine])} layers exposed"
        alone = [r["single_layer_x"] for r in mine if r.get("single_layer_x") is not None]
        parts.append(text + (f", 1 layer alone {span(alone)} x" if alone else ""))
    return parts


def _headline(rows: list[dict[str, Any]]) -> list[str]:
    judged: dict[tuple[str, bool], list[bool]] = {}
    for r in rows:
        if r["c_over_x"] >= 1:
            met = r["layerwise_exposed_median"] <= GOAL_LAYERS
            judged.setdefault((r.get("path", "link"), _group(r)), []).append(met)
    lines = []
    if judged:
        order = ("whole layers", "whole, the last layer in pieces", "in pieces")
        parts = [f"{path}, {group}: met in {sum(v)} of {len(v)} rows"
                 for (path, group), v in sorted(judged.items(), key=lambda kv: (kv[0][0] != "link", order.index(kv[0][1])))]
        lines.append(f"goal <= {GOAL_LAYERS} layers exposed when c >= x (median): " + "; ".join(parts))
        lines.append("this run, c >= x (median): " + "; ".join(_ranges(rows)))
    for r in rows:
        verdict = ""
        if r["c_over_x"] >= 1:
            verdict = f" (goal <= {GOAL_LAYERS}: {'met' if r['layerwise_exposed_median'] <= GOAL_LAYERS else 'NOT met'})"
        single = "" if r.get("single_layer_x") is None else f"; one layer alone takes {r['single_layer_x']:.2f} x"
        lines.append(
            f"{r.get('path', 'link')}, sent as {r['chunks']}, c={r['c_ms']:.1f} ms, x={r['x_ms']:.1f} ms "
            f"(c/x {r['c_over_x']:.2f}): layer-wise exposes {r['layerwise_exposed_median']:.2f} layers{verdict}, "
            f"after-compute {r['after_exposed_median']:.2f}; compute slowed {r['layerwise_compute_slowdown']:.2f}x "
            f"while sending{single}"
        )
    return lines


def plot(result: BenchResult, path: Path) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for group in dict.fromkeys((r.get("path", "link"), r["chunks"]) for r in result.rows):
        rows = sorted((r for r in result.rows if (r.get("path", "link"), r["chunks"]) == group),
                      key=lambda r: r["c_over_x"])
        ratio, label = [r["c_over_x"] for r in rows], f"{group[0]}, {group[1]}"
        left.plot(ratio, [r["layerwise_exposed_median"] for r in rows], marker="o", label=f"layer-wise, {label}")
        left.plot(ratio, [r["after_exposed_median"] for r in rows], marker="s", linestyle=":", label=f"after compute, {label}")
        right.plot(ratio, [r["layerwise_compute_slowdown"] for r in rows], marker="o", label=label)
    left.axhline(GOAL_LAYERS, color="grey", linestyle="--", linewidth=1, label=f"goal {GOAL_LAYERS} (c >= x)")
    left.set(title="transfer exposed after the last compute", xlabel="c / x", ylabel="layers (units of x)", yscale="log")
    values = [r[k] for r in result.rows for k in ("layerwise_exposed_median", "after_exposed_median")] + [GOAL_LAYERS]
    ticks = [t for t in (0.125, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128) if min(values) / 2 <= t <= 2 * max(values)]
    left.minorticks_off()
    left.set_yticks(ticks, [f"{t:g}" for t in ticks])
    right.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    right.set(title="compute slowdown while sending layer-wise", xlabel="c / x", ylabel="x compute alone")
    left.legend(fontsize=7)
    right.legend(fontsize=7)
    return write_figure(plt, fig, path)


def run(ctx: BenchContext, params: OverlapParams | None = None) -> BenchResult:
    opts = ctx.options
    params = params or (OverlapParams.quick() if opts.quick else OverlapParams())
    repeats = opts.rounds(full=9, quick=2)  # a busy shared machine: exposure moves by +-0.3 layer between runs
    peer = ctx.peer()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # compute on one core, as an engine pins its threads
    rows: list[dict[str, Any]] = []
    link_id = f"bench-overlap-{uuid.uuid4().hex[:8]}"
    try:
        busy = Busy(params.matmul_size)
        with DataPlane() as plane:
            peer.start("benchmarks._transfer_paths:receiver_loop", store=plane.address, link_id=link_id,
                       threads=1, copy_threads=1, in_flight=None)
            link = plane.open_link(link_id, 0, plane.address, "cpu", WAIT_S)
            pg = raw_group(plane.address, 0, f"raw/{link_id}")

            def make_sender(case: SliceCase) -> Sender:
                peer.endpoint.send("case", {f: getattr(case, f) for f in SliceCase.__slots__})
                peer.endpoint.expect("ready")
                return Sender(case, link, pg)

            try:
                ctx.progress(f"{NAME}: calibrating the slice size")
                case = calibrate_slice(make_sender, peer, params.transfer_ms, params.num_layers)
                for chunk_bytes in params.chunk_bytes:
                    layer_case = chunked(case, chunk_bytes)
                    sender = make_sender(layer_case)

                    def link_mode(mode: str, compute: Callable[[], None], sender: Sender = sender) -> tuple[float, float, float]:
                        return scenario(mode, sender, compute, peer)

                    check = _ByteCheck(peer, sender.digests(), f"link, sent as {_pieces(layer_case)}", sender)
                    rows += [_config(c, layer_case, "link", link_mode, MODES, busy, repeats, ctx, check)
                             for c in params.compute_ms]
                    del sender, link_mode  # free its buffers before the next case's
            finally:
                peer.endpoint.send("end")
                peer.result()
            link.close()
        if params.engine_pieces:
            rows += _engine_rows(case, params, busy, repeats, peer, ctx)
    finally:
        torch.set_num_threads(threads)
    meta = {
        **base_meta(opts), "repeats": repeats,
        "num_layers": params.num_layers, "compute_ms": list(params.compute_ms), "transfer_ms": params.transfer_ms,
        "chunk_bytes": list(params.chunk_bytes),
        "matmul": f"{params.matmul_size}x{params.matmul_size} float32, 1 torch thread",
        "engine_pieces": ", ".join(f"{format_size(p) if p else 0}/{format_size(last) if last else 0}"
                                   for p, last in params.engine_pieces) + " (piece_bytes/last_piece_bytes)",
        "path": "link: gather (CPU layout, block 16) -> Link (gloo) -> scatter (block 32), as bench_transfer's ncclkv "
                "path; engine push: TransferEngine start_push / save_layer per layer -> TransferEngine in the peer "
                "(the same caches)",
        "checked": "every mode of each row's last timed round: the receiver's cache scrambled before it, every "
                   "layer's hash compared with the sender's after it (the last layer alone for 1 layer alone)",
        "exposed": "receiver done - end of last compute, in units of x measured alone in the same round; median and min",
    }
    return BenchResult(NAME, TITLE, COLUMNS, rows, meta, _headline(rows), ANALYSIS)


def _engine_rows(case: SliceCase, params: OverlapParams, busy: Busy, repeats: int, peer: Any,
                 ctx: BenchContext) -> list[dict[str, Any]]:
    """The engine path's rows: a producer engine per (``piece_bytes``, ``last_piece_bytes``), one consumer engine
    in the peer."""
    rows: list[dict[str, Any]] = []
    peer.start("benchmarks._engine_path:consumer_loop", case={f: getattr(case, f) for f in SliceCase.__slots__})
    try:
        address = peer.endpoint.expect("address", WAIT_S)
        for piece_bytes, last_piece_bytes in params.engine_pieces:
            ctx.progress(f"{NAME}: engine push, piece_bytes {piece_bytes}, last_piece_bytes {last_piece_bytes}")
            side = PagedSide(case, case.src_block_size, seed=1)
            sender = EngineSender(side, f"bench-overlap-producer-{piece_bytes}-{last_piece_bytes}", piece_bytes,
                                  last_piece_bytes)
            try:
                sender.connect(CONSUMER_ID, address)
                ids = itertools.count()

                def engine_mode(mode: str, compute: Callable[[], None], sender: EngineSender = sender) -> tuple[float, float, float]:
                    return engine_scenario(mode, sender, compute, peer,
                                           f"overlap-{piece_bytes}-{last_piece_bytes}-{next(ids)}")

                label = chunked(case, piece_bytes)
                sent = _sent_as(label, chunked(case, last_piece_bytes or piece_bytes))
                check = _ByteCheck(peer, side.digests(), f"engine push, piece_bytes {piece_bytes}, "
                                   f"last_piece_bytes {last_piece_bytes}")
                rows += [{**_config(c, label, "engine push", engine_mode, ENGINE_MODES, busy, repeats, ctx, check),
                          **sent} for c in params.compute_ms]
            finally:
                sender.close()
    finally:
        peer.endpoint.send("end")
        peer.result()
    return rows


def _pieces(case: SliceCase) -> str:
    """How one layer goes: ``N x SIZE``."""
    return f"{len(case.chunks())} x {format_size(len(case.chunks()[0]) * case.token_bytes)}"


def _sent_as(layer: SliceCase, last: SliceCase) -> dict[str, str]:
    """The row's ``sent as`` (each layer's pieces, and the last layer's where they differ) and its group."""
    whole, whole_last = len(layer.chunks()) == 1, len(last.chunks()) == 1
    if _pieces(last) == _pieces(layer):
        return {"chunks": _pieces(layer), "group": "whole layers" if whole else "in pieces"}
    return {"chunks": f"{_pieces(layer)}, last {_pieces(last)}",
            "group": "whole, the last layer in pieces" if whole and not whole_last else "in pieces"}


def _pieces_kib(text: str) -> tuple[int, int]:
    try:
        piece, last = (int(part) for part in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected P:L in KiB (e.g. 0:4096), got {text!r}") from None
    if piece < 0 or last < 0:
        raise argparse.ArgumentTypeError(f"piece sizes must be >= 0 KiB, got {text!r}")
    return piece << 10, last << 10


def _parse(argv: Sequence[str] | None) -> tuple[BenchOptions, OverlapParams]:
    parser = argparse.ArgumentParser(prog="bench_overlap", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--repeats", type=int)
    parser.add_argument("--layers", type=int, help="layers per prefill (default 16; quick 6)")
    parser.add_argument("--compute-ms", type=float, nargs="+", help="compute per layer, one row each (default 5 10 20 30)")
    parser.add_argument("--transfer-ms", type=float, help="transfer per layer, sets the slice size (default 10)")
    parser.add_argument("--chunk-kib", type=int, nargs="+", help="chunk sizes, 0 = whole layer (default 0 2048 4096)")
    parser.add_argument("--engine-pieces", type=_pieces_kib, nargs="*", metavar="P:L",
                        help="engine path, one row set each: the producer's piece_bytes P and last_piece_bytes L in "
                             "KiB, 0 = whole (default 0:0 0:4096 4096:4096; none: no engine rows)")
    args = parser.parse_args(argv)
    params = OverlapParams.quick() if args.quick else OverlapParams()
    params = replace(
        params, num_layers=args.layers or params.num_layers, transfer_ms=args.transfer_ms or params.transfer_ms,
        compute_ms=tuple(args.compute_ms) if args.compute_ms else params.compute_ms, 
        chunk_bytes=tuple(k << 10 for k in args.chunk_kib) if args.chunk_kib else params.chunk_bytes,
        engine_pieces=params.engine_pieces if args.engine_pieces is None else tuple(args.engine_pieces),
    )
    if params.num_layers < 2 or params.transfer_ms <= 0 or min(params.compute_ms) <= 0:
        parser.error(f"need layers >= 2 and positive times, got {params}")
    command = standalone_command("bench_overlap", argv)
    return BenchOptions(args.quick, args.repeats, args.out or default_out(args.quick), command), params


def main(argv: Sequence[str] | None = None) -> int:
    opts, params = _parse(argv)
    return run_standalone(lambda ctx: run(ctx, params), plot, opts)


if __name__ == "__main__":
    raise SystemExit(main())

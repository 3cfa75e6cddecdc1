"""CacheBlend prefill against full prefill on the reference model: recompute fraction, speed-up, error.

A prompt of ``--chunks`` cached chunks plus an uncached query. Each chunk is
prefilled alone at positions 0.. and stored in a ChunkStore; then, per round,
the full prefill (the baseline) and a CacheBlend prefill at each recompute
ratio run back to back, so both see the same machine load. The error is the
relative L2 distance of the query tokens' final hidden states from the full
prefill's; ratio 0 is plain reuse of the chunks (nothing recomputed but the
query), the quality floor that CacheBlend improves on.

    python -m benchmarks.bench_blend [--quick] [--out DIR] [--device cuda]

``ncclkv bench blend`` runs it with one torch thread, like the other benchmarks.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from ncclkv.blend import BlendConfig, BlendExecutor, BlendRetriever, ChunkStore, RopeSpec
from ncclkv.blend.reference_model import TinyLlama, TinyLlamaConfig
from ncclkv.buffer import KVStoreBuffer

from ._common import (
    BenchContext, BenchResult, Column, default_out, machine_info, pyplot, show_and_save, standalone_command,
    write_figure,
)

__all__ = ["NAME", "TITLE", "main", "plot", "run"]

NAME = "blend"
TITLE = "CacheBlend prefill against full prefill: recompute fraction, speed-up, error"


def _timed(fn: Callable[[], object], device: torch.device) -> tuple[float, object]:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    value = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start, value


def _setup(args: argparse.Namespace,
           device: torch.device) -> tuple[TinyLlama, torch.Tensor, list[int], BlendRetriever]:
    hidden = args.hidden
    cfg = TinyLlamaConfig(vocab_size=1024, hidden_size=hidden, num_layers=args.layers, num_heads=hidden // 32,
                          num_kv_heads=max(1, hidden // 64), head_size=32, intermediate_size=3 * hidden,
                          rope=RopeSpec(theta=10000.0))
    model = TinyLlama(cfg, device=device)
    gen = torch.Generator().manual_seed(7)
    chunks = [torch.randint(0, cfg.vocab_size, (n,), generator=gen).to(device)
              for n in [args.chunk_tokens] * args.chunks + [args.query_tokens]]
    query = chunks.pop()
    store = ChunkStore(KVStoreBuffer(1 << 34), cfg.num_layers)
    for chunk in chunks:
        pre = model.prefill(chunk)
        store.store_chunk(chunk, pre.k, pre.v, torch.arange(chunk.numel()))
    starts = [i * args.chunk_tokens for i in range(args.chunks + 1)]  # the last start is the query
    return model, torch.cat(chunks + [query]), starts, BlendRetriever(store, device=device, deadline_s=60.0)


def _run(args: argparse.Namespace, device: torch.device) -> list[dict[str, object]]:
    model, prompt, starts, retriever = _setup(args, device)
    query_start = starts[-1]

    def blend(ratio: float) -> Callable[[], object]:
        def go() -> object:
            executor = BlendExecutor(BlendConfig(check_layer=args.check_layer, recompute_ratio=ratio))
            with retriever.new_request([prompt], [starts]) as task:
                return model.blend_prefill(prompt, task, executor)
        return go

    full_fn = lambda: model.prefill(prompt)  # noqa: E731
    for _ in range(args.warmup):
        full_fn()
        for ratio in args.ratios:
            blend(ratio)()
    full_times: list[float] = []
    times: dict[float, list[float]] = {r: [] for r in args.ratios}
    outputs: dict[float, object] = {}
    full = None
    for _ in range(args.repeats):
        elapsed, full = _timed(full_fn, device)
        full_times.append(elapsed)
        for ratio in args.ratios:
            elapsed, outputs[ratio] = _timed(blend(ratio), device)
            times[ratio].append(elapsed)
    assert full is not None
    ref = full.hidden[query_start:]
    full_median = statistics.median(full_times)
    rows = []
    for ratio in args.ratios:
        out = outputs[ratio]
        mine = out.hidden[out.token_indices >= query_start]
        error = float((mine - ref).norm() / ref.norm())
        median = statistics.median(times[ratio])
        rows.append({
            "ratio": ratio, "tokens": prompt.numel(), "computed": int(out.token_indices.numel()),
            "recompute_fraction": out.token_indices.numel() / prompt.numel(),
            "full_ms_median": 1e3 * full_median, "blend_ms_median": 1e3 * median,
            "blend_ms_best": 1e3 * min(times[ratio]), "speedup_median": full_median / median,
            "speedup_best": min(full_times) / min(times[ratio]), "query_rel_error": error,
        })
    return rows


COLUMNS = (
    Column("ratio", "recompute ratio"),
    Column("tokens", "tokens", "{:d}"),
    Column("computed", "computed", "{:d}"),
    Column("recompute_fraction", "fraction", "{:.3f}"),
    Column("full_ms_median", "full ms", "{:.1f}"),
    Column("blend_ms_median", "blend ms", "{:.1f}"),
    Column("speedup_median", "speed-up median"),
    Column("speedup_best", "best"),
    Column("query_rel_error", "query error", "{:.3f}"),
)

ANALYSIS = """\
A blend prefill computes every token in the layers before the check layer. At
the check layer it projects Q/K/V for every token (its K is compared with the
retrieved K to choose the tokens to recompute: the recompute ratio of the
cached chunks' tokens, plus every query token), and from there on attention and
MLP run for the chosen tokens only, attending to the long K/V: the retrieved
chunks with the fresh rows written over them. With L layers, check layer c and
recompute fraction f the projections and MLPs cost about c + (L - c) f layers
of full prefill, plus the check layer's projections, retrieving the chunks and
re-rotating their K to the new positions; attention shrinks more (f x all keys
instead of all x all, halved by the causal mask), so on long prompts the
speed-up can pass L / (c + (L - c) f). It falls towards 1 as the ratio nears 1
(at 1 it is full prefill plus the retrieval: slightly below 1). The timings
share two cores with other jobs, so medians move between runs; the fractions
and errors do not. The error is the query tokens' final hidden
states against full prefill's (relative L2): ratio 0 reuses the chunks as they
were prefilled alone, without the cross-chunk attention they missed; picking
the tokens whose K deviates most and recomputing them restores part of it. The
model is the random-weight reference model, so the error says how the
selection behaves, not the quality of a trained model's answers.
"""


def _headline(rows: list[dict[str, Any]]) -> list[str]:
    partial = [r for r in rows if 0 < r["ratio"] < 1] or rows
    pick = min(partial, key=lambda r: abs(r["ratio"] - 0.15))
    lines = [f"speed-up over full prefill at recompute ratio {pick['ratio']:g} (median): "
             f"{pick['speedup_median']:.2f}x, {pick['recompute_fraction']:.1%} of tokens computed, "
             f"query error {pick['query_rel_error']:.3f}"]
    reuse = next((r for r in rows if r["ratio"] == 0), None)
    if reuse is not None:
        lines.append(f"plain reuse (ratio 0): {reuse['speedup_median']:.2f}x, query error "
                     f"{reuse['query_rel_error']:.3f}")
    return lines


def plot(result: BenchResult, path: Path) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    rows = result.rows
    ratios = [r["ratio"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(ratios, [r["speedup_median"] for r in rows], marker="o")
    left.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    left.set(title="speed-up over full prefill (median)", xlabel="recompute ratio")
    right.plot(ratios, [r["query_rel_error"] for r in rows], marker="o", color="tab:red")
    right.set(title="query hidden-state error vs full", xlabel="recompute ratio", ylabel="relative L2")
    return write_figure(plt, fig, path)


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench_blend", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small model and prompt, few rounds (a few seconds)")
    parser.add_argument("--out", type=Path, help="folder for blend.json / blend.png (default out/, quick out/quick/)")
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.0, 0.05, 0.15, 0.3, 1.0])
    parser.add_argument("--check-layer", type=int, default=1)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--chunk-tokens", type=int, help="tokens per chunk (default 256; quick 96)")
    parser.add_argument("--query-tokens", type=int, default=32)
    parser.add_argument("--hidden", type=int, help="hidden size, a multiple of 64 (default 256; quick 128)")
    parser.add_argument("--layers", type=int, help="layers (default 8; quick 4)")
    parser.add_argument("--repeats", type=int, help="timed rounds (default 5; quick 2)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's; quick 1, which shared "
                        "cores slow down far less)")
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args(argv)
    args.chunk_tokens = args.chunk_tokens or (96 if args.quick else 256)
    args.hidden = args.hidden or (128 if args.quick else 256)
    args.layers = args.layers or (4 if args.quick else 8)
    args.repeats = args.repeats or (2 if args.quick else 5)
    args.threads = args.threads or (1 if args.quick else None)
    if args.quick:
        args.ratios = [r for r in args.ratios if r in (0.0, 0.15, 1.0)] or args.ratios
    if args.hidden % 64 or args.repeats < 1 or args.warmup < 0 or not 0 <= args.check_layer < args.layers:
        parser.error(f"need hidden % 64 == 0, repeats >= 1, warmup >= 0, 0 <= check-layer < layers; got "
                     f"{args.hidden}, {args.repeats}, {args.warmup}, {args.check_layer}")
    sizes_ok = min(args.chunks, args.chunk_tokens, args.query_tokens) >= 1
    if any(not 0.0 <= r <= 1.0 for r in args.ratios) or not sizes_ok:
        parser.error(f"need ratios in [0, 1] and chunks, chunk/query tokens >= 1; got {args.ratios}, "
                     f"{args.chunks}, {args.chunk_tokens}, {args.query_tokens}")
    return args


def _measure(args: argparse.Namespace) -> list[dict[str, object]]:
    device = torch.device(args.device)
    threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        return _run(args, device)
    finally:
        torch.set_num_threads(threads)  # may run inside another program (tests, ncclkv bench)


def _result(args: argparse.Namespace, rows: list[dict[str, object]], command: str) -> BenchResult:
    meta = {
        "machine": machine_info(), "command": command, "quick": args.quick, "device": args.device,
        "threads": args.threads or torch.get_num_threads(), "hidden": args.hidden, "layers": args.layers,
        "chunks": args.chunks, "chunk_tokens": args.chunk_tokens, "query_tokens": args.query_tokens,
        "check_layer": args.check_layer, "repeats": args.repeats,
        "model": "ncclkv.blend.reference_model (random weights)",
    }
    return BenchResult(NAME, TITLE, COLUMNS, rows, meta, _headline(rows), ANALYSIS)  # type: ignore[arg-type]


def run(ctx: BenchContext) -> BenchResult:
    """The benchmark with its defaults (quick when the context is quick), for ``ncclkv bench``."""
    opts = ctx.options
    argv = ["--threads", "1"] + (["--quick"] if opts.quick else [])
    argv += [] if opts.repeats is None else ["--repeats", str(opts.repeats)]
    args = _parse(argv)
    ctx.progress(f"{NAME}: {args.chunks} chunks of {args.chunk_tokens} tokens, ratios {args.ratios}")
    return _result(args, _measure(args), opts.command)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    command = standalone_command("bench_blend", argv)
    result = _result(args, _measure(args), command)
    return show_and_save(result, args.out or default_out(args.quick), None if args.no_plot else plot)


if __name__ == "__main__":
    raise SystemExit(main())

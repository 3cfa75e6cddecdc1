"""CacheBlend prefill against full prefill on the reference model: recompute fraction, speed-up, error.

A prompt of ``--chunks`` cached chunks plus an uncached query. Each chunk is
prefilled alone at positions 0.. and stored in a ChunkStore; then, per round,
the full prefill (the baseline) and a CacheBlend prefill at each recompute
ratio run back to back, so both see the same machine load. The error is the
relative L2 distance of the query tokens' final hidden states from the full
prefill's; ratio 0 is plain reuse of the chunks (nothing recomputed but the
query), the quality floor that CacheBlend improves on.

    python -m benchmarks.bench_blend [--quick] [--out DIR] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from ncclkv.blend import BlendConfig, BlendExecutor, BlendRetriever, ChunkStore, RopeSpec
from ncclkv.blend.reference_model import TinyLlama, TinyLlamaConfig
from ncclkv.buffer import KVStoreBuffer

__all__ = ["main"]

DEFAULT_OUT = Path(__file__).resolve().parent / "out"


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


def _table(rows: list[dict[str, object]]) -> str:
    head = (f"{'ratio':>6}{'tokens':>8}{'computed':>10}{'fraction':>10}{'full ms':>9}{'blend ms':>10}"
            f"{'speed-up':>10}{'best':>7}{'error':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['ratio']:>6.2f}{r['tokens']:>8}{r['computed']:>10}{r['recompute_fraction']:>10.3f}"
                     f"{r['full_ms_median']:>9.1f}{r['blend_ms_median']:>10.1f}{r['speedup_median']:>9.2f}x"
                     f"{r['speedup_best']:>6.2f}x{r['query_rel_error']:>8.3f}")
    return "\n".join(lines)


def _plot(rows: list[dict[str, object]], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    ratios = [r["ratio"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(ratios, [r["speedup_median"] for r in rows], marker="o")
    left.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    left.set(title="speed-up over full prefill (median)", xlabel="recompute ratio")
    right.plot(ratios, [r["query_rel_error"] for r in rows], marker="o", color="tab:red")
    right.set(title="query hidden-state error vs full", xlabel="recompute ratio", ylabel="relative L2")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench_blend", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small model and prompt, few rounds (a few seconds)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="folder for blend.json / blend.png")
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


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = _run(args, device)
    print(_table(rows))
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {
        "torch": torch.__version__, "device": str(device), "threads": torch.get_num_threads(),
        "machine": platform.machine(), "hidden": args.hidden, "layers": args.layers, "chunks": args.chunks,
        "chunk_tokens": args.chunk_tokens, "query_tokens": args.query_tokens, "check_layer": args.check_layer,
        "repeats": args.repeats, "quick": args.quick, "model": "ncclkv.blend.reference_model (random weights)",
    }
    (args.out / "blend.json").write_text(json.dumps({"meta": meta, "results": rows}, indent=1))
    plotted = not args.no_plot and _plot(rows, args.out / "blend.png")
    print(f"wrote {args.out / 'blend.json'}" + (f" and {args.out / 'blend.png'}" if plotted else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
